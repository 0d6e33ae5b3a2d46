"""Negative control: concurrent requests receive each other's tokens.

Defect: in mlx_lm.server's dense batched mode, whenever two or more requests
are generating in the same batch step and each has already received its first
token, the step's (token, log-probs) pairs are rotated by one row before the
server reads them (a ``BatchGenerator`` whose ``next`` rotates them), so from
a request's second token on, another request's outputs are delivered to it.
The model itself generates correctly (every row keeps feeding its own token),
only the delivery is wrong: a scheduler bug that shows only under concurrency.
A request sent alone is never in a step with another, and is served exactly
as mlx_lm.server serves it.

What a gate should report: (a) concurrent against alone fails (tokens and
log-probs of overlapping requests differ from the second token on; which
requests share steps depends on their timing, so some, not always all, of a
concurrent set differ), and so do (b) and (c) for those requests; requests
sent one at a time pass (a), (b) and (c) as mlx_lm.server does. With
``--kv-bits`` mlx_lm.server serves one request at a time, so the defect
shows only without it.
"""

from mlx_lm import server

from kvparity.impl.servers import serve


class SwappingBatchGenerator(server.BatchGenerator):
    """Rotates the outputs of the rows past their first token by one row."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started = set()

    def next(self):
        prompt_responses, gen_responses = super().next()
        started = [r for r in gen_responses if r.uid in self._started]
        if len(started) > 1:
            outputs = [(r.token, r.logprobs) for r in started]
            for r, (token, logprobs) in zip(started, outputs[1:] + outputs[:1]):
                r.token, r.logprobs = token, logprobs
        self._started.update(r.uid for r in gen_responses if r.finish_reason is None)
        self._started.difference_update(r.uid for r in gen_responses if r.finish_reason)
        return prompt_responses, gen_responses


if __name__ == "__main__":
    serve("BatchGenerator", SwappingBatchGenerator)

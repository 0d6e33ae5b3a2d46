"""Negative control: right tokens, log-probs rounded to 4 decimal places.

Defect: every log-prob the server hands to its JSON responses, the chosen
token's and each ``top_logprobs`` entry's, is rounded to 4 decimal places (a
``Response`` record that rounds its ``logprob`` and ``top_tokens`` as it is
made), in the batched and the one-at-a-time mode alike, so every response
format mlx_lm.server writes log-probs into carries rounded numbers. Tokens and
text are mlx_lm.server's.

What a gate should report: tokens agree everywhere; log-probs fail (b) and (c)
against mlx-lm's own float32 log-probs (off by up to 5e-5, and no longer
float32 values), while (a) passes, since the same request gets the same
rounded numbers alone and concurrently.
"""

from dataclasses import dataclass

from mlx_lm import server

from kvparity.impl.servers import serve


@dataclass
class RoundedResponse(server.Response):
    """mlx_lm.server's per-token record, with its log-probs rounded."""

    def __post_init__(self):
        self.logprob = round(self.logprob, 4)
        self.top_tokens = tuple(
            {**top, "logprob": round(top["logprob"], 4)} for top in self.top_tokens
        )


if __name__ == "__main__":
    serve("Response", RoundedResponse)

"""Negative control: quantizes a request it serves alone, batches dense under load.

Defect: with ``--kv-bits``, mlx_lm.server serves one request at a time,
quantized. This server does that for a request that arrives while no other
is in flight, but a request that arrives while others are goes into
mlx_lm.server's dense batched mode with them (its ``BatchGenerator`` has no
``kv_bits``): a server whose quantized path is only its single-request path.

What a gate should report, when the server is started with ``--kv-bits``:
(a) a request served among others against itself served alone fails; (b)
against mlx-lm's solo generate_step with the same kv_bits it fails; (c) it
answers as mlx-lm's dense run, while alone it answered as the kv_bits run:
"quantized alone, dense when batched with others", not "did not quantize".
Requests sent one at a time pass all three.
"""

import threading

from mlx_lm import server

from kvparity.impl.servers import serve


class BatchesDenseUnderLoad(server.ResponseGenerator):
    """Counts the requests in flight; with others in flight, a request is batched (dense)."""

    def __init__(self, *args, **kwargs):
        self._lock, self._in_flight = threading.Lock(), 0  # before the generation thread starts
        super().__init__(*args, **kwargs)

    def generate(self, request, generation_args, progress_callback=None):
        with self._lock:
            self._in_flight += 1
        try:
            ctx, answer = super().generate(request, generation_args, progress_callback)
        except BaseException:
            self._done()
            raise

        def counted():
            try:
                yield from answer
            finally:
                self._done()

        return ctx, counted()

    def _done(self):
        with self._lock:
            self._in_flight -= 1

    def _is_batchable(self, args):
        if self.cli_args.kv_bits is None:
            return super()._is_batchable(args)
        return self.model_provider.is_batchable and args.seed is None and self._in_flight > 1


if __name__ == "__main__":
    serve("ResponseGenerator", BatchesDenseUnderLoad)

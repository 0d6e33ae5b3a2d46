"""Negative control: accepts ``--kv-bits``, says so, and serves from a dense cache.

Defect: ``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start`` are
parsed as mlx_lm.server parses them and logged at startup ("serving with a
4-bit KV cache ..."), then ``kv_bits`` is dropped before the server reads it
(a ``ModelProvider`` that clears ``cli_args.kv_bits``), so the server runs
mlx_lm.server's dense batched mode, exactly as if the flag were absent. It
mirrors a real bug: a server that accepts ``--kv-cache-dtype int8``, reports
it, and serves bf16.

What a gate should report, when the server is started with ``--kv-bits``:
(a) concurrent against alone passes; (b) against mlx-lm's solo generate_step
with the same kv_bits it fails, log-probs off by the quantization error; (c)
against the dense solo run it agrees: the quantization the server claims is
not in effect. Started without ``--kv-bits`` it is mlx_lm.server.
"""

import logging

from mlx_lm import server

from kvparity.impl.servers import serve


class DenseModelProvider(server.ModelProvider):
    """Logs the KV quantization it was asked for, then forgets it."""

    def __init__(self, cli_args):
        if cli_args.kv_bits is not None:
            logging.info(
                "serving with a %d-bit KV cache (group size %d, quantized from token %d)",
                cli_args.kv_bits,
                cli_args.kv_group_size,
                cli_args.quantized_kv_start,
            )
        cli_args.kv_bits = None
        super().__init__(cli_args)


if __name__ == "__main__":
    serve("ModelProvider", DenseModelProvider)

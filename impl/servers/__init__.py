"""Negative-control HTTP servers for L4: mlx_lm.server with one planted defect each.

Each module runs as ``python -m kvparity.impl.servers.<name>`` with
mlx_lm.server's command-line flags, unchanged (``--model``, ``--port``,
``--kv-bits``, ...), and serves exactly as mlx_lm.server does but for the one
defect its docstring names, together with what the L4 gate must report:

* ``ignores_kv_bits``: reports ``--kv-bits`` at startup, serves a dense cache.
* ``swaps_rows``: concurrent requests get each other's tokens and log-probs.
* ``rounds_logprobs``: log-probs rounded to 4 decimal places.
* ``quantizes_alone_only``: with ``--kv-bits``, a request alone is served
  quantized, one that arrives while others are in flight is batched dense.

Each replaces one name in ``mlx_lm.server`` with a small subclass of the piece
it names, through :func:`serve`; none copies mlx_lm.server's code.
"""

from mlx_lm import server


def serve(name, replacement):
    """Replace ``mlx_lm.server.<name>`` with ``replacement``, then run mlx_lm.server."""
    getattr(server, name)  # the name must exist: a patch that misses would serve unbroken
    setattr(server, name, replacement)
    server.main()

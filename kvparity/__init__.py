"""kvparity: parity harness for batched, affine-quantized KV caches on MLX.

The code lives in the top-level folders of the repository (impl/, oracle/,
suites/, reports/) and is installed as subpackages of this one.
"""

__version__ = "0.1.0"

"""MLX's CUDA backend: quantized_matmul against rows of one quantization group returns wrong numbers.

``mx.quantized_matmul(x, w, scales, biases, transpose=True)`` where each row
of ``w`` is a single group (its length equals ``group_size``, e.g. head_dim
64 with group 64, as mlx-lm's quantized attention computes scores) and ``x``
holds more than one vector (a batch, several heads, or several rows) gives
values unrelated to the CPU's exact answer (constants, zeros); one vector,
or rows of two groups or more, are right. The inputs are on the
quantization grid, so every right answer is exact and the CPU's is compared
bit for bit. Found by kvparity's known-answer device check on an H200
(MLX 0.32.4, mlx-cuda-13).

Plain mlx and numpy. Exits 1 while some shape below is wrong on the GPU,
0 once all are right, 2 where MLX has no GPU backend.
"""

import sys

import mlx.core as mx
import numpy as np

rng = np.random.default_rng(0)


def on_grid(shape, bits, group_size):
    """Integer codes times 1/4, each group holding the smallest and largest code."""
    top = 2 ** bits - 1
    codes = rng.integers(0, top + 1, size=shape)
    codes[..., ::group_size] = 0
    codes[..., 1::group_size] = top
    return (codes - 2 ** (bits - 1)) * 0.25


def wrong_on_gpu(x_shape, w_shape, group_size, bits=4):
    x = mx.array(rng.integers(-1, 2, size=x_shape) * 0.5, dtype=mx.float32)
    w = mx.quantize(mx.array(on_grid(w_shape, bits, group_size), dtype=mx.float32), group_size=group_size,
                    bits=bits, stream=mx.cpu)
    cpu, gpu = (mx.quantized_matmul(x, *w, transpose=True, group_size=group_size, bits=bits, stream=s)
                for s in (mx.cpu, mx.gpu))
    return not mx.array_equal(cpu, gpu).item()


if not mx.is_available(mx.gpu):
    print("cannot run here: this MLX has no GPU backend")
    sys.exit(2)
# (x, w, group size): the first four are one group per row, the last three two or more.
SHAPES = [((2, 2, 1, 64), (2, 2, 16, 64), 64), ((1, 4, 1, 64), (1, 4, 16, 64), 64), ((4, 64), (16, 64), 64),
          ((4, 128), (16, 128), 128), ((1, 64), (16, 64), 64), ((2, 2, 1, 128), (2, 2, 16, 128), 64),
          ((4, 64), (16, 64), 32)]
wrong = [(x, w, g) for x, w, g in SHAPES if wrong_on_gpu(x, w, g)]
for x, w, g in wrong:
    print(f"DEFECT: mlx {mx.__version__} on {mx.device_info().get('device_name', 'the GPU')}: quantized_matmul "
          f"x{x} @ w{w}.T, group size {g}, 4 bits, differs from the CPU's exact answer")
if wrong:
    sys.exit(1)
print(f"fixed: mlx {mx.__version__}: quantized_matmul agrees with the CPU on all {len(SHAPES)} shapes")

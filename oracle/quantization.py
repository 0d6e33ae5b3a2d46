"""The affine quantization settings the harness knows, declared once.

What ``mx.quantize`` packs (bits), the group sizes it accepts, and the
dtypes a schedule's synthetic keys and values may have. The schedule format,
the coverage model, the generated schedules, the L0 probes and calibration
all read these (impl/ keeps its own check: it imports nothing of the
harness).
"""

BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
GROUP_SIZES = (32, 64, 128)
DTYPES = ("bfloat16", "float16", "float32")

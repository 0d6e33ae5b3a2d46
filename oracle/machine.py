"""The machine a computation ran on: what decides the bits it produces.

Solo traces are keyed by it, and goldens from a machine that differs are
refused naming the key.
"""

import os
import platform
from importlib import metadata

import mlx.core as mx

# Environment variables that change MLX numerics or kernel choice.
NUMERIC_KNOBS = ("MLX_ENABLE_TF32", "MLX_METAL_FAST_SYNCH", "MLX_MAX_OPS_PER_BUFFER", "OMP_NUM_THREADS")


def package_version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def device_name(device=None) -> str:
    device = device or mx.default_device()
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
    except Exception:  # some backends cannot describe themselves
        info = {}
    name = info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    return f"{device.type.name} ({name})" if name else device.type.name


def machine(device=None) -> dict:
    device = device or mx.default_device()
    return {
        "backend": device.type.name,
        "device": device_name(device),
        "mlx": mx.__version__,
        "mlx_lm": package_version("mlx-lm"),
        "knobs": {k: os.environ.get(k) for k in NUMERIC_KNOBS},
    }


def environment(device=None) -> dict:
    """The machine plus the software around it."""
    return {
        "kvparity": package_version("kvparity"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **machine(device),
    }

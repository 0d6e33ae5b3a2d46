"""The environment a run happened in: what changes numerics, and what ran."""

import os
import platform
import subprocess
from importlib import metadata

import mlx.core as mx

# Environment variables that change MLX numerics or kernel choice.
NUMERIC_KNOBS = ("MLX_ENABLE_TF32", "MLX_METAL_FAST_SYNCH", "MLX_MAX_OPS_PER_BUFFER", "OMP_NUM_THREADS")


def _version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit(directory="."):
    """The commit of the repository under test, when there is one."""
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def device_name(device=None) -> str:
    device = device or mx.default_device()
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
    except Exception:  # some backends cannot describe themselves
        info = {}
    name = info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    return f"{device.type.name} ({name})" if name else device.type.name


def machine(device=None) -> dict:
    """What decides the bits a computation produces here: solo traces are
    keyed by it, and goldens from a machine that differs are refused."""
    device = device or mx.default_device()
    return {
        "backend": device.type.name,
        "device": device_name(device),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "knobs": {k: os.environ.get(k) for k in NUMERIC_KNOBS},
    }


def describe(implementation=None, model=None, device=None) -> dict:
    env = {
        "kvparity": _version("kvparity"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **machine(device),
        "git_commit": git_commit(),
    }
    if implementation is not None:
        env["implementation"] = implementation.spec
        env["capabilities"] = implementation.capabilities
    if model is not None:
        env["model"] = model.name
        env["model_sha256"] = model.sha256
    return env

"""A model given by path is loaded, planned and probed first in a child
process: a native crash of MLX or mlx-lm on the model's own forward passes
(phi3small on MLX 0.32's CPU backend: its memory is corrupted by a prefill and
a decode step, oracle/mlx_lm_defects/phi3small_crash_after_decode.py) ends
that child, not kvparity, and becomes the model's named reason. The parent
takes the plan and limit the child found, so it runs no forward pass of the
model to load it."""

import os
import pickle
import subprocess
import sys
import tempfile

from .gguf import ModelUnavailable
from .signals import signal_name

CHILD_MODULE = "kvparity.oracle.probe_child"
CHILD_ENV = "KVPARITY_MODEL_PROBE_CHILD"  # set in the child: it probes in process
PROBE_TIMEOUT_S = 900.0  # a real model directory's load and probe on a slow machine, with room


def probed_in_a_child(path: str):
    """(plan, limit) of the model at ``path``, found in a child process, or
    None (a Python error there, which the parent's own load raises again, or
    this is the child). ModelUnavailable where the child ended by a signal or
    outran the timeout: its memory may have been corrupted before it wrote,
    so nothing it wrote is taken."""
    if os.environ.get(CHILD_ENV):
        return None
    with tempfile.TemporaryDirectory(prefix="kvparity-probe-") as folder:
        found = os.path.join(folder, "probed.pickle")
        command = [sys.executable, "-m", CHILD_MODULE, path, found]
        try:
            done = subprocess.run(command, env={**os.environ, CHILD_ENV: "1"}, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ModelUnavailable(f"{path}: loading it and probing its forward passes with mlx-lm did not finish "
                                   f"within {PROBE_TIMEOUT_S:g} s") from None
        if done.returncode < 0:
            last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise ModelUnavailable(
                f"{path}: mlx-lm's own forward passes on this model (a prefill, a decode step, generate_step with "
                f"kv_bits) ended the process with {signal_name(done.returncode)}, a crash inside MLX or mlx-lm, "
                f"not a verdict; its last line: {last}")
        if done.returncode != 0 or not os.path.exists(found):
            return None
        with open(found, "rb") as kept:
            return pickle.load(kept)  # our own child's, from a folder of our own

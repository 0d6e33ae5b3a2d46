"""Refuse a device the gate cannot run on, before anything is installed around it.

``cpu`` (the default) is the bit-exact gate and runs on any runner: Linux,
GitHub-hosted macOS, self-hosted Apple silicon. ``gpu`` needs MLX on the
Metal GPU, which GitHub-hosted macOS runners do not give (their paravirtual
device is not one to trust), so it wants a self-hosted Apple-silicon runner.
Either way ``kvparity run`` then proves the device computes with its
known-answer check before it judges anything (125 and a report if not).

Exit 0 when the device can be used; else an ``::error`` annotation and the
status (125 cannot judge here, 129 a bad ``device`` input), also written to
``$GITHUB_OUTPUT`` as the action's ``exit-status``.
"""

import os
import sys

from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, EXIT_USAGE
from workflow_commands import error, record_exit_status

DEVICES = ("cpu", "gpu")


def refusal(device: str):
    """(status, why) when ``device`` cannot be used here, else None."""
    if device not in DEVICES:
        return EXIT_USAGE, f"the input device is {device!r}: expected one of {', '.join(DEVICES)}"
    try:
        import mlx.core as mx
    except ImportError as missing:
        return EXIT_CANNOT_JUDGE, f"MLX cannot be imported: {missing}"
    if device == "gpu" and not mx.metal.is_available():
        return EXIT_CANNOT_JUDGE, (f"MLX {mx.__version__} has no Metal GPU on this runner; the GPU gate needs a "
                                   "self-hosted Apple-silicon runner (device: cpu gates bit-exact anywhere)")
    return None


def main() -> int:
    device = os.environ.get("KVPARITY_DEVICE", "cpu").strip() or "cpu"
    refused = refusal(device)
    if refused is None:
        import mlx.core as mx
        where = "the Metal GPU" if device == "gpu" else "the CPU (bit-exact)"
        print(f"mlx {mx.__version__} gates on {where}; kvparity run checks it computes known answers first")
        return 0
    status, why = refused
    print(error("kvparity refuses to gate", why))
    record_exit_status(status)
    return status


if __name__ == "__main__":
    sys.exit(main())

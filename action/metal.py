"""Refuse to gate unless MLX runs on the Metal GPU.

A runner without Metal would run every check on the CPU and report a GPU
gate it never ran. Exit 0 when MLX says Metal is available (the gate then
runs with ``--device gpu``); else an ``::error`` annotation and exit 125
(cannot judge here), also written to ``$GITHUB_OUTPUT`` as the action's
``exit-status``.
"""

import os
import sys

from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE
from workflow_commands import error


def main() -> int:
    try:
        import mlx.core as mx
    except ImportError as missing:
        problem = f"MLX cannot be imported: {missing}"
    else:
        problem = "" if mx.metal.is_available() else f"MLX {mx.__version__} has no Metal GPU on this runner"
    if problem:
        print(error("kvparity refuses to gate", f"{problem}; a GPU gate needs an Apple-silicon runner "
                    "(macos-14 or later) where MLX runs on Metal"))
        if os.environ.get("GITHUB_OUTPUT"):
            with open(os.environ["GITHUB_OUTPUT"], "a", encoding="utf-8") as output:
                output.write(f"exit-status={EXIT_CANNOT_JUDGE}\n")
        return EXIT_CANNOT_JUDGE
    print(f"mlx {mx.__version__} runs on the Metal GPU ({mx.default_device()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

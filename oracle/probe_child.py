"""The child process of ``oracle/isolation.py``: load a model given by path,
plan it and probe mlx-lm's limit on it, in process; exit 0 where it lived."""

import sys

from .models import load_model


def main(argv) -> int:
    (path,) = argv
    load_model(path).limit  # the plan runs the model as it loads; the limit runs it once more
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The child process of ``oracle/isolation.py``: load a model given by path,
plan it and probe mlx-lm's limit on it, in process, and write both to the
file given (pickled, written whole or not at all)."""

import os
import pickle
import sys

from .models import load_model


def main(argv) -> int:
    path, out = argv
    loaded = load_model(path)  # the plan runs the model as it loads; the limit runs it once more
    found = pickle.dumps((loaded.plan, loaded.limit))
    with open(out + ".partial", "wb") as kept:
        kept.write(found)
    os.replace(out + ".partial", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""How a process a signal ended is named, in one wording for every message
(kvparity's own children, a cache's process, a model probe)."""

import signal


def signal_name(returncode: int) -> str:
    """``SIGABRT (6)`` for a child that a signal ended (a negative status)."""
    try:
        return f"{signal.Signals(-returncode).name} ({-returncode})"
    except ValueError:
        return f"signal {-returncode}"

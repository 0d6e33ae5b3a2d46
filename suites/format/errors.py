"""The error every reader of the format raises: a file that cannot run."""


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names file, event and reason."""

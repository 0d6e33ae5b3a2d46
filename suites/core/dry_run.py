"""The dry run: a schedule replayed with no cache at all (``dry_run``). It
refuses what cannot happen and records the calls each request makes and the
optional capabilities the schedule needs; the coverage model watches it."""

from kvparity.suites.core.replay import Replay


# -- the dry run: no cache, only the bookkeeping ----------------------------------------


class _Counted:
    """A solo row in the dry run: only its length, converted by mlx-lm's
    rule (``offset >= quantized_kv_start`` after every call)."""

    def __init__(self, start: int, length: int = 0, quantized: bool = False):
        self.start, self.offset, self.quantized = start, 0, quantized
        self.layers = [NoRow()]
        self.append(length)

    def append(self, n: int):
        self.offset += n
        self.quantized = self.quantized or self.offset >= self.start

    def trim(self, n: int):
        self.offset -= n


class NoRow:
    """Stands in for a quantized row (solo, or extracted into a store): it holds no bytes."""

    nbytes = offset = 0
    keys = values = None
    bits = None  # a quantized layer's row: it merges into the batch under test

    def is_trimmable(self):
        return True

    def trim(self, n):
        return n


class _NoBatch:
    """Stands in for the implementation's batch: every protocol call is a no-op."""

    @classmethod
    def merge(cls, rows):
        return cls()

    def extract(self, i):
        return NoRow()

    def is_trimmable(self):
        return True

    def __getattr__(self, member):
        return lambda *args, **kwargs: None


class _DryRun:
    class implementation:  # every capability, so the replay records what is needed
        batch_class = _NoBatch
        supports = staticmethod(lambda capability: True)

    def __init__(self, schedule):
        self.schedule = schedule

    def begin(self, event):
        pass

    def watch(self, member, caches):
        pass

    def prefill(self, rid, j):
        request = self.schedule.requests[rid]
        return _Counted(request.quantized_kv_start, request.prompt_len)

    def batched_prefill(self, rids, starts):
        return [_NoBatch()]

    def resume(self, rid, caches):
        return _Counted(0, quantized=True)

    def prefill_from(self, rid, cache, rest, j):
        solo = _Counted(self.schedule.requests[rid].quantized_kv_start, quantized=cache is not None)
        solo.append(len(rest))
        return solo

    def forward(self, layers, rows, n, calls):
        pass

    def append_alone(self, rid, solo, n, j):
        solo.append(n)

    def untrimmable(self):
        return ""


def dry_backend(schedule):
    """A backend with no cache: the replay does its bookkeeping only."""
    return _DryRun(schedule)


def dry_run(schedule):
    """Walk the schedule without a cache: (capabilities needed, calls per
    request, every call in order as (request, index)). Raises ScheduleError
    for anything that cannot happen."""
    replay = Replay(schedule, dry_backend(schedule))
    replay.run()
    return tuple(sorted(replay.needs)), replay.calls, replay.order

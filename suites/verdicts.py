"""Turning a run's verdict into a pytest outcome."""

import pytest

from kvparity.reports.results import NOT_SUPPORTED, PASS, ScheduleResult

SHOWN = 5  # divergences quoted in a failure


def describe_failure(result: ScheduleResult) -> str:
    lines = [f"{result.level} {result.schedule}: parity broken ({result.path})"]
    if result.reason:
        lines.append(f"  {result.reason}")
    for row in result.rows:
        if row.divergences:
            lines.append(f"  row {row.request!r}: {len(row.divergences)} divergence(s), first:")
            lines += [f"    {d.message()}" for d in row.divergences[:SHOWN]]
    return "\n".join(lines)


def assert_parity(result: ScheduleResult):
    """Pass, fail with the first divergences, or skip as not supported:
    a missing capability is never counted as a pass."""
    if result.verdict == NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.reason}")
    assert result.verdict == PASS, describe_failure(result)

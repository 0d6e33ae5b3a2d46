"""pytest options shared by every suite: which implementation is under test,
and the gate that turns a run's evidence into a pytest outcome."""

import pytest

from kvparity.oracle.models import ModelUnavailable, load_model
from kvparity.reports.expectations import ExpectationsError, load_expectations
from kvparity.reports.policy import Policy, PolicyError, load_policy
from kvparity.reports.verdicts import judge
from kvparity.suites.adapter import ImplementationError, load_implementation
from kvparity.suites.evidence import EXPECTED_DIVERGENCE, NOT_SUPPORTED, PASS

SHOWN = 5  # divergences quoted in a failure


def pytest_addoption(parser):
    parser.addoption("--impl", default=None, metavar="MODULE:FACTORY",
                     help="batch cache implementation under test (default: the reference)")
    parser.addoption("--policy", default="cpu", metavar="NAME|FILE",
                     help="verdict policy for the parity suites (default: cpu, bit-exact)")
    parser.addoption("--expectations", default=None, metavar="FILE",
                     help="declared divergences (JSON) of the implementation: they do not gate (see README)")


@pytest.fixture(scope="session")
def implementation(pytestconfig):
    try:
        return load_implementation(pytestconfig.getoption("--impl"))
    except ImplementationError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="session")
def policy(pytestconfig):
    try:
        return load_policy(pytestconfig.getoption("--policy"))
    except PolicyError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="session")
def expectations(pytestconfig):
    path = pytestconfig.getoption("--expectations")
    try:
        return None if path is None else load_expectations(path)
    except ExpectationsError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="module")
def smollm2():
    """The real model, fetched once; its suites skip, saying why, where it cannot be had."""
    try:
        return load_model("smollm2")
    except ModelUnavailable as error:
        pytest.skip(str(error))


def describe(judged) -> str:
    """A schedule run's verdict (``reports.verdicts.judge``) in words: each
    row that did not pass, and its first divergences."""
    result = judged.evidence
    lines = [f"{result.level} {result.schedule}: {judged.verdict} ({result.path})"]
    if result.reason:
        lines.append(f"  {result.reason}")
    for row in judged.rows:
        if row.verdict != PASS:
            divergences = sorted(row.evidence.divergences, key=lambda d: d.order)
            lines.append(f"  row {row.evidence.request!r}: {row.verdict}, {row.evidence.checks} comparisons"
                         + (f"; {row.reason}" if row.reason else ""))
            lines += [f"    {d.message()}" for d in divergences[:SHOWN]]
    return "\n".join(lines)


@pytest.fixture(scope="session")
def judged():
    """``judged(result, policy="cpu")``: the verdict of a run under a policy
    (a name, a file or a Policy), its evidence as ``.evidence``. The suites
    gather evidence; the verdict is the reports' business, handed to them here."""

    def verdict(result, under="cpu"):
        return judge(result, under if isinstance(under, Policy) else load_policy(under))

    return verdict


@pytest.fixture(scope="session")
def gate(policy, expectations):
    """``gate(result)``: pass with evidence, skip as not supported, or fail
    saying why; a missing capability is never a pass, and neither is a run
    that compared nothing. Divergences --expectations declares do not gate.
    Returns the verdict."""

    def check(result, under=None):
        judged = judge(result, under or policy, expectations)
        if judged.verdict == NOT_SUPPORTED:
            pytest.skip(f"not supported: {result.reason}")
        assert judged.verdict in (PASS, EXPECTED_DIVERGENCE), describe(judged)
        return judged

    return check

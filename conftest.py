"""pytest options shared by every suite: which implementation is under test."""

import pytest

from kvparity.impl.adapter import ImplementationError, load_implementation


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        default=None,
        metavar="MODULE:FACTORY",
        help="batch cache implementation under test (default: the reference)",
    )


@pytest.fixture(scope="session")
def implementation(pytestconfig):
    try:
        return load_implementation(pytestconfig.getoption("--impl"))
    except ImplementationError as error:
        pytest.exit(str(error), returncode=4)

"""Your own schedule files, from the folders --kvparity-schedules names (or
``schedules`` in [tool.kvparity]): each runs at every chosen level that takes
it, on the implementation under test, and gates as the catalog does."""


def test_schedule(kvparity_schedule, kvparity_run, kvparity_assert):
    path, level = kvparity_schedule
    kvparity_assert(kvparity_run(path, level))

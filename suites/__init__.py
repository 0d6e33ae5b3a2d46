"""The schedule format, the one replay core, the levels that judge a cache,
the generated search, and the pytest suites (``test_*.py``) with the
catalog they run. Its rooms, lowest first (docs/layout.md):

    format/       what a schedule file may say
    core/         the one replay core, the cache under test, processes
    l1/ l2/ l3/ l4/   one room per level
    search/       the generated search, shrinking, the coverage model
    calibration/  a backend's logits tier

``runners`` (which runner each level uses) and ``process_server`` (a cache
served over the process protocol, ``python -m``) are the entry points."""

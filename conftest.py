"""This checkout's own spellings of the kvparity plugin's settings
(``reports/pytest_plugin.py``, loaded through its entry point): ``--impl``,
``--policy`` and ``--expectations`` set ``--kvparity-impl`` and the rest.
The plugin is not loaded here a second time; it registers the markers and
skips the gqa_batched tests where the installed mlx-lm is defective."""


def pytest_addoption(parser):
    parser.addoption("--impl", dest="kvparity_impl", default=None, metavar="MODULE:FACTORY",
                     help="as --kvparity-impl: batch cache implementation under test")
    parser.addoption("--policy", dest="kvparity_policy", default=None, metavar="NAME|FILE",
                     help="as --kvparity-policy: verdict policy for the parity suites (default: cpu, bit-exact)")
    parser.addoption("--expectations", dest="kvparity_expectations", default=None, metavar="FILE",
                     help="as --kvparity-expectations: declared divergences (JSON) of the implementation")


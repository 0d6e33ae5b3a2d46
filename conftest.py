"""This checkout's own spellings of the kvparity plugin's settings
(``reports/pytest_plugin.py``, loaded through its entry point): ``--impl``,
``--policy`` and ``--expectations`` set ``--kvparity-impl`` and the rest.
The plugin is not loaded here a second time."""


def pytest_addoption(parser):
    parser.addoption("--impl", dest="kvparity_impl", default=None, metavar="MODULE:FACTORY",
                     help="as --kvparity-impl: batch cache implementation under test")
    parser.addoption("--policy", dest="kvparity_policy", default=None, metavar="NAME|FILE",
                     help="as --kvparity-policy: verdict policy for the parity suites (default: cpu, bit-exact)")
    parser.addoption("--expectations", dest="kvparity_expectations", default=None, metavar="FILE",
                     help="as --kvparity-expectations: declared divergences (JSON) of the implementation")


def pytest_collection_modifyitems(config, items):
    """Tests marked gqa_batched drive mlx-lm's batched attention on a
    grouped-query model, which a defective mlx-lm gets wrong whatever the
    cache holds: there they are skipped, the defect as the reason."""
    import pytest

    from kvparity.oracle.mlx_lm_versions import defects_for

    defects = defects_for(n_heads=4, n_kv_heads=2)
    if not defects:
        return
    skip = pytest.mark.skip(reason="; ".join(d.attribution() for d in defects))
    for item in items:
        if item.get_closest_marker("gqa_batched") is not None:
            item.add_marker(skip)

"""L3: a real engine serving arrivals. ``run`` (``run_l3``) serves a file
through the engine and judges it; ``serving`` drives the engine with the
cache under test, ``trail`` records the calls it made, ``judging``
compares each request with its solo run, ``stored`` judges the engine's
prompt store; ``engines`` (mlx-lm's BatchGenerator), ``engine_mlx_vlm`` and
``engines_for_tests`` (controls that break an engine on purpose) are the
engines it drives."""

"""L3: a real engine serving arrivals (``run``), with the engines it
drives (``engines``: mlx-lm's BatchGenerator; ``engine_mlx_vlm``;
``engines_for_tests``: controls that break an engine on purpose)."""

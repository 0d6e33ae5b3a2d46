"""L4: a server over HTTP. ``run`` (``run_l4``) judges an arrivals file
served together against each request served alone and against mlx-lm's
solo runs; ``client`` asks and reads answers, ``traffic`` sends the
requests at their times, ``server`` is the server under test (its
command, its model directory, serving alone or together), ``comparisons``
judges the answers, ``server_process`` starts and stops a server."""

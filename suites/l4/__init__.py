"""L4: a server over HTTP (``run``), the server processes it starts and
stops (``server_process``)."""

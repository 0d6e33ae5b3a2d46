"""Adapters for published batched quantized KV caches (the conformance matrix).

One module per package. Each imports mlx, mlx-lm and its package only, and
translates protocol, never behaviour: a member spelled differently, ``size()``
where the class inherits 0, rows re-typed to the package's own row class.
Each adaptation names the package's source line that makes it necessary.
The package is not a dependency of kvparity: a module here imports only in
the environment of its row (``rows.toml``).
"""

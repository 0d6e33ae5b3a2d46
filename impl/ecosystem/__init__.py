"""Adapters for published batched quantized KV caches (the conformance matrix).

One module per package. Each imports mlx, mlx-lm and its package only, and
translates protocol, never behaviour: a member spelled differently, ``size()``
where the class inherits 0, rows re-typed to the package's own row class.
Each adaptation names the package's source line that makes it necessary.
The package is not a dependency of kvparity: a module here imports only in
the environment of its row (``rows.toml``).
"""


def retyped(row, row_class):
    """``row``, an mlx-lm ``QuantizedKVCache``, as a package's own row class:
    the same arrays, offset, bits and group size (nothing copied)."""
    if isinstance(row, row_class):
        return row
    out = row_class(group_size=row.group_size, bits=row.bits)
    out.keys, out.values, out.offset = row.keys, row.values, row.offset
    return out

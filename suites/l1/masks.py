"""L1's mask check: what ``make_mask`` gives at each width (one token, a
few, a chunk), for the rows' left padding and the batch's size, against the
mask mlx-lm's own causal mask gives the rows alone."""

import mlx.core as mx
import numpy as np

from kvparity.oracle.arrays import Reading
from kvparity.suites.format.checks import MASK
from kvparity.suites.core.compare import Divergence


MASK_WIDTHS = (1, 3)


def check_mask(batch, rows, size, pads, checks, event, named):
    """The masks make_mask gives at each width against the rows' own (``checks``: the event's EventChecks,
    which evaluates them later with the other reads)."""
    label = event.label
    for N in MASK_WIDTHS:
        mask = _boolean_mask_later(checks.reading, batch.make_mask(N, return_array=True), len(rows), N, size + N)
        checks.later(lambda N=N, mask=mask: _note_mask(checks, rows, size, pads, label, event.index, N, mask(),
                                                       named))


def expected_mask(pads, size: int, N: int) -> np.ndarray:
    """What ``make_mask(N)`` must give, as booleans [rows, N, size + N]: row
    i may see column c for query q when c >= pads[i] and c <= size + q."""
    columns = np.arange(size + N)[None, :]
    queries = np.arange(N)[:, None]
    return (columns[None] >= np.array(pads, dtype=np.int64)[:, None, None]) & (columns <= size + queries)


def _note_mask(checks, rows, size, pads, label, at, N, mask, named):
    expected_rows = expected_mask(pads, size, N)
    equal = None if mask is None else (mask == expected_rows).all(axis=(1, 2))
    for i, rid in enumerate(rows):
        expected = expected_rows[i]
        found = []
        if mask is None or not equal[i]:
            got = None if mask is None else mask[i]
            index = None
            if got is not None and got.shape == expected.shape:
                index = int(np.flatnonzero(got != expected)[0])
            found.append(Divergence(
                MASK, label, rid, tensor=f"make_mask({N})", index=index,
                expected=None if index is None else bool(expected.reshape(-1)[index]),
                actual=None if index is None else bool(got.reshape(-1)[index]),
                detail=f"row has {pads[i]} pad columns of {size}", **named))
        checks.result.note(at, MASK, [rid], 1, found)


def _boolean_mask_later(reading: Reading, mask, B, N, S):
    """A function giving the mask as bool [B, N, S] once ``reading`` was
    evaluated (its bits are taken now): None means attend everywhere,
    "causal" means causal, additive masks attend where they are 0."""
    if mask is None:
        return lambda: np.ones((B, N, S), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            return lambda: None
        columns, queries = np.arange(S)[None, :], np.arange(N)[:, None]
        return lambda: np.broadcast_to(columns <= S - N + queries, (B, N, S))
    if not isinstance(mask, mx.array):
        return lambda: None
    boolean = mask.dtype == mx.bool_
    ticket = reading.take([mask if boolean else mask.astype(mx.float32)])

    def answer():
        reading.evaluate()
        (bits,) = reading[ticket]
        # Boolean masks attend where true; additive ones where they are 0.
        value = bits.astype(bool) if boolean else bits.view(np.float32) == 0
        if value.ndim == 4:  # [B, heads, N, S]: one mask for every head
            value = value[:, 0]
        try:
            return np.broadcast_to(value, (B, N, S))
        except ValueError:
            return None

    return answer

"""Checks of stored prompt caches that every level makes the same way.

An entry's bytes are remembered when it is stored (``digest``) and must be
the same after every later event: a request that joins from it reads them.
Its ``nbytes`` must be the bytes of its arrays: the store's byte budget sums
it. A join takes as many prompt tokens from the store as mlx-lm's store
holding mlx-lm's own rows, under the same tokens and limits, gives.
"""

from typing import Callable, Dict, List

from kvparity.oracle.arrays import digest, owned_arrays
from kvparity.suites.format.checks import STORED, STORED_NBYTES
from kvparity.suites.core.compare import Divergence


def check_entries(replay, digests: Dict[int, str], note: Callable, event) -> List:
    """Every entry of ``replay`` against its bytes when stored; an entry
    stored at this event has its nbytes checked and its bytes remembered in
    ``digests`` (entry's place -> digest). Returns the entries new here."""
    label, at, new = event.label, event.index, []
    for k, entry in enumerate(replay.entries):
        arrays = [x for c in entry.caches for x in owned_arrays(c)]
        where = dict(event=label, request=entry.request, tensor=entry.name)
        if k not in digests:
            digests[k] = digest(arrays)
            new.append(entry)
            held, counted = sum(c.nbytes for c in entry.caches), sum(x.nbytes for x in arrays)
            note(at, STORED_NBYTES, [entry.request], 1, [] if held == counted else [Divergence(
                STORED_NBYTES, expected=counted, actual=held, detail="nbytes against the bytes of its arrays",
                **where)])
            continue
        changed = digest(arrays) != digests[k]
        note(at, STORED, [entry.request], 1, [Divergence(
            STORED, detail="its bytes changed after it was stored (a write into the batch, or a copy "
                           "sharing its buffers)", **where)] if changed else [])
    return new


def check_fetch(rid, entry, reused: int, expected: int, note: Callable, event, **where) -> bool:
    """Whether a join took the prompt tokens mlx-lm's store gives (noted;
    ``where``: more the divergence says of itself)."""
    found = [] if reused == expected else [Divergence(
        STORED, event.label, rid, tensor=entry_name(entry), expected=expected, actual=reused,
        detail="prompt tokens taken from the store; mlx-lm's store holding the same entries is the expected",
        **where)]
    note(event.index, STORED, [rid], 1, found)
    return not found


def entry_name(entry) -> str:
    return entry.name if entry is not None else "no stored entry"

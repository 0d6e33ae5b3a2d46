"""The coverage model: which (path, setting) cells a schedule set must reach.

A path is one way a batch's arrays are first created or grown; a setting
is the quantization and the synthetic keys' shape and dtype. A cell is one
path at one setting, and a schedule reaches the cells of what its dry run
does (never of its name). The model asks for every path at every bits value
and head_dim, and for every pair of values of any two of (path, bits,
head_dim, group_size, dtype, kv_heads, kv_dims) that can meet (all-pairs).

head_dim is the dim a triple quantizes: a layer whose keys and values have
dims of their own (DeepSeek-V2's 192 and 128) reaches cells at both, with
kv_dims "differ"; a schedule of several layers reaches each layer's cells.

Only L1 schedules reach cells: head_dim and dtype describe the synthetic
keys and values; at L2 the model decides them. At L2 the model asks for
every model family: the random llama and qwen3 models and the real model.

Beside paths and settings, the model asks for values (``VALUES``): the
integers each member is handed or leaves at their edges (a padding of 0, 1
and more, equal and unequal across rows; the shared padding a ``filter``
drops; trim and rollback amounts up to a row's whole length; a side of rows
holding no tokens; lengths around ``quantized_kv_start`` and the 256-token
step; what ``trim``, ``nbytes`` and ``size()`` give on a batch of one row or
of no tokens). Off-by-one bugs live there, whatever the setting. Each value
cell says whether mlx-lm's own engine makes that call (``ENGINE``) or only
the protocol allows it (``PROTOCOL_ONLY``), and where or why.
"""

from dataclasses import dataclass
from itertools import combinations, product
from typing import Dict, Iterable, List, Set, Tuple

from kvparity.oracle.models import RANDOM_MODELS, SMOLLM2, random_model
from kvparity.suites.format.events import Reinsert
from kvparity.suites.l2.run import model_for
from kvparity.suites.format.levels import L1
from kvparity.suites.core.dry_run import NoRow, dry_backend
from kvparity.suites.core.replay import Replay
from kvparity.suites.format.schedule import BITS, DTYPES, GROUP_SIZES

HEAD_DIMS = (64, 96, 128, 256, 512)  # 256: Gemma, Qwen3-Next; 512: Gemma 4's global layers
KV_HEADS = (1, 2)
KV_DIMS = ("equal", "differ")  # a layer's key dim and value dim
STEP = 256  # mlx-lm's caches grow their buffers in steps of 256 tokens

PATHS = {
    "join-into-empty": "rows prefilled alone are merged into a new batch (a join into an empty batch)",
    "batched-prefill-into-empty": "empty rows are merged and the padded prefill writes first "
                                  "(batched_join into an empty batch)",
    "extend": "merged rows extend a running batch (a join into it)",
    "growth-past-256": "a batched append takes the batch from at most 256 to more than 256 tokens",
    "growth-past-512": "a batched append takes the batch from at most 512 to more than 512 tokens",
    "trim-then-growth": "after a trim, a batched append takes the batch past a multiple of 256 tokens",
    "reinsert": "a row extracted from the batch is merged back into it",
    "refill": "the batch's arrays are created again after every row left",
}
GROWTH_BOUNDARIES = {"growth-past-256": STEP, "growth-past-512": 2 * STEP}
# L2: the random models' families and the real model.
MODEL_FAMILIES = tuple(sorted({model.family for model in RANDOM_MODELS.values()})) + (SMOLLM2,)

# The factors of a cell, in the order cells are named.
FACTORS = ("path", "bits", "head_dim", "group_size", "dtype", "kv_heads", "kv_dims")
# Every path at every one of these is required, not only their pairs.
FULL = ("path", "bits", "head_dim")


@dataclass(frozen=True)
class Cell:
    path: str
    bits: int
    head_dim: int
    group_size: int
    dtype: str
    kv_heads: int
    kv_dims: str


def fits(values: Dict[str, object]) -> bool:
    """A group size quantizes only a head_dim it divides."""
    if "group_size" not in values or "head_dim" not in values:
        return True
    return values["head_dim"] % values["group_size"] == 0


def name(requirement: Dict[str, object]) -> str:
    return " ".join(f"{factor}={requirement[factor]}" for factor in FACTORS if factor in requirement)


def requirements() -> List[Dict[str, object]]:
    """What the model asks for, each a partial cell that some reached cell
    must match: every path at every (bits, head_dim), then every pair of
    values of two factors not already asked for within a full one."""
    each = {"path": tuple(PATHS), "bits": BITS, "head_dim": HEAD_DIMS, "group_size": GROUP_SIZES,
            "dtype": DTYPES, "kv_heads": KV_HEADS, "kv_dims": KV_DIMS}
    asked = [dict(zip(FULL, values)) for values in product(*(each[f] for f in FULL))]
    for a, b in combinations(FACTORS, 2):
        if {a, b} <= set(FULL):
            continue
        asked += [pair for pair in ({a: x, b: y} for x, y in product(each[a], each[b])) if fits(pair)]
    return asked


# -- values: the integers members take at their edges ---------------------------------

ENGINE = "engine"  # mlx-lm's BatchGenerator or generate paths make this call
PROTOCOL_ONLY = "protocol only"  # the protocol allows it; mlx-lm's engine never makes it


@dataclass(frozen=True)
class Value:
    member: str  # the member whose integers these are
    value: str  # the value, in words
    by: str  # ENGINE or PROTOCOL_ONLY
    why: str  # where mlx-lm's engine makes the call, or why it never does
    needs: str = ""  # an optional capability only whose schedules reach it


_PREFILL = "BatchGenerator's prompt batch: prepare(lengths, right_padding) when prompts differ in length"
_JOIN = "BatchGenerator merges the rows of a prompt batch (_merge_caches), each its own length"
_EXTEND = "BatchGenerator extends its generation batch with the rows a prompt batch finished"
_FILTER = "BatchGenerator filters finished rows out of its batch (Batch.filter)"
_NO_BATCH_TRIM = "mlx-lm's engine never trims a batch (trim_prompt_cache runs on solo caches only)"
_ROLLBACK = "per-row rollback is no member of mlx-lm's batch caches; a speculative server's"
_WRITE = "every batched forward writes through update_and_fetch; the batch crosses each width"
_KV_START = "generate_step converts a row at quantized_kv_start (maybe_quantize_kv_cache)"
_NBYTES = "BatchGenerator.prompt_cache_nbytes sums nbytes of every batch (mlx-lm's server reads it)"
_SIZE = "mlx-lm's models and engine read offset and make_mask, not a batch's size()"

VALUES: Dict[str, Value] = {
    "merge.equal-lengths": Value("merge", "rows of equal length: no padding", ENGINE, _JOIN),
    "merge.pad-1": Value("merge", "a row left-padded by 1", ENGINE, _JOIN),
    "merge.pad-more": Value("merge", "a row left-padded by more than 1", ENGINE, _JOIN),
    "merge.unequal-pads": Value("merge", "two padded rows, padded unequally", ENGINE, _JOIN),
    "merge.zero-token-rows": Value("merge", "rows holding no tokens (a padded prefill's)", ENGINE,
                                   "BatchGenerator merges new requests' empty caches before their prefill"),
    "merge.zero-token-row-beside-tokens": Value(
        "merge", "a row of no tokens (a fresh cache, keys None) beside rows holding a stored prefix", ENGINE,
        "BatchGenerator._make_batch merges the caches insert(caches=...) got for some requests (a stored "
        "prefix) beside make_prompt_cache's empty ones for the others, before their prefill"),
    "merge.zero-token-row-first": Value(
        "merge", "a row of no tokens merged before a row holding tokens (the order rows are placed in)", ENGINE,
        "BatchGenerator merges its requests' caches in the order they were inserted, a fresh one first as often "
        "as a stored prefix"),
    "merge.emptied-row": Value("merge", "a row that held tokens and was trimmed to none (keys kept, offset 0)",
                               PROTOCOL_ONLY, "only a batch trim empties a row (mlx-lm's engine trims no batch), "
                               "and a stored prefix fetch_nearest_cache gives holds a token at least; the "
                               "format merges such a row alone (extract, reinsert)"),
    "merge.kv-start-one-below": Value("merge", "a row one token short of quantized_kv_start waits outside",
                                      ENGINE, _KV_START),
    "merge.kv-start-at": Value("merge", "a row merged holding exactly quantized_kv_start tokens", ENGINE, _KV_START),
    "merge.kv-start-one-above": Value("merge", "a row merged holding quantized_kv_start + 1 tokens", ENGINE,
                                      _KV_START),
    "prepare.no-gap": Value("prepare", "right padding 0 in every row", PROTOCOL_ONLY,
                            "BatchGenerator calls prepare only when some prompt is shorter (max padding > 0)"),
    "prepare.longest-gap-1": Value("prepare", "the longest right padding is 1", ENGINE, _PREFILL),
    "prepare.longest-gap-more": Value("prepare", "the longest right padding is more than 1", ENGINE, _PREFILL),
    "prepare.gap-1-beside-more": Value("prepare", "a row padded by 1 beside one padded by more", ENGINE, _PREFILL),
    "prepare.equal-gaps": Value("prepare", "two rows right-padded equally (not 0)", ENGINE, _PREFILL),
    "extend.equal-widths": Value("extend", "sides of equal width: no padding added", ENGINE, _EXTEND),
    "extend.existing-pad-1": Value("extend", "the running rows' padding grows by 1", ENGINE, _EXTEND),
    "extend.existing-pad-more": Value("extend", "the running rows' padding grows by more than 1", ENGINE, _EXTEND),
    "extend.joiners-pad-1": Value("extend", "the joining rows are padded by 1", ENGINE, _EXTEND),
    "extend.joiners-pad-more": Value("extend", "the joining rows are padded by more than 1", ENGINE, _EXTEND),
    "extend.joiners-hold-no-tokens": Value(
        "extend", "the joining rows hold no tokens (keys None), the running rows do", ENGINE,
        "BatchGenerator extends its prompt batch with _make_batch's newly merged empty caches, and its "
        "generation batch with rows whose prompt was one token (nothing written before)"),
    "extend.into-zero-token-rows": Value("extend", "the running rows hold no tokens (a trim emptied them)",
                                         PROTOCOL_ONLY, _NO_BATCH_TRIM),
    "filter.shift-0": Value("filter", "the survivors share no padding", ENGINE, _FILTER),
    "filter.shift-1": Value("filter", "the survivors share 1 column of padding, dropped", ENGINE, _FILTER),
    "filter.shift-more": Value("filter", "the survivors share more than 1 column of padding, dropped", ENGINE,
                               _FILTER),
    "trim.1": Value("trim", "a trim of 1", PROTOCOL_ONLY, _NO_BATCH_TRIM),
    "trim.more": Value("trim", "a trim of more than 1", PROTOCOL_ONLY, _NO_BATCH_TRIM),
    "trim.empties-a-row": Value("trim", "a trim of a row's whole length, other rows keeping tokens", PROTOCOL_ONLY,
                                _NO_BATCH_TRIM),
    "trim.empties-every-row": Value("trim", "a trim that leaves no row a token (its count on an emptied batch)",
                                    PROTOCOL_ONLY, _NO_BATCH_TRIM),
    "trim.one-row": Value("trim", "a trim of a batch of one row (its count)", PROTOCOL_ONLY, _NO_BATCH_TRIM),
    "rollback.row-0": Value("rollback", "a row rolled back by 0 beside others", PROTOCOL_ONLY, _ROLLBACK,
                            "per_row_rollback"),
    "rollback.row-1": Value("rollback", "a row rolled back by 1", PROTOCOL_ONLY, _ROLLBACK, "per_row_rollback"),
    "rollback.row-more": Value("rollback", "a row rolled back by more than 1", PROTOCOL_ONLY, _ROLLBACK,
                               "per_row_rollback"),
    "rollback.empties-a-row": Value("rollback", "a row rolled back by its whole length", PROTOCOL_ONLY, _ROLLBACK,
                                    "per_row_rollback"),
    "update_and_fetch.width-255": Value("update_and_fetch", "a write leaves the batch 255 tokens wide (step - 1)",
                                        ENGINE, _WRITE),
    "update_and_fetch.width-256": Value("update_and_fetch", "a write leaves the batch 256 tokens wide (the step)",
                                        ENGINE, _WRITE),
    "update_and_fetch.width-257": Value("update_and_fetch", "a write leaves the batch 257 tokens wide (step + 1)",
                                        ENGINE, _WRITE),
    "nbytes.one-row": Value("nbytes", "nbytes of a batch of one row", ENGINE, _NBYTES),
    "nbytes.no-tokens": Value("nbytes", "nbytes of a batch whose rows hold no tokens", ENGINE, _NBYTES),
    "size.one-row": Value("size", "size() of a batch of one row", PROTOCOL_ONLY, _SIZE),
    "size.no-tokens": Value("size", "size() of a batch whose rows hold no tokens", PROTOCOL_ONLY, _SIZE),
}


def values_asked(capabilities: Iterable[str] = ("per_row_rollback",)) -> List[str]:
    """The value cells asked of schedules that may use ``capabilities``: a
    cell only an optional capability reaches is asked only where it ran."""
    capabilities = set(capabilities)
    return [name for name, value in VALUES.items() if not value.needs or value.needs in capabilities]


def missing_values(reached: Iterable[str], capabilities: Iterable[str] = ("per_row_rollback",)) -> List[str]:
    """Value cells asked (``values_asked``) that are not in ``reached``."""
    reached = set(reached)
    return [name for name in values_asked(capabilities) if name not in reached]


def meets(cell: Cell, requirement: Dict[str, object]) -> bool:
    return all(getattr(cell, factor) == value for factor, value in requirement.items())


def missing(cells: Iterable[Cell]) -> List[str]:
    """Names of the requirements that none of ``cells`` meets."""
    cells = list(cells)
    return [name(r) for r in requirements() if not any(meets(cell, r) for cell in cells)]


# -- what a schedule does: its dry run, watched --------------------------------------


class _WatchedBatch:
    """The dry run's batch: it does nothing, but tells when it is trimmed."""

    def __init__(self, paths: "Paths"):
        self.paths = paths

    def trim(self, n):
        self.paths.trimmed, self.paths.amounts = True, None
        self.paths.trim_count = n

    def rollback(self, amounts):
        self.paths.trimmed, self.paths.amounts = True, list(amounts)

    def is_trimmable(self):
        return True

    def extract(self, i):
        return NoRow()

    def __getattr__(self, member):
        return lambda *args, **kwargs: None


class Paths:
    """A dry-run backend (no cache) that notes the paths the replay takes
    and the value cells (``VALUES``) its member calls reach."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.dry = dry_backend(schedule)
        self.replay = None
        self.found = set()
        self.values: Set[str] = set()
        self.trim_count, self.amounts = 0, None  # what the last trim or rollback was handed
        self.had_rows = False  # the batch has held rows
        self.trimmed = False  # since the batch was created or last grew
        self.reinserting = False
        self.implementation = self.batch_class = self  # merge and supports, for the replay

    # -- the implementation the replay calls ---------------------------------

    def merge(self, rows):
        return _WatchedBatch(self)

    def supports(self, capability):
        return True

    # -- the backend ------------------------------------------------------------

    def begin(self, event):
        self.had_rows = self.had_rows or self.replay.layers is not None
        self.reinserting = isinstance(event, Reinsert) and event.request in self.replay.extracted

    def watch(self, member, caches):
        if member == "merge":
            if self.reinserting:
                self.found.add("reinsert")
            if self.replay.layers is None:
                self.created("join-into-empty")
        elif member == "extend":
            self.found.add("extend")

    def batched_prefill(self, rids, starts):
        if self.replay.layers is None:
            self.created("batched-prefill-into-empty")
        lengths = [len(starts[rid][1]) if rid in starts else self.schedule.requests[rid].prompt_len for rid in rids]
        prefixes = [len(self.replay.held[rid]) - n for rid, n in zip(rids, lengths)]  # what each row held before
        gaps = [max(lengths) - n for n in lengths]
        padded = [g for g in gaps if g]
        first_empty = prefixes.index(0) if 0 in prefixes else len(prefixes)
        self.note("merge", {"zero-token-rows": 0 in prefixes, "zero-token-row-beside-tokens": 0 < max(prefixes)
                            and 0 in prefixes, "zero-token-row-first": any(prefixes[first_empty:])})
        self.note("prepare", {"no-gap": not padded, "longest-gap-1": max(gaps) == 1,
                              "longest-gap-more": max(gaps) > 1, "gap-1-beside-more": 1 in gaps and max(gaps) > 1,
                              "equal-gaps": len(set(padded)) < len(padded)})
        return [_WatchedBatch(self)]

    # -- the integers each member call is handed ------------------------------

    def note(self, member: str, found: Dict[str, bool]):
        self.values.update(f"{member}.{value}" for value, holds in found.items() if holds)

    def lengths(self, rows) -> List[int]:
        return [len(self.replay.held[rid]) for rid in rows]

    def called(self, member: str, layer: int, batch, rows: List[str], **what):
        """Told after each protocol call on the batch (``Replay.on_call``):
        the rows' lengths say the integers, as the batch holds its rows
        right-aligned with no column every row pads (its width is its
        longest row)."""
        if layer:  # every layer is handed the same integers
            return
        lengths = self.lengths(rows)
        if member == "merge" and not what.get("prefill"):
            pads = [max(lengths) - n for n in lengths]
            padded = {p for p in pads if p}
            starts = [self.schedule.requests[rid].quantized_kv_start for rid in rows]
            self.note("merge", {"equal-lengths": len(rows) > 1 and not padded, "pad-1": 1 in padded,
                                "pad-more": max(pads) > 1, "unequal-pads": len(padded) > 1,
                                "kv-start-at": any(s and n == s for s, n in zip(starts, lengths)),
                                "emptied-row": 0 in lengths,  # only a trim leaves a row held outside no tokens
                                "kv-start-one-above": any(s and n == s + 1 for s, n in zip(starts, lengths))})
        elif member == "extend":
            held = len(self.replay.rows)  # the running rows, before the joiners
            mine, theirs = max(lengths[:held]), max(lengths[held:])
            self.note("extend", {"equal-widths": mine == theirs, "existing-pad-1": theirs - mine == 1,
                                 "existing-pad-more": theirs - mine > 1, "joiners-pad-1": mine - theirs == 1,
                                 "joiners-pad-more": mine - theirs > 1, "into-zero-token-rows": mine == 0,
                                 "joiners-hold-no-tokens": theirs == 0 < mine})
        elif member == "filter":
            shift = max(self.lengths(self.replay.rows)) - max(lengths)  # the rows before, the survivors after
            self.note("filter", {"shift-0": shift == 0, "shift-1": shift == 1, "shift-more": shift > 1})
        elif member == "trim":
            n = self.trim_count
            self.note("trim", {"1": n == 1, "more": n > 1, "empties-a-row": 0 in lengths and max(lengths) > 0,
                               "empties-every-row": max(lengths) == 0, "one-row": len(rows) == 1})
        elif member == "rollback":
            amounts = self.amounts
            self.note("rollback", {"row-0": 0 in amounts, "row-1": 1 in amounts, "row-more": max(amounts) > 1,
                                   "empties-a-row": any(a and n == 0 for a, n in zip(amounts, lengths))})

    def ended(self):
        """After each event: the batch the event's checks read (nbytes, size())."""
        if self.replay.layers is None:
            return
        lengths = self.lengths(self.replay.rows)
        for member in ("nbytes", "size"):
            self.note(member, {"one-row": len(lengths) == 1, "no-tokens": max(lengths) == 0})

    def created(self, path):
        self.found.add(path)
        if self.had_rows:
            self.found.add("refill")
        self.trimmed = False

    def forward(self, layers, rows, n, calls):
        # The batch holds as many tokens as its longest row (the replay
        # counted this call already).
        after = max(len(self.replay.held[rid]) for rid in rows)
        before = after - n
        self.note("update_and_fetch", {f"width-{w}": w == after for w in (STEP - 1, STEP, STEP + 1)})
        for path, boundary in GROWTH_BOUNDARIES.items():
            if before <= boundary < after:
                self.found.add(path)
        if -(-after // STEP) > -(-before // STEP):  # past a multiple of the step
            if self.trimmed:
                self.found.add("trim-then-growth")
            self.trimmed = False

    def prefill(self, rid, j):
        return self.dry.prefill(rid, j)

    def resume(self, rid, caches):
        return self.dry.resume(rid, caches)

    def prefill_from(self, rid, cache, rest, j):
        return self.dry.prefill_from(rid, cache, rest, j)

    def append_alone(self, rid, solo, n, j):
        start = self.schedule.requests[rid].quantized_kv_start
        if rid not in self.replay.preempted and start and solo.offset == start - 1:  # waiting, not preempted
            self.note("merge", {"kv-start-one-below": True})
        self.dry.append_alone(rid, solo, n, j)

    def untrimmable(self):
        return self.dry.untrimmable()


def walk(schedule) -> Paths:
    """A schedule's dry run, watched: the paths it takes, the values it reaches."""
    paths = Paths(schedule)
    replay = Replay(schedule, paths)
    paths.replay, replay.on_call = replay, paths.called
    for event in schedule.events:
        replay.apply(event)
        paths.ended()
    return paths


def paths_of(schedule) -> Tuple[str, ...]:
    """The paths a schedule takes, from its dry run."""
    found = walk(schedule).found
    return tuple(p for p in PATHS if p in found)


def values_of(schedule) -> Tuple[str, ...]:
    """The value cells an L1 schedule reaches, from its dry run; none for a
    schedule without L1."""
    return reached(schedule)[1]


def cells_of(schedule) -> List[Cell]:
    """The cells an L1 schedule reaches, at every dim of every layer; none
    for a schedule without L1."""
    return reached(schedule)[0]


def reached(schedule) -> Tuple[List[Cell], Tuple[str, ...]]:
    """An L1 schedule's (path, setting) cells and value cells, from one walk
    of its dry run; none for a schedule without L1."""
    if L1 not in schedule.levels:
        return [], ()
    walked = walk(schedule)
    paths = [p for p in PATHS if p in walked.found]
    cells = []
    for shape in schedule.shapes:
        kv_dims = "equal" if shape.key_dim == shape.value_dim else "differ"
        for dim in sorted({shape.key_dim, shape.value_dim}):
            cells += [Cell(path, schedule.bits, dim, schedule.group_size, schedule.dtype, shape.kv_heads, kv_dims)
                      for path in paths]
    return list(dict.fromkeys(cells)), tuple(v for v in VALUES if v in walked.values)


def judged(schedules) -> dict:
    """The model against the L1 schedules that ran to their end: its
    requirements (paths x settings, then the value cells asked of the
    optional capabilities those schedules used), how many they reached, and
    the names of those they did not."""
    cells, values, capabilities = [], set(), set()
    for schedule in schedules:
        found, found_values = reached(schedule)
        cells += found
        values.update(found_values)
        capabilities.update(schedule.needs)
    return met(cells, values, capabilities)


def met(cells: Iterable[Cell], values: Iterable[str], capabilities: Iterable[str]) -> dict:
    """The model against what was reached (path cells, value cells by
    name): its requirements (paths x settings, then the value cells asked of
    ``capabilities``), how many were reached, and the names of those not."""
    capabilities = set(capabilities)
    asked = len(requirements()) + len(values_asked(capabilities))
    unmet = missing(cells) + missing_values(values, capabilities)
    return {"requirements": asked, "reached": asked - len(unmet), "missing": unmet}


def family_of(schedule) -> str:
    """The model family an L2 schedule runs on (the real model is its own)."""
    name = model_for(schedule)
    model = random_model(name)
    return model.family if model else name

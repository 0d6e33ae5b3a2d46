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
"""

from dataclasses import dataclass
from itertools import combinations, product
from typing import Dict, Iterable, List, Tuple

from kvparity.oracle.models import RANDOM_MODELS, SMOLLM2, random_model
from kvparity.suites.events import Reinsert
from kvparity.suites.l2 import model_for
from kvparity.suites.levels import L1
from kvparity.suites.replay import NoRow, Replay, dry_backend
from kvparity.suites.schedule import BITS, DTYPES, GROUP_SIZES

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
        self.paths.trimmed = True

    def rollback(self, amounts):
        self.paths.trimmed = True

    def extract(self, i):
        return NoRow()

    def __getattr__(self, member):
        return lambda *args, **kwargs: None


class Paths:
    """A dry-run backend (no cache) that notes the paths the replay takes."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.dry = dry_backend(schedule)
        self.replay = None
        self.found = set()
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

    def batched_prefill(self, rids):
        if self.replay.layers is None:
            self.created("batched-prefill-into-empty")
        return [_WatchedBatch(self)]

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
        self.dry.append_alone(rid, solo, n, j)

    def untrimmable(self):
        return self.dry.untrimmable()


def paths_of(schedule) -> Tuple[str, ...]:
    """The paths a schedule takes, from its dry run."""
    paths = Paths(schedule)
    replay = Replay(schedule, paths)
    paths.replay = replay
    replay.run()
    return tuple(p for p in PATHS if p in paths.found)


def cells_of(schedule) -> List[Cell]:
    """The cells an L1 schedule reaches, at every dim of every layer; none
    for a schedule without L1."""
    if L1 not in schedule.levels:
        return []
    paths = paths_of(schedule)
    cells = []
    for shape in schedule.shapes:
        kv_dims = "equal" if shape.key_dim == shape.value_dim else "differ"
        for dim in sorted({shape.key_dim, shape.value_dim}):
            cells += [Cell(path, schedule.bits, dim, schedule.group_size, schedule.dtype, shape.kv_heads, kv_dims)
                      for path in paths]
    return list(dict.fromkeys(cells))


def family_of(schedule) -> str:
    """The model family an L2 schedule runs on (the real model is its own)."""
    name = model_for(schedule)
    model = random_model(name)
    return model.family if model else name

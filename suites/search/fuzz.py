"""Generated schedules: a Hypothesis rule-based state machine.

Each rule adds one event to a schedule, of every kind a file can hold:
joins (one by one and batched), steps, leaves, verify windows, rollbacks,
trims, extracts and re-inserts, and stores into a prompt-cache store with
drawn limits (entries and bytes) with chat turns joining from its nearest
prefix. At L1 the event is applied and
checked at once on a live run (one parse per event, the replay core's own
bookkeeping tells the rules what the schedule allows), so Hypothesis sees
the exact event that breaks parity and shrinks the schedule to a minimal
one. At L2 the rules build the schedule on the replay's dry run and the
model replays it when the example ends (the oracle needs the whole schedule
to teacher-force). Every failing schedule is written out (atomically, one
file per machine, so the last one written is the shrunk one Hypothesis
reports) in the catalog's format, with the command that replays it.
"""

import gc
import hashlib
import json
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from kvparity.oracle.atomic import FOUND_DIR
from kvparity.oracle.models import RANDOM_MODELS, axis_variants
from kvparity.oracle.synthetic import LayerShape
from kvparity.suites.core.evidence import FAILURES
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.l1.run import L1Run, run_l1
from kvparity.suites.format.levels import L1, L2
from kvparity.suites.core.replay import Replay
from kvparity.suites.core.dry_run import dry_backend
from kvparity.suites.search.coverage import HEAD_DIMS, reached
from kvparity.suites.format.events import (
    BatchedJoin, Extract, Join, JoinStored, Leave, Reinsert, Rollback, SoloStep, SpecRound, Step, Store, Trim,
    make_event,
)
from kvparity.suites.format.schedule import BITS, DTYPES, GROUP_SIZES, Schedule, StoreLimits, parse_request, save
from kvparity.suites.core.loading import parse
from kvparity.suites.search.shrink import Shrinker, first_failure

if sys.version_info < (3, 11):  # Hypothesis brings the backport there
    from exceptiongroup import BaseExceptionGroup

L2_MODELS = tuple(m.name for m in axis_variants())


class ScheduleFailed(AssertionError):
    """A generated schedule failed: its report, and the schedule itself
    (``doc``), so that a caller holding several failures (Hypothesis raises
    each distinct one) has each one's schedule, not only the last file written."""

    def __init__(self, message: str, doc: dict):
        super().__init__(message)
        self.doc = doc

# A dim of keys or values: one of the coverage model's head dims, the wide
# ones (256, 512) in about one draw of five, so the search keeps its pace.
NARROW = tuple(d for d in HEAD_DIMS if d <= 128)
dims = st.sampled_from(3 * NARROW + tuple(d for d in HEAD_DIMS if d > 128))


def layer_shape(kv_heads):
    """One layer's shape: values mostly at the keys' dim, else at a dim of
    their own (DeepSeek-V2, MiniCPM3)."""
    return st.tuples(dims, st.sampled_from((False, False, True)), dims).map(
        lambda t: LayerShape(kv_heads, t[0], t[2] if t[1] else t[0]))


def layer_shapes(kv_heads):
    """One layer, or in about one schedule of four a second of its own shape
    and kv heads (Gemma 4: sliding and global layers)."""
    second = st.sampled_from((False, False, False, True)).flatmap(
        lambda two: st.tuples(layer_shape(kv_heads) | layer_shape(3 - kv_heads)) if two else st.just(()))
    return st.tuples(layer_shape(kv_heads), second).map(lambda t: (t[0], *t[1]))


def shape_features(shapes) -> list:
    """What real models' shapes a schedule has, in words."""
    features = []
    if any(shape.key_dim != shape.value_dim for shape in shapes):
        features.append("keys != values")
    if any(max(shape.key_dim, shape.value_dim) >= 256 for shape in shapes):
        features.append("head_dim 256 or 512")
    if any(shape.kv_heads == 1 for shape in shapes):
        features.append("one kv head")
    if len(shapes) > 1:
        features.append("several layers")
    return features


# Mostly short prompts, some long enough to cross the 256-token buffer step.
prompt_lengths = st.one_of(st.integers(1, 24), st.integers(240, 300))
LONGEST_PROMPT = 300


def near(lengths) -> list:
    """The lengths one below, at and one above each of ``lengths``: a row
    joining next to one of them pads by 0 or 1 column, where off-by-one bugs
    in padding live (a prepare recording right padding only past one token, a
    filter dropping shared padding only from two columns)."""
    return sorted({n + d for n in lengths for d in (-1, 0, 1) if 1 <= n + d <= LONGEST_PROMPT})
prefill_steps = st.sampled_from((2048, 64, 7))


class ScheduleMachine(RuleBasedStateMachine):
    # Set by make_machine:
    implementation = None
    found_dir: Path = None
    level = L1
    judge = None  # ScheduleResult -> its verdict (reports.verdicts.judge under a policy)
    run_l2 = None  # (schedule, implementation) -> ScheduleResult, at L2
    # Counted across examples, for the tests:
    schedules_started = 0
    resumed = 0  # requests that joined from a stored prefix
    outcomes: dict = None
    row_outcomes: dict = None
    shapes_drawn: dict = None  # schedules per feature of their shapes (``shape_features``)
    reached: set = None  # the coverage model's cells its finished schedules reached; None: not noted
    reached_values: set = None  # with reached: the value cells they reached, by name
    digest = None  # with reached: a sha256 of its finished schedules, in the order they ran

    @initialize(data=st.data(), bits=st.sampled_from(BITS), kv_heads=st.sampled_from((1, 2)))
    def start(self, data, bits, kv_heads):
        if self.level == L2:
            model = data.draw(st.sampled_from(L2_MODELS), label="model")
            head_dim, dtype = RANDOM_MODELS[model].head_dim, "bfloat16"
            shapes = (LayerShape(kv_heads, head_dim, head_dim),)
        else:
            model = None
            shapes = data.draw(layer_shapes(kv_heads), label="layers")
            dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        dims = {dim for shape in shapes for dim in (shape.key_dim, shape.value_dim)}
        group_size = data.draw(st.sampled_from([g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]),
                               label="group_size")
        self.schedule = Schedule(
            name=f"found-{self.level}-{self.implementation.batch_class.__name__}",
            description=f"a schedule generated by the {self.level} state machine",
            levels=(self.level,), bits=bits, group_size=group_size, requests={}, events=[],
            shapes=shapes, dtype=dtype, model=model, path=f"<generated {self.level}>",
        )
        # A prompt-cache store with the limits a server gives mlx-lm's LRUPromptCache: rows stored
        # in it are evicted by count and by the bytes their nbytes says.
        self.schedule.stores[STORE] = StoreLimits(data.draw(st.integers(1, 4), label="store max_size"),
                                                  data.draw(store_bytes, label="store max_bytes"))
        FLIGHT.run(f"{self.level} {self.schedule.name}")
        FLIGHT.schedule(self.schedule)
        if self.level == L1:
            self.run = L1Run(self.schedule, self.implementation)
            self.replay = self.run.replay
        else:
            self.run = None
            self.replay = Replay(self.schedule, dry_backend(self.schedule))
        type(self).schedules_started += 1
        for feature in shape_features(shapes):
            self.shapes_drawn[feature] = self.shapes_drawn.get(feature, 0) + 1

    # -- what the schedule so far allows -------------------------------------

    def running(self):
        return self.replay.running()

    def has_batch(self):
        return bool(self.running())

    def has_preempted(self):
        return bool(self.replay.preempted)

    def min_generated(self):
        return min((self.replay.generated[r] for r in self.running()), default=0)

    def ended(self) -> bool:
        """The live run stopped in an event without failing (a member declined
        an optional capability): the schedule ends there. Later rules add
        nothing, since the replay's bookkeeping stopped with the run and a
        schedule continued from it would not replay (an extract of a row the
        stopped event already took out)."""
        return self.run is not None and not self.run.running

    # -- adding events ---------------------------------------------------------

    def new_requests(self, data, count, join_unquantized=True):
        """``join_unquantized``: quantized_kv_start may lie past the prompt, so
        the row waits alone until mlx-lm converts it (not for batched_join,
        which prefills straight into the quantized batch)."""
        ids, lengths = [], [len(self.replay.held[r]) for r in self.running()]
        for _ in range(0 if self.ended() else count):
            rid = f"r{len(self.schedule.requests)}"
            # A free length, or in about one draw of three one next to a row's (running or joining with it).
            beside = near(lengths)
            length = data.draw(st.one_of(prompt_lengths, prompt_lengths, st.sampled_from(beside)) if beside
                               else prompt_lengths, label=f"{rid} prompt_len")
            lengths.append(length)
            latest = length + (12 if join_unquantized else 0)
            spec = {
                "prompt_len": length,
                "prefill_step_size": data.draw(prefill_steps, label=f"{rid} prefill_step_size"),
                "quantized_kv_start": data.draw(st.integers(0, latest), label=f"{rid} quantized_kv_start"),
            }
            self.schedule.requests[rid] = parse_request(self.schedule.path, rid, spec, self.schedule.levels)
            ids.append(rid)
        return ids

    def add(self, kind, args):
        """An event of ``kind`` (its class) with these JSON arguments, validated as a file's would be."""
        if self.ended():
            return
        event = make_event(kind, self.schedule.path, len(self.schedule.events), args)
        self.schedule.events.append(event)
        if self.run is None:
            self.replay.apply(event)
            return
        FLIGHT.schedule(self.schedule)
        self.run.advance([event])
        # Only a divergence or a stop can fail a schedule: judge then.
        if self.run.result.stopped or self.run.result.divergences:
            result = self.judge(self.run.finish())
            if result.verdict in FAILURES:
                raise ScheduleFailed(self.report(result), self.schedule.to_json())

    def teardown(self):
        if self.level == L2 and self.schedule.events:
            if self.running():  # one last batched call, so the rows still running show their logits
                self.add(Step, 1)
            schedule = parse(self.schedule.to_json(), source=self.schedule.path)
            FLIGHT.schedule(schedule)
            result = self.judge(self.run_l2(schedule, self.implementation))
            self.count(result)
            if result.verdict in FAILURES:
                raise ScheduleFailed(self.report(result), schedule.to_json())
        elif self.run is not None:
            self.count(self.judge(self.run.finish()))

    def count(self, result):
        """Outcomes of schedules and of rows: a generated row that never ran
        through the batch has no evidence, and is counted so. Where the
        machine notes what it reached (``reached``), the schedule's cells of
        the coverage model too."""
        self.outcomes[result.verdict] = self.outcomes.get(result.verdict, 0) + 1
        if self.reached is not None and self.schedule.events:
            cells, values = reached(self.schedule)
            self.reached.update(cells)
            self.reached_values.update(values)
            self.digest.update(json.dumps(self.schedule.to_json(), sort_keys=True).encode())
        for row in result.rows:
            self.row_outcomes[row.verdict] = self.row_outcomes.get(row.verdict, 0) + 1

    def report(self, judged) -> str:
        path = self.found_dir / f"{self.schedule.name}.json"
        save(self.schedule, path)
        result = judged.evidence
        return (f"{self.level} {result.schedule}: {judged.verdict}: {headline(judged)}\n"
                f"written to {path}; replay with: "
                + shlex.join(["kvparity", "replay", str(path), "--level", self.level]
                             + (["--impl", self.implementation.spec] if self.implementation.spec else [])))

    @rule(data=st.data(), count=st.integers(1, 3))
    def join(self, data, count):
        self.add(Join, self.new_requests(data, count))

    @rule(data=st.data(), count=st.integers(1, 3))
    def batched_join(self, data, count):  # L1 only: L2 machines drop this rule (make_machine)
        self.add(BatchedJoin, self.new_requests(data, count, join_unquantized=False))

    @precondition(has_batch)
    @rule(n=st.integers(1, 3))
    def step(self, n):
        self.add(Step, n)

    @precondition(has_batch)
    @rule(data=st.data())
    def leave(self, data):
        rows = self.running()
        leaving = data.draw(st.lists(st.sampled_from(rows), min_size=1, max_size=len(rows), unique=True))
        self.add(Leave, leaving)

    def per_row(self, data, rows, strategy_for, label):
        """One count per row, or one count for all rows when the
        implementation cannot roll rows back unevenly."""
        if self.implementation.supports("per_row_rollback"):
            return {rid: data.draw(strategy_for(rid), label=f"{rid} {label}") for rid in rows}
        n = data.draw(strategy_for(min(rows, key=lambda r: self.replay.generated[r])), label=label)
        return {rid: n for rid in rows}

    @precondition(has_batch)
    @rule(data=st.data(), k=st.integers(1, 4))
    def spec_round(self, data, k):
        accepted = self.per_row(data, self.running(), lambda rid: st.integers(0, k), "accepts")
        self.add(SpecRound, {"k": k, "accepted": accepted})

    @precondition(lambda self: self.has_batch() and self.min_generated() >= 1)
    @rule(data=st.data())
    def rollback(self, data):
        amounts = self.per_row(
            data, self.running(), lambda rid: st.integers(0, self.replay.generated[rid]), "rolls back"
        )
        if any(amounts.values()):
            self.add(Rollback, {r: n for r, n in amounts.items() if n})

    @precondition(lambda self: self.has_batch() and self.min_generated() >= 1)
    @rule(data=st.data())
    def trim(self, data):
        self.add(Trim, data.draw(st.integers(1, self.min_generated())))

    @precondition(has_batch)
    @rule(data=st.data())
    def extract(self, data):
        self.add(Extract, data.draw(st.sampled_from(self.running())))

    @precondition(has_preempted)
    @rule(data=st.data(), n=st.integers(1, 3))
    def solo_step(self, data, n):
        self.add(SoloStep, {data.draw(st.sampled_from(sorted(self.replay.preempted))): n})

    @precondition(has_preempted)
    @rule(data=st.data())
    def reinsert(self, data):
        self.add(Reinsert, data.draw(st.sampled_from(sorted(self.replay.preempted))))

    def stored(self):
        return bool(self.replay.stored_tokens)

    @precondition(lambda self: bool(self.replay.rows))
    @rule(data=st.data())
    def store(self, data):
        rows = self.replay.rows
        stored = data.draw(st.lists(st.sampled_from(rows), min_size=1, max_size=len(rows), unique=True))
        self.add(Store, {"into": STORE, "requests": stored})

    @precondition(stored)
    @rule(data=st.data(), count=st.integers(1, 3))
    def chat_turn(self, data, count):
        """Requests continuing stored ones (a conversation's next turn, or a
        shared prefix), joining from the store's nearest prefix."""
        ids = []
        for _ in range(count):
            rid = f"r{len(self.schedule.requests)}"
            source = data.draw(st.sampled_from(sorted(self.replay.stored_tokens)), label=f"{rid} continues")
            spec = {"continues": source, "new_tokens": data.draw(st.integers(0, 6), label=f"{rid} new_tokens"),
                    "prefill_step_size": data.draw(prefill_steps, label=f"{rid} prefill_step_size")}
            held = len(self.replay.stored_tokens[source])
            keep = data.draw(st.one_of(st.none(), st.integers(1, held)), label=f"{rid} keep")
            if keep is not None:
                spec["keep"] = keep
            self.schedule.requests[rid] = parse_request(self.schedule.path, rid, spec, self.schedule.levels)
            ids.append(rid)
        self.add(JoinStored, {"from": STORE, "requests": ids})
        type(self).resumed += sum(1 for _, reused in self.replay.resumed.values() if reused)


def headline(judged) -> str:
    """A failing run in one line: its first gating divergence (or why it
    stopped), then its first finding that does not gate, said so."""
    first = first_failure(judged)
    said = first.message() if first is not None else judged.evidence.reason
    informing = [d for row in judged.rows for d in row.evidence.divergences if d not in row.failing]
    aside = min(informing, key=lambda d: d.order, default=None)
    if aside is not None:
        said += f" (also, not gating: {aside.message()})"
    return said


STORE = "chat"
# A store's byte limit: none (mlx-lm's default) or a few short rows' worth, so entries are evicted.
store_bytes = st.one_of(st.just(1 << 63), st.integers(1000, 20000))


class ConversationMachine(ScheduleMachine):
    """Conversations: every example starts with a stored first turn, and
    its batched joins, extracts and re-inserts are off, so most examples
    store and resume (the schedule machine's store and chat-turn rules,
    among its joins, steps, leaves, verify windows, rollbacks and trims)."""

    batched_join = extract = solo_step = reinsert = None

    @initialize(data=st.data(), bits=st.sampled_from(BITS), kv_heads=st.sampled_from((1, 2)))
    def start(self, data, bits, kv_heads):
        """The schedule machine's start, then a conversation's first turn:
        a request joins, decodes a little (a batched call: evidence at L2)
        and is stored."""
        ScheduleMachine.start(self, data, bits, kv_heads)
        first = self.new_requests(data, 1, join_unquantized=False)
        self.add(Join, first)
        self.add(Step, data.draw(st.integers(1, 3), label="first turn's steps"))  # evidence at L2
        self.add(Store, {"into": STORE, "requests": first})


def make_machine(implementation, judge, found_dir=None, level=L1, run_l2=None, database_key=None,
                 base=ScheduleMachine, reach=False):
    """A state machine class bound to one implementation, verdict and output
    folder; ``base``: ScheduleMachine, or ConversationMachine for stores and
    chat turns. ``database_key`` (bytes) keeps its failures apart from other
    machines' in a shared example database: Hypothesis keys a state machine
    by its class's source, the same for every level and implementation.
    ``reach``: note the coverage model's cells of every finished schedule
    (``reached``; a dry run of each) and a digest of the schedules
    (``digest``: the same schedules, the same digest)."""
    found_dir = Path(found_dir or os.environ.get("KVPARITY_FOUND_DIR", FOUND_DIR))
    namespace = {"implementation": implementation, "found_dir": found_dir, "level": level,
                 "judge": staticmethod(judge), "run_l2": staticmethod(run_l2) if run_l2 else None,
                 "outcomes": {}, "row_outcomes": {}, "shapes_drawn": {}, "resumed": 0,
                 "reached": set() if reach else None, "reached_values": set() if reach else None,
                 "digest": hashlib.sha256() if reach else None}
    if database_key is not None:  # read by Hypothesis's function_digest, as for parametrized tests
        namespace["_hypothesis_internal_add_digest"] = database_key
    if level == L2:
        namespace["batched_join"] = None  # padded batched prefill is an L1 event: not a rule here
    return type(base.__name__, (base,), namespace)


def generate(machine, settings):
    """Run ``machine`` as a test under ``settings``, as Hypothesis's
    ``run_state_machine_as_test`` does, with the garbage collector tuned for
    the run (``fewer_collections``). Hypothesis shrinks the rules drawn; each
    failing schedule it ends with is then shrunk event by event, as kvparity
    bisect shrinks one (``shrunk``), and written again before it is raised."""
    with fewer_collections():
        try:
            run_state_machine_as_test(machine, settings=settings)
        except Exception as error:  # a ScheduleFailed, or a group of them
            for failed in found_in(error, ScheduleFailed):
                shrunk(machine, failed)
            raise


def shrunk(machine, failed: ScheduleFailed):
    """``failed``'s schedule shrunk to the fewest events and requests that
    still fail the same way (``suites/search/shrink.py``), written where the
    machine wrote it; ``failed.doc`` becomes it."""
    schedule = parse(failed.doc, source=f"<generated {machine.level}>")
    run = machine.run_l2 if machine.level == L2 else run_l1

    def attempt(candidate):
        FLIGHT.run(f"{machine.level} {candidate.name}")
        FLIGHT.schedule(candidate)
        return machine.judge(run(candidate, machine.implementation))

    doc = Shrinker(attempt, schedule).shrink(schedule)
    if doc is not None:
        failed.doc = {**doc, "name": schedule.name}
        save(parse(failed.doc, source=schedule.path), machine.found_dir / f"{schedule.name}.json")


def found_in(error: BaseException, kind) -> list:
    """The ``kind`` exceptions in ``error``, which may be a group of them
    (Hypothesis raises every distinct failure it found)."""
    if isinstance(error, kind):
        return [error]
    if isinstance(error, BaseExceptionGroup):
        return [e for inner in error.exceptions for e in found_in(inner, kind)]
    return []


def leaves(error: BaseException) -> int:
    if isinstance(error, BaseExceptionGroup):
        return sum(leaves(inner) for inner in error.exceptions)
    return 1


# Objects allocated before a young collection: CPython's default is 700.
YOUNG_THRESHOLD = 5000


@contextmanager
def fewer_collections():
    """Each example keeps its schedule's run and Hypothesis's bookkeeping alive
    across several young collections at CPython's defaults, so they are
    promoted, and a full collection follows about every 40 examples, each one
    scanning every object the imports made (mlx-lm brings transformers): a
    tenth of a generated run. For the run, what exists before it is frozen
    (never scanned) and young collections wait for ``YOUNG_THRESHOLD`` new
    objects. Both are undone after."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # someone else's freeze is theirs to undo
    if freeze:
        gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()

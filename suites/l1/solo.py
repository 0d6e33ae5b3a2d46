"""L1's oracle: every request alone in mlx-lm's caches, fed the same
synthetic keys and values and the same calls the replay recorded, each state
computed once; and how a cache's bytes are read for a comparison."""

import itertools
from collections import OrderedDict
from typing import Dict, List

from mlx_lm.models.cache import LRUPromptCache

from kvparity.oracle.arrays import Reading, owned_arrays, start_evaluating
from kvparity.oracle.prompt_store import MODEL_KEY, fetch_nearest, stored_copy
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import SyntheticKV
from kvparity.suites.core.compare import TRIPLE


class SoloState:
    """One request alone after some of its calls: mlx-lm's cache, never
    written (a further call works on a fork), and its bytes once read."""

    __slots__ = ("key", "solo", "layers")

    def __init__(self, key: tuple, solo: SoloCache):
        self.key, self.solo = key, solo
        self.layers = None  # its parts on [0, offset), one dict per layer, once read

    def parts(self, reading: Reading) -> List[dict]:
        """Each layer on ``[0, offset)`` as ``layer_parts`` gives it, taken
        into ``reading`` the first time and the same parts after."""
        if self.layers is None:
            self.layers = [layer_parts(reading, cache) for cache in self.solo.layers]
        return self.layers

    def keep(self):
        """The parts read, evaluated, no longer holding their reading; parts
        of a reading that was never evaluated (its checks raised) are
        dropped, to be read again."""
        if self.layers is not None:
            evaluated = all(part.evaluated for layer in self.layers for part in layer.values())
            self.layers = [{name: part.kept() for name, part in layer.items()} for layer in self.layers] \
                if evaluated else None


class SoloStates:
    """Requests alone in mlx-lm's caches, each state computed once.

    A state is named by all that made it: the synthetic stream, the request,
    the quantization and the request's calls so far, each at its place in
    the stream. Generated schedules repeat requests and calls, so most
    states were computed before: a joining request's merge source and its
    oracle are one computation, and so are the same calls in two schedules.
    Kept caches are never written: a further call works on a fork, and so
    does every holder that may write (the implementation's merge sources).
    """

    def __init__(self, size: int = 256):
        self.size = size
        self.kept: "OrderedDict[tuple, SoloState]" = OrderedDict()

    def prefilled(self, kv: SyntheticKV, written: Dict[str, int], request, bits: int, group_size: int,
                  n: int) -> SoloState:
        """``request``'s first ``n`` prompt tokens of its stream, drawn from
        ``written`` on (which advances by ``n``), in generate_step's chunks."""
        start = kv.advance(written, request, n)
        key = (kv.identity, request.id, request.seed, request.prefill_step_size, request.quantized_kv_start,
               bits, group_size, start, n)
        drawn = {request.id: start}
        return self._state(key, lambda: SoloCache.prefilled(request, bits, group_size,
                                                            lambda m: kv.draw(drawn, request, m), n,
                                                            layers=len(kv.shapes)))

    def after(self, state: SoloState, kv: SyntheticKV, written: Dict[str, int], request, op: str,
              n: int) -> SoloState:
        """``state`` after one more call: ``append`` the next ``n`` tokens
        from ``written`` (which advances), or ``trim`` ``n``."""
        start = kv.advance(written, request, n if op == "append" else 0)

        def compute():
            solo = state.solo.fork()
            if op == "append":
                solo.append(kv.tokens(request.id, start, n, seed=request.seed))
            else:
                solo.trim(n)
            return solo

        return self._state(state.key + ((op, start, n),), compute)

    def resumed(self, solo: SoloCache) -> SoloState:
        """A request started from a stored prefix: its own state, never shared."""
        return self._state(("resumed", next(_RESUMED)), lambda: solo)

    def _state(self, key: tuple, compute) -> SoloState:
        state = self.kept.pop(key, None)
        if state is None:
            state = SoloState(key, compute())
            start_evaluating(owned_arrays(state.solo.cache))
            if len(self.kept) >= self.size:
                self.kept.popitem(last=False)
        self.kept[key] = state
        return state


SOLO_STATES = SoloStates()
_RESUMED = itertools.count()


def prefilled_from(kv: SyntheticKV, schedule, request, caches, rest) -> SoloCache:
    """``request`` alone from ``caches`` (a stored prefix, one cache per
    layer, or None): the rest of its prompt, tokens named (stream, index),
    in generate_step's chunks."""
    solo = SoloCache(schedule.bits, schedule.group_size, request.quantized_kv_start, caches,
                     layers=len(kv.shapes))
    seeds = {rid: r.seed for rid, r in schedule.requests.items()}
    done = 0
    for n in request.prefill_chunks(len(rest)):
        solo.append(kv.named(rest[done : done + n], seeds))
        done += n
    return solo



class SoloCaches:
    """Every request alone, in mlx-lm's caches, fed the same synthetic tokens
    and the same calls the replay recorded."""

    def __init__(self, schedule, kv: SyntheticKV):
        self.schedule = schedule
        self.kv = kv
        self.states: Dict[str, SoloState] = {}
        self.written: Dict[str, int] = {}
        self.taken: List[SoloState] = []  # states first read at this event
        # mlx-lm's stores holding mlx-lm's own rows under the same tokens and limits
        self.stores: Dict[str, LRUPromptCache] = {}
        self.reused: Dict[str, int] = {}  # prompt tokens each resumed request took from a store

    def cache(self, rid):
        """The row's first layer (its offset and conversion are every layer's)."""
        return self.states[rid].solo.cache

    def caches(self, rid) -> list:
        return self.states[rid].solo.layers

    def expected(self, rid, reading: Reading) -> List[dict]:
        """Each layer of the row on ``[0, offset)`` as ``layer_parts`` gives
        it, taken into ``reading``; read again only after a call changed the row."""
        state = self.states[rid]
        if state.layers is None:
            self.taken.append(state)
        return state.parts(reading)

    def keep(self):
        """After an event's checks: what they read stays, not their reading."""
        taken, self.taken = self.taken, []
        for state in taken:
            state.keep()

    def store(self, name) -> LRUPromptCache:
        """mlx-lm's store of that name, made at its first use (a generated
        schedule declares its stores as it goes)."""
        if name not in self.stores:
            limits = self.schedule.stores[name]
            self.stores[name] = LRUPromptCache(limits.max_size, limits.max_bytes)
        return self.stores[name]

    def apply(self, calls: List[tuple]):
        """The event's (request, call) pairs, in the order the replay made them."""
        bits, group_size = self.schedule.bits, self.schedule.group_size
        for rid, call in calls:
            request = self.schedule.requests[rid]
            if call.op == "prefill":
                state = SOLO_STATES.prefilled(self.kv, self.written, request, bits, group_size, call.n)
            elif call.op == "store":
                self.store(call.store).insert_cache(MODEL_KEY, list(call.tokens),
                                                     [stored_copy(c) for c in self.caches(rid)])
                continue
            elif call.op == "resume":
                cache, rest = fetch_nearest(self.store(call.store), call.tokens)
                self.reused[rid] = len(call.tokens) - len(rest)
                self.written[rid] = sum(1 for stream, _ in call.tokens if stream == rid)
                state = SOLO_STATES.resumed(prefilled_from(self.kv, self.schedule, request, cache, rest))
            else:
                state = SOLO_STATES.after(self.states[rid], self.kv, self.written, request, call.op, call.n)
            self.states[rid] = state


def layer_parts(reading: Reading, cache) -> dict:
    """``layer_bytes`` of a cache as parts of ``reading`` (sliced by numpy,
    no graph node): {"keys.packed": ..., ...}, or {"keys", "values"} unquantized."""
    index = (Ellipsis, slice(None, cache.offset), slice(None))
    layer = {}
    for name in ("keys", "values"):
        stored = getattr(cache, name, None)
        if isinstance(stored, (tuple, list)):
            layer.update(zip((f"{name}.{part}" for part in TRIPLE), reading.parts(list(stored), index)))
        elif stored is not None:
            layer[name] = reading.parts([stored], index)[0]
    return layer


def triples_of(layer: dict) -> dict:
    """{"keys": triple, "values": triple} of a quantized layer; None where one is missing."""
    return {name: tuple(layer[f"{name}.{part}"] for part in TRIPLE) if f"{name}.packed" in layer else None
            for name in ("keys", "values")}

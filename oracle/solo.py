"""The serial oracle (L2): each request alone, through mlx-lm's own code.

A request's calls (``Schedule.calls``) are replayed on mlx-lm's prompt cache
exactly as ``mlx_lm.generate.generate_step`` drives it: the prompt in
``prefill_step_size`` chunks (all but the last token), the last token in its
own call, ``maybe_quantize_kv_cache`` after every call (so the cache becomes
a ``QuantizedKVCache`` when mlx-lm would convert it), and ``trim_prompt_cache``
for rollbacks.

Tokens are greedy: the input after a call is the argmax of the log
probabilities at the last position the cache keeps, as mlx-lm's greedy
sampler picks it. A verify window of n tokens is that token followed by n - 1
draft tokens, fixed by the request's seed (the schedule says how many are
accepted, so any drafts will do).
"""

import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache, trim_prompt_cache

from kvparity.oracle.plan import converted, offset_of
from kvparity.oracle.prompt_store import MODEL_KEY, fetch_nearest, stored_copy


def log_probs(logits: mx.array) -> mx.array:
    """As generate_step computes them, so results compare bit for bit."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy(logits: mx.array) -> int:
    return mx.argmax(log_probs(logits), axis=-1).item()


def prompt_tokens(request, vocab_size: int, tokenizer=None) -> List[int]:
    """The request's own prompt tokens (a chat turn's: its new ones)."""
    if request.prompt is not None:
        return list(request.prompt)
    if request.text is not None:
        if tokenizer is None:
            raise ValueError(f"request {request.id!r} has a text prompt but the model has no tokenizer")
        return list(tokenizer.encode(request.text))
    rng = np.random.default_rng([request.seed, zlib.crc32(request.id.encode())])
    # A schedule's chat turn draws its new tokens; an arrivals file's turn counts them in prompt_len.
    n = getattr(request, "new_tokens", None) if getattr(request, "continues", None) is not None else None
    n = request.prompt_len if n is None else n
    return rng.integers(0, vocab_size, size=n).tolist()


def draft_tokens(request, position: int, n: int, vocab_size: int) -> List[int]:
    rng = np.random.default_rng([request.seed, zlib.crc32(request.id.encode()), position, 1])
    return rng.integers(0, vocab_size, size=n).tolist()


def layer_bytes(cache) -> Dict[str, mx.array]:
    """One layer's cache as a request observes it: keys and values on
    [0, offset), as triples when quantized; an ``ArraysCache``'s state whole
    (linear-attention and SSM state: every byte is the request's); a
    ``CacheList``'s members', each under its index."""
    members = getattr(cache, "caches", None)
    if isinstance(members, (tuple, list)):
        return {f"{k}.{name}": x for k, member in enumerate(members) for name, x in layer_bytes(member).items()}
    if isinstance(getattr(cache, "cache", None), list):
        return {f"state.{k}": x for k, x in enumerate(cache.cache) if x is not None}
    n = cache.offset
    out = {}
    for name in ("keys", "values"):
        stored = getattr(cache, name)
        if isinstance(stored, (tuple, list)):
            for part, x in zip(("packed", "scales", "biases"), stored):
                out[f"{name}.{part}"] = x[..., :n, :]
        elif stored is not None:
            out[name] = stored[..., :n, :]
    return out


@dataclass
class SoloCall:
    """One call of the solo run, as made: what it fed and the logits it produced."""

    event: int
    op: str  # "prefill", "append" or "trim"
    inputs: List[int]  # tokens fed (prefill: the whole prompt); [] for trim
    logits: Optional[mx.array] = None  # [positions, vocab] as produced (prefill: the last)


@dataclass
class SoloTrace:
    request: str
    calls: List[SoloCall] = field(default_factory=list)
    # event index -> per layer {tensor name: array on [0, offset)}, after the event
    snapshots: Dict[int, List[Dict[str, mx.array]]] = field(default_factory=dict)
    offsets: Dict[int, int] = field(default_factory=dict)
    own: List[int] = field(default_factory=list)  # the tokens of its stream: prompt's own, then every input fed

    def calls_at(self, event: int) -> List[SoloCall]:
        return [c for c in self.calls if c.event == event]

    def snapshot_at(self, event: int):
        """The cache as it stands after ``event``: the latest snapshot."""
        known = [e for e in self.snapshots if e <= event]
        return (self.snapshots[max(known)], self.offsets[max(known)]) if known else (None, None)


class SoloRequest:
    """One request's prompt cache, driven the way generate_step drives it."""

    def __init__(self, model, request, bits: int, group_size: int, vocab_size: int, tokenizer=None,
                 cache=None):
        self.model = model
        self.request = request
        self.bits = bits
        self.group_size = group_size
        self.vocab_size = vocab_size
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.prompt = prompt_tokens(request, vocab_size, tokenizer)
        self.logits_at: Dict[int, mx.array] = {}  # position -> logits row

    @property
    def layers(self) -> list:
        return self.cache

    @property
    def offset(self) -> int:
        return offset_of(self.cache)

    @property
    def quantized(self) -> bool:
        return converted(self.cache)

    def convert(self):
        maybe_quantize_kv_cache(
            self.cache, self.request.quantized_kv_start, self.group_size, self.bits
        )

    def remember(self, logits: mx.array, first_position: int):
        for i in range(logits.shape[0]):
            self.logits_at[first_position + i] = logits[i]

    def prefill(self, tokens: Optional[List[int]] = None) -> mx.array:
        """The prompt (or what a stored prefix lacks of it): chunks without
        logits, then the last token's logits."""
        tokens = mx.array(self.prompt if tokens is None else tokens)
        start = 0
        for n in self.request.prefill_chunks(tokens.shape[0])[:-1]:
            self.model(tokens[start : start + n][None], cache=self.cache)
            self.convert()
            mx.eval([c.state for c in self.cache])
            start += n
        logits = self.model(tokens[start:][None], cache=self.cache)[0, -1:, :]
        self.convert()
        self.remember(logits, self.offset - 1)
        return logits

    def next_token(self) -> int:
        return greedy(self.logits_at[self.offset - 1])

    def window(self, n: int) -> List[int]:
        """The inputs of an n-token call: the next token, then drafts."""
        first = self.next_token()
        return [first] + draft_tokens(self.request, self.offset, n - 1, self.vocab_size)

    def append(self, inputs: List[int]) -> mx.array:
        position = self.offset
        logits = self.model(mx.array(inputs)[None], cache=self.cache)[0]
        self.convert()
        self.remember(logits, position)
        return logits

    def trim(self, n: int):
        trim_prompt_cache(self.cache, n)


def run_solo(model, schedule, rid: str, vocab_size: int, tokenizer=None) -> SoloTrace:
    """Replay every call request ``rid`` sees in the schedule, alone."""
    return run_solos(model, schedule, [rid], vocab_size, tokenizer)[rid]


def run_solos(model, schedule, rids, vocab_size: int, tokenizer=None) -> Dict[str, SoloTrace]:
    """Replay the calls of ``rids``, each request alone, in the schedule's
    order. Rows are stored in, and requests resumed from, mlx-lm's own
    prompt-cache stores (``oracle/prompt_store.py``) holding mlx-lm's rows:
    a chat turn's prompt holds tokens of the requests before it, so a
    schedule with stores runs all its requests together."""
    stores = {name: LRUPromptCache(limits.max_size, limits.max_bytes) for name, limits in schedule.stores.items()}
    traces = {rid: SoloTrace(rid) for rid in rids}
    solos: Dict[str, SoloRequest] = {}

    def token(name) -> int:
        stream, k = name
        return traces[stream].own[k]

    for rid, j in schedule.order:
        if rid not in traces:
            continue
        call, trace, request = schedule.calls[rid][j], traces[rid], schedule.requests[rid]
        if call.op in ("prefill", "resume"):
            cache, rest = fetch_nearest(stores[call.store], call.tokens) if call.op == "resume" else (None, None)
            solo = solos[rid] = SoloRequest(model, request, schedule.bits, schedule.group_size, vocab_size,
                                            tokenizer, cache)
            trace.own = list(solo.prompt)
            inputs = list(solo.prompt) if rest is None else [token(t) for t in rest]
            trace.calls.append(SoloCall(call.event, call.op, inputs, solo.prefill(inputs)))
        elif call.op == "append":
            solo = solos[rid]
            inputs = solo.window(call.n)
            trace.own += inputs
            trace.calls.append(SoloCall(call.event, "append", inputs, solo.append(inputs)))
        elif call.op == "store":
            solo = solos[rid]
            stores[call.store].insert_cache(MODEL_KEY, list(call.tokens), [stored_copy(c) for c in solo.cache])
            trace.calls.append(SoloCall(call.event, "store", []))
        else:
            solo = solos[rid]
            solo.trim(call.n)
            trace.calls.append(SoloCall(call.event, "trim", []))
        trace.snapshots[call.event] = [layer_bytes(c) for c in solo.cache]
        trace.offsets[call.event] = solo.offset
        mx.eval([c.logits for c in trace.calls[-1:] if c.logits is not None], trace.snapshots[call.event])
    return traces

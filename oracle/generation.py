"""The generating oracle (L3): each request generated alone by mlx-lm's
``mlx_lm.generate.generate_step`` (greedy), with the cache semantics the
engine uses:

* ``quantized_kv_start`` None: ``prompt_cache=[QuantizedKVCache(group_size,
  bits) per layer]``, quantized from the first token. This is what
  BatchGenerator computes when each request's caches are quantized rows: it
  never converts a cache, so every key a request attends to, prompt
  included, is quantized. ``generate_step(..., kv_bits, quantized_kv_start=0)``
  is a different computation: it prefills its first chunk into a dense
  ``KVCache`` and converts afterwards, so that chunk attends unquantized keys
  (measured: its log-probs differ from BatchGenerator's).
* ``quantized_kv_start: N``: ``generate_step(..., kv_bits, kv_group_size,
  quantized_kv_start=N)``, mlx-lm's delayed conversion.

A request that an engine started from a stored prompt cache (a conversation's
next turn, a shared system prompt) is compared with the same request alone
from the same stored prefix (``generate_from_prefix``): mlx-lm's own
``LRUPromptCache`` holding that entry, ``fetch_nearest_cache`` (a deep copy,
trimmed to the common prefix when the stored prompt is longer), then
``generate_step(rest, prompt_cache=that copy)``. Not the request prefilled
from scratch: a prefix computed in another call need not be bit-identical to
one computed in the same prefill, and that is mlx-lm's behaviour, not the cache's.

Where L2's oracle (``oracle/solo.py``) replays the calls a schedule makes,
this one lets mlx-lm generate freely: the engine decides the calls. A request
is anything with the attributes in ``GENERATION_FIELDS`` (an L3
``EngineRequest``). Generations are cached by content hash, like L2's traces,
with the quantized layers of the cache each run ended with (what L3 holds the
entries an engine stores against).
"""

import hashlib
import json
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, QuantizedKVCache, make_prompt_cache, trim_prompt_cache

from kvparity.oracle.arrays import digest, handles
from kvparity.oracle.machine import machine
from kvparity.oracle.plan import fresh_rows
from kvparity.oracle.sealed import cached
from kvparity.oracle.trace import oracle_cache

GENERATION_FORMAT = "kvparity.l3-solo/3"  # 2: entries sealed; 3: with the cache the run ended with
GENERATION_FILE = "generation.safetensors"
# What a generation depends on, besides the model and the machine.
GENERATION_FIELDS = ("prompt", "max_tokens", "bits", "group_size", "quantized_kv_start", "prefill_step_size")


@dataclass
class SoloGeneration:
    tokens: List[int]
    logprobs: List[mx.array]  # full vectors, as generate_step yields them
    # mlx-lm's prompt cache the run ended with (prompt and every token): what
    # L3 holds each entry an engine stored against. Read back from the oracle
    # cache, its quantized layers only (None for every other layer).
    cache: Optional[list] = None


def semantics(request) -> str:
    """Which mlx-lm computation the request is compared with, in words."""
    if request.bits is None:
        return "mlx-lm dense (no kv_bits)"
    if request.quantized_kv_start is None:
        return f"quantized from the first token ({request.bits}-bit, group {request.group_size})"
    return (f"mlx-lm kv_bits={request.bits} kv_group_size={request.group_size} "
            f"quantized_kv_start={request.quantized_kv_start}")


def generate_alone(model, request) -> SoloGeneration:
    """The request alone through generate_step, greedy (its default sampler),
    with the cache the run ended with (mlx-lm's own list: its kv_bits
    conversion replaces layers in it), prompt and every yielded token."""
    cache = (fresh_rows(model, request.bits, request.group_size, QuantizedKVCache)
             if request.bits is not None and request.quantized_kv_start is None else make_prompt_cache(model))
    tokens, logprobs = [], []
    for token, vector in generate_step(mx.array(request.prompt), model, max_tokens=request.max_tokens,
                                       prefill_step_size=request.prefill_step_size, prompt_cache=cache,
                                       **conversion(request)):
        tokens.append(token)
        logprobs.append(vector)
    mx.eval(logprobs)
    return SoloGeneration(tokens, logprobs, cache)


def conversion(request) -> dict:
    """generate_step's kv_bits arguments where the request converts its cache
    at quantized_kv_start (none: dense, or QuantizedKVCache from the first token)."""
    if request.bits is None or request.quantized_kv_start is None:
        return {}
    return dict(kv_bits=request.bits, kv_group_size=request.group_size,
                quantized_kv_start=request.quantized_kv_start)


# An engine serves one model: the key LRUPromptCache files its entries under.
PROMPT_CACHE_MODEL = "model"


class NotQuantized(Exception):
    """A stored entry that mlx-lm's QuantizedKVCache cannot hold."""


def quantized_copy(cache) -> QuantizedKVCache:
    """mlx-lm's own ``QuantizedKVCache`` holding the bytes ``cache`` holds now
    (new handles on its arrays: what is later written into the originals in
    place does not reach it). ``cache`` is one layer of what ``extract``
    returned, which the protocol says is a solo ``QuantizedKVCache``."""
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if not (hasattr(cache, "bits") and isinstance(keys, (tuple, list)) and isinstance(values, (tuple, list))):
        raise NotQuantized(f"a {type(cache).__name__}, not a quantized cache with key and value triples")
    copy = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    copy.keys, copy.values = tuple(handles(keys)), tuple(handles(values))
    copy.offset = int(cache.offset)
    mx.eval(copy.keys, copy.values)
    return copy


def fetch_nearest(store: LRUPromptCache, prompt: Sequence[int]):
    """``store.fetch_nearest_cache`` for ``prompt``: (cache or None, the tokens
    still to feed). An exact hit leaves nothing to feed, which BatchGenerator
    refuses (an empty prompt) and generate_step cannot start from; both then
    give the last token back: mlx-lm's ``trim_prompt_cache`` by one, and feed it."""
    cache, rest = store.fetch_nearest_cache(PROMPT_CACHE_MODEL, list(prompt))
    if cache is not None and not rest:
        trim_prompt_cache(cache, 1)
        rest = list(prompt[-1:])
    return cache, list(rest)


@dataclass
class StoredPrefix:
    """A prompt cache an engine stored: its key tokens and mlx-lm's own
    ``QuantizedKVCache`` per layer holding the bytes it stored."""

    number: int  # in the order the engine stored entries
    tokens: Tuple[int, ...]
    layers: Optional[List[QuantizedKVCache]]  # None: see ``unusable``
    source: str  # the request whose row it was extracted from
    step: int  # the engine step it was stored at
    kind: str  # LRUPromptCache's cache_type: "user" (a prompt) or "assistant" (a finished turn)
    unusable: str = ""  # why mlx-lm's QuantizedKVCache cannot hold what was stored

    def describe(self) -> str:
        return f"stored entry #{self.number} ({self.kind}, {len(self.tokens)} tokens of {self.source!r}, step {self.step})"


def fetched(stored: StoredPrefix, prompt: Sequence[int]):
    """``fetch_nearest`` for ``prompt`` from an LRUPromptCache holding ``stored``."""
    store = LRUPromptCache()
    store.insert_cache(PROMPT_CACHE_MODEL, list(stored.tokens), list(stored.layers))
    return fetch_nearest(store, prompt)


def matched(stored: StoredPrefix, prompt: Sequence[int]) -> int:
    """How many of ``prompt``'s tokens ``fetch_nearest`` takes from ``stored``."""
    cache, rest = fetched(stored, prompt)
    return 0 if cache is None else len(prompt) - len(rest)


def generate_from_prefix(model, request, prompt: Sequence[int], stored: StoredPrefix) -> Tuple[SoloGeneration, int]:
    """``prompt`` alone through mlx-lm from ``stored``: an LRUPromptCache holding
    that entry, ``fetch_nearest`` (mlx-lm's deep copy and trim), then
    generate_step on the rest, greedy. Returns the generation and how many
    prompt tokens came from the stored entry; its cache as in ``generate_alone``."""
    cache, rest = fetched(stored, prompt)
    if cache is None:
        raise ValueError(f"{stored.describe()} is no prefix of the prompt it was fetched for")
    tokens, logprobs = [], []
    for token, vector in generate_step(mx.array(rest), model, max_tokens=request.max_tokens,
                                       prefill_step_size=request.prefill_step_size, prompt_cache=cache,
                                       **conversion(request)):
        tokens.append(token)
        logprobs.append(vector)
    mx.eval(logprobs)
    return SoloGeneration(tokens, logprobs, cache), len(prompt) - len(rest)


def generation_key(request, model_sha256: str) -> str:
    spec = {
        "format": GENERATION_FORMAT,
        "model": model_sha256,
        "request": {k: getattr(request, k) for k in GENERATION_FIELDS},
        "machine": machine(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=list).encode()).hexdigest()


def cached_generate_alone(model, request, model_sha256: str, use_cache: bool = True) -> SoloGeneration:
    """``generate_alone``, reusing a stored result with the same content hash
    once its entry proves whole (``oracle/sealed.py``); else computed afresh."""
    if not use_cache:
        return generate_alone(model, request)
    return cached(oracle_cache() / "l3", generation_key(request, model_sha256), _load_generation,
                  lambda: generate_alone(model, request),
                  lambda solo, staging: _save_generation(solo, request, staging))


def _save_generation(solo: SoloGeneration, request, staging):
    layers, held = _quantized_layers(solo.cache)
    mx.save_safetensors(str(staging / GENERATION_FILE),
                        {**{f"logprobs{i}": v for i, v in enumerate(solo.logprobs)}, **held})
    (staging / "manifest.json").write_text(json.dumps({
        "format": GENERATION_FORMAT, "tokens": solo.tokens, "cache": layers,
        "sha256": digest(solo.logprobs + list(held.values())), "semantics": semantics(request),
    }))


def _load_generation(directory) -> SoloGeneration:
    manifest = json.loads((directory / "manifest.json").read_text())
    tensors = mx.load(str(directory / GENERATION_FILE))
    tokens, layers = manifest["tokens"], manifest["cache"]
    if manifest["format"] != GENERATION_FORMAT or not all(type(t) is int for t in tokens):
        raise ValueError(f"not a {GENERATION_FORMAT} entry")
    vectors = [tensors[f"logprobs{i}"] for i in range(len(tokens))]
    held = _held_names(layers)
    if len(tensors) != len(tokens) + len(held) or digest(vectors + [tensors[n] for n in held]) != manifest["sha256"]:
        raise ValueError("the log-probs and the cache do not match their sha256")
    return SoloGeneration(tokens, vectors, _read_layers(layers, tensors))


_SIDES, _PARTS = ("keys", "values"), ("packed", "scales", "biases")
_NUMBERS = ("offset", "bits", "group_size")


def _quantized_layers(cache: list) -> Tuple[list, dict]:
    """A prompt cache's quantized layers as the manifest describes them (None
    for a layer mlx-lm keeps unquantized) and their triples by tensor name, in
    the order ``_held_names`` gives."""
    layers = [{n: int(getattr(c, n)) for n in _NUMBERS} if hasattr(c, "bits") else None for c in cache]
    held = {name: x for c, names in zip(cache, _names_by_layer(layers)) if names
            for name, x in zip(names, (*c.keys, *c.values))}
    return layers, held


def _names_by_layer(layers: list) -> List[List[str]]:
    return [[f"cache{i}.{side}.{part}" for side in _SIDES for part in _PARTS] if layer is not None else []
            for i, layer in enumerate(layers)]


def _held_names(layers: list) -> List[str]:
    if not isinstance(layers, list) or not all(
            layer is None or (isinstance(layer, dict) and sorted(layer) == sorted(_NUMBERS)
                              and all(type(v) is int for v in layer.values())) for layer in layers):
        raise ValueError("the cache's layers are not described as stored")
    return [name for names in _names_by_layer(layers) for name in names]


def _read_layers(layers: list, tensors: dict) -> list:
    """mlx-lm's own QuantizedKVCache per quantized layer, holding the stored triples."""
    read = []
    for layer, names in zip(layers, _names_by_layer(layers)):
        if layer is None:
            read.append(None)
            continue
        cache = QuantizedKVCache(group_size=layer["group_size"], bits=layer["bits"])
        cache.keys, cache.values = tuple(tensors[n] for n in names[:3]), tuple(tensors[n] for n in names[3:])
        cache.offset = layer["offset"]
        read.append(cache)
    return read

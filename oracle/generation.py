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

Where L2's oracle (``oracle/solo.py``) replays the calls a schedule makes,
this one lets mlx-lm generate freely: the engine decides the calls. A request
is anything with the attributes in ``GENERATION_FIELDS`` (an L3
``EngineRequest``). Generations are cached by content hash, like L2's traces.
"""

import hashlib
import json
from dataclasses import dataclass
from typing import List

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.arrays import digest
from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.machine import machine
from kvparity.oracle.trace import drop_entry, oracle_cache

GENERATION_FORMAT = "kvparity.l3-solo/1"
# What a generation depends on, besides the model and the machine.
GENERATION_FIELDS = ("prompt", "max_tokens", "bits", "group_size", "quantized_kv_start", "prefill_step_size")


@dataclass
class SoloGeneration:
    tokens: List[int]
    logprobs: List[mx.array]  # full vectors, as generate_step yields them


def semantics(request) -> str:
    """Which mlx-lm computation the request is compared with, in words."""
    if request.quantized_kv_start is None:
        return f"quantized from the first token ({request.bits}-bit, group {request.group_size})"
    return (f"mlx-lm kv_bits={request.bits} kv_group_size={request.group_size} "
            f"quantized_kv_start={request.quantized_kv_start}")


def generate_alone(model, request) -> SoloGeneration:
    """The request alone through generate_step, greedy (its default sampler)."""
    kwargs = dict(max_tokens=request.max_tokens, prefill_step_size=request.prefill_step_size)
    if request.quantized_kv_start is None:
        kwargs["prompt_cache"] = [QuantizedKVCache(group_size=request.group_size, bits=request.bits)
                                  for _ in model.layers]
    else:
        kwargs.update(kv_bits=request.bits, kv_group_size=request.group_size,
                      quantized_kv_start=request.quantized_kv_start)
    tokens, logprobs = [], []
    for token, vector in generate_step(mx.array(request.prompt), model, **kwargs):
        tokens.append(token)
        logprobs.append(vector)
    mx.eval(logprobs)
    return SoloGeneration(tokens, logprobs)


def generation_key(request, model_sha256: str) -> str:
    spec = {
        "format": GENERATION_FORMAT,
        "model": model_sha256,
        "request": {k: getattr(request, k) for k in GENERATION_FIELDS},
        "machine": machine(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=list).encode()).hexdigest()


def cached_generate_alone(model, request, model_sha256: str, use_cache: bool = True) -> SoloGeneration:
    """``generate_alone``, reusing a stored result with the same content hash;
    a stored result whose tensors do not match their sha256 is recomputed."""
    if not use_cache:
        return generate_alone(model, request)
    directory = oracle_cache() / "l3" / generation_key(request, model_sha256)
    manifest_path = directory / "manifest.json"
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
            tensors = mx.load(str(directory / "logprobs.safetensors"))
            vectors = [tensors[f"logprobs{i}"] for i in range(len(manifest["tokens"]))]
            if manifest["format"] == GENERATION_FORMAT and digest(vectors) == manifest["sha256"]:
                return SoloGeneration(manifest["tokens"], vectors)
        except (OSError, ValueError, KeyError, RuntimeError):
            pass
        drop_entry(directory)
    solo = generate_alone(model, request)
    try:
        with AtomicDirectory(directory.parent, directory.name) as staging:
            mx.save_safetensors(str(staging / "logprobs.safetensors"),
                                {f"logprobs{i}": v for i, v in enumerate(solo.logprobs)})
            (staging / "manifest.json").write_text(json.dumps({
                "format": GENERATION_FORMAT, "tokens": solo.tokens, "sha256": digest(solo.logprobs),
                "semantics": semantics(request),
            }))
    except FileExistsError:
        pass  # another run stored the same result
    return solo

"""mlx-lm's prompt-cache store, as its server uses it.

A store is mlx-lm's own ``LRUPromptCache``: a row's cache goes in under the
tokens it holds (``insert_cache``, which counts ``nbytes`` against the byte
limit), and a new prompt starts from the nearest stored prefix
(``fetch_nearest_cache``: a deep copy, trimmed to the common prefix when the
stored prompt is longer). Tokens are named (stream, index): a request draws
its own tokens from its stream, and a chat turn's prompt starts with the
tokens of the turn it continues. One model, so one key for it.
"""

import copy

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, trim_prompt_cache

MODEL_KEY = "model"


def fetch_nearest(store, prompt) -> tuple:
    """mlx-lm's ``fetch_nearest_cache``: (a copy of the nearest stored prefix
    or None, the prompt's tokens it lacks). An exact hit lacks none; a
    request needs the logits of its last prompt token, so the copy gives
    one back and that token is prefilled, as mlx-lm's fetch keeps one when
    it trims a longer stored prompt (``min(len(tokens) - 1, common_prefix)``)."""
    cache, rest = store.fetch_nearest_cache(MODEL_KEY, list(prompt))
    if cache is not None and not rest:
        trim_prompt_cache(cache, 1)
        rest = list(prompt[-1:])
    return cache, list(rest)


def stored_copy(cache):
    """mlx-lm's cache as a store holds a row taken out of a batch: its
    tokens, in arrays of their own (the oracle's side of ``extract``); a
    layer mlx-lm does not quantize (SSM state), as mlx-lm's store copies it."""
    if not isinstance(cache, QuantizedKVCache):
        return copy.deepcopy(cache)
    copy_ = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    copy_.offset = cache.offset
    copy_.keys, copy_.values = (tuple(mx.array(x[..., : cache.offset, :]) for x in triple)
                                for triple in (cache.keys, cache.values))
    return copy_

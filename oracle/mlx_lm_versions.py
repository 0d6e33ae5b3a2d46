"""The mlx-lm versions kvparity runs on, and mlx-lm's own defects it reports.

The oracle and the batched path are always the installed mlx-lm's own code.
This is the one place that knows how mlx-lm versions differ: a compatibility
shim goes here, with the version and the API difference it bridges, and so
does each defect of mlx-lm's own batched path that no cache can avoid.

A defect is found by running the installed mlx-lm's code, never by reading
its version number: a patched or backported mlx-lm is judged by what it does.
"""

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

# The oldest mlx-lm whose oracle path kvparity uses unchanged (pyproject.toml
# requires it); every minor from it to the newest is gated in CI (noxfile.py).
OLDEST_SUPPORTED = "0.31"


def mlx_lm_version() -> str:
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "unknown"


# A compatibility shim goes here, one per API difference; 0.31.3 and 0.32.x need none.


# --- mlx-lm's own defects -----------------------------------------------------


@dataclass(frozen=True)
class MlxLmDefect:
    """A defect of mlx-lm's own batched path: wrong whatever the cache holds."""

    name: str
    what: str  # what goes wrong, in one sentence
    source: str  # mlx-lm's source that does it
    fixed_in: str  # the first mlx-lm release without it; NOT_FIXED for a limit of every release
    consequence: str  # what it leaves kvparity unable to judge
    script: str = ""  # its plain-mlx-lm reproduction (DEFECT_SCRIPTS), where one shows it

    def attribution(self) -> str:
        """What a report says where the defect decides an outcome."""
        fixed = f"fixed in mlx-lm {self.fixed_in}" if self.fixed_in else "not fixed in mlx-lm"
        shown = f"; reproduced by {self.script}" if self.script else ""
        return (f"mlx-lm {mlx_lm_version()} defect ({self.name}): {self.what} [{self.source}; "
                f"{fixed}{shown}]: {self.consequence}")


# The reproductions: plain mlx-lm scripts, each exiting 1 while its defect is there.
DEFECT_SCRIPTS = Path(__file__).parent / "mlx_lm_defects"


def script_path(name: str) -> str:
    """How an attribution names a reproduction: its path in this repository."""
    return f"oracle/mlx_lm_defects/{name}"


@lru_cache(maxsize=None)
def script_links() -> Tuple[Tuple[str, str, Tuple[str, ...]], ...]:
    """(defect name, script, texts) for each reproduction that says which
    attribution it reproduces, in its header: ``# kvparity-defect: NAME`` and
    one ``# kvparity-match: TEXT`` per text the defect's what and source must
    all contain (mlx-lm's file, function or message: never a model family)."""
    links = []
    for script in sorted(DEFECT_SCRIPTS.glob("*.py")):
        header = [line.split(":", 1) for line in script.read_text().splitlines() if line.startswith("# kvparity-")]
        names = [value.strip() for key, value in header if key == "# kvparity-defect"]
        texts = tuple(value.strip() for key, value in header if key == "# kvparity-match")
        if names:
            links.append((names[0], script_path(script.name), texts))
    return tuple(links)


def with_script(defect: Optional[MlxLmDefect]) -> Optional[MlxLmDefect]:
    """``defect`` naming the reproduction that shows it, where exactly one matches."""
    if defect is None or defect.script:
        return defect
    text = f"{defect.what} {defect.source}"
    found = [script for name, script, texts in script_links()
             if name == defect.name and texts and all(t in text for t in texts)]
    return replace(defect, script=found[0]) if len(found) == 1 else defect


# What ``attribution`` writes before the defect's text; ``defect_named`` reads its name back.
_ATTRIBUTED = re.compile(r"^mlx-lm \S+ defect \(([^()\s]+)\): ")


def defect_named(text: str) -> Optional[str]:
    """The defect's name in a report's reason that ``attribution`` wrote, or None."""
    found = _ATTRIBUTED.match(text or "")
    return found and found.group(1)


class MlxLmDefectFound(Exception):
    """Raised where an installed mlx-lm defect keeps a run from judging the cache."""

    def __init__(self, defect: MlxLmDefect):
        super().__init__(defect.attribution())
        self.defect = defect


GQA_LEFT_PADDING_MASK = MlxLmDefect(
    name="gqa-left-padding-mask",
    what=("quantized attention with grouped-query heads broadcasts a batch's (B, 1, L, S) left-padding mask "
          "against its (B, kv_heads, repeats, L, S) scores without expanding it, so row i's mask lands on kv "
          "head i (wrong logits when B equals kv_heads, a broadcast error otherwise)"),
    source="mlx_lm/models/base.py quantized_scaled_dot_product_attention, before 'mask = mx.expand_dims(mask, -3)'",
    fixed_in="0.32.0",
    consequence=("the cache's bytes held, the logits diverge through mlx-lm's attention, so parity cannot be "
                 "judged on this model here"),
    script=script_path("gqa_left_padding_mask.py"),
)


def _mask_broadcast_breaks(attention: Callable, n_heads: int, n_kv_heads: int) -> bool:
    """True when ``attention`` raises on a batch of 3 rows with uneven left
    padding (3 is neither 1 nor the 2 kv heads, so a mask broadcast over kv
    heads instead of rows cannot go unnoticed)."""
    B, L, S, head_dim, bits, group_size = 3, 1, 8, 64, 4, 64
    queries = mx.zeros((B, n_heads, L, head_dim), dtype=mx.float32)
    keys = mx.quantize(mx.zeros((B, n_kv_heads, S, head_dim)), group_size=group_size, bits=bits)
    values = mx.quantize(mx.zeros((B, n_kv_heads, S, head_dim)), group_size=group_size, bits=bits)
    # What BatchKVCache.make_mask gives for rows padded by 0, 2 and 5 columns.
    mask = create_causal_mask(L, S - L, left_padding=mx.array([0, 2, 5]))
    try:
        mx.eval(attention(queries, keys, values, scale=1.0, mask=mask, group_size=group_size, bits=bits))
    except ValueError:
        return True
    return False


def has_gqa_left_padding_mask_defect(attention: Optional[Callable] = None) -> bool:
    """The installed (or given) quantized attention breaks on a grouped-query
    batch with a left-padding mask while the same batch with a kv head per
    query head runs: the defect is in the grouped-query path alone."""
    attention = attention or quantized_scaled_dot_product_attention
    return _mask_broadcast_breaks(attention, 4, 2) and not _mask_broadcast_breaks(attention, 4, 4)


BATCH_GENERATOR_OWN_CACHE = MlxLmDefect(
    name="batch-generator-own-cache",
    what=("BatchGenerator serves prompts whose inserted caches are all empty from a bfloat16 BatchKVCache of its "
          "own, never merging the caches it was given, so the cache under test never serves a token"),
    source="mlx_lm/generate.py BatchGenerator._process_prompts, 'if all(c[0].empty() for c in caches)'",
    fixed_in="0.31.0",
    consequence="L3 on this BatchGenerator cannot judge a cache",
)


class _MergeRecorder(KVCache):
    merged = 0

    @classmethod
    def merge(cls, caches):
        _MergeRecorder.merged += 1
        return super().merge(caches)


def batch_generator_serves_its_own_cache(generator_class=None) -> bool:
    """True when mlx-lm's BatchGenerator (or the given class) serves a prompt
    without ever merging the empty caches inserted with it."""
    from mlx_lm.models import llama  # a tiny model of mlx-lm's own: its weights do not matter here

    generator_class = generator_class or BatchGenerator
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, vocab_size=16))
    generator = generator_class(model)
    _MergeRecorder.merged = 0
    try:
        generator.insert([[1, 2, 3]], max_tokens=[1], caches=[[_MergeRecorder() for _ in model.layers]])
        for _ in range(4):  # a prompt step, then a token
            generator.next()
    finally:
        generator.close()
    return _MergeRecorder.merged == 0


@lru_cache(maxsize=None)
def installed_batch_generator_defect() -> Optional[MlxLmDefect]:
    """The installed BatchGenerator's defect that keeps L3 from judging a cache, or None."""
    return BATCH_GENERATOR_OWN_CACHE if batch_generator_serves_its_own_cache() else None


@lru_cache(maxsize=None)
def _installed_has_gqa_defect() -> bool:
    return has_gqa_left_padding_mask_defect()


def defects_for(n_heads: int, n_kv_heads: int) -> List[MlxLmDefect]:
    """The installed mlx-lm's defects that reach a model with these heads."""
    if n_kv_heads < n_heads and _installed_has_gqa_defect():
        return [GQA_LEFT_PADDING_MASK]
    return []


def defect_for_model(loaded) -> Optional[MlxLmDefect]:
    """The first installed mlx-lm defect or limit that reaches ``loaded`` (a
    LoadedModel): the grouped-query mask where mlx-lm's quantized attention
    receives grouped heads on it, then what its plan's probe found."""
    found = [d for q, kv in loaded.plan.attention_heads for d in defects_for(q, kv)]
    return found[0] if found else loaded.limit


# --- mlx-lm's limits on a model, found by running its code on that model ------
# (oracle/plan.py probes each model; the first limit found decides its outcome)

NOT_FIXED = ""  # a limit of every mlx-lm release kvparity knows


def mlx_lm_frame(error: BaseException) -> str:
    """The innermost frame of mlx-lm's own code in ``error``'s traceback, as
    ``mlx_lm/models/cache.py:554 (to_quantized)``; empty when none is mlx-lm's."""
    import traceback

    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "/mlx_lm/" in path:
            found = f"mlx_lm/{path.rsplit('/mlx_lm/', 1)[1]}:{frame.lineno} ({frame.name})"
    return found


def solo_kv_bits_raises(error: BaseException, doing: str) -> MlxLmDefect:
    """mlx-lm's solo kv_bits path raised on this model: it cannot exist here."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    what = f"{doing} raises {type(error).__name__}: {first_line}"
    return MlxLmDefect(name="solo-kv-bits-raises", what=what, source=mlx_lm_frame(error) or "mlx-lm",
                       fixed_in=NOT_FIXED,
                       consequence="mlx-lm's solo kv_bits run, the oracle, cannot exist on this model")


def no_batched_class(cache: str, index: int) -> MlxLmDefect:
    return MlxLmDefect(
        name="no-batched-class",
        what=f"layer {index}'s {cache} has no merge, so mlx-lm cannot batch it",
        source=f"mlx_lm/models/cache.py class {cache}; mlx_lm/generate.py _merge_caches",
        fixed_in=NOT_FIXED, consequence="a batch of this model cannot be built the way mlx-lm builds one")


def kv_bits_leaves_dense(caches: List[str]) -> MlxLmDefect:
    return MlxLmDefect(
        name="kv-bits-leaves-dense",
        what=(f"kv_bits converts no layer of this model: its {', '.join(caches)} caches have no to_quantized, "
              "so mlx-lm's solo kv_bits run silently keeps every layer dense"),
        source="mlx_lm/generate.py maybe_quantize_kv_cache, 'if hasattr(c, \"to_quantized\")'",
        fixed_in=NOT_FIXED, consequence="no layer of this model is a quantized cache, so none can be judged")


DENSE_PROMPTS = ([3, 1, 4, 1, 5, 9, 2], [6, 5, 3])  # uneven: the shorter row is padded
DENSE_TOKENS = 3


def _dense_generations(model, prompts) -> List[List[mx.array]]:
    generator = BatchGenerator(model)
    out = {}
    try:
        uids = generator.insert([list(p) for p in prompts], max_tokens=[DENSE_TOKENS] * len(prompts))
        out = {uid: [] for uid in uids}
        for _ in range(4 * DENSE_TOKENS + sum(map(len, prompts))):
            _, responses = generator.next()
            for response in responses:
                out[response.uid].append(response.logprobs)
            if all(len(v) == DENSE_TOKENS for v in out.values()):
                break
    finally:
        generator.close()
    mx.eval(list(out.values()))
    return [out[uid] for uid in uids]


def dense_batch_differs(model) -> Optional[MlxLmDefect]:
    """mlx-lm's own dense BatchGenerator on two uneven prompts together, against
    each alone: where they differ (or the batch raises), mlx-lm's batched path
    is wrong on this model whatever a cache holds."""
    where = "mlx_lm/generate.py BatchGenerator, the model's batched forward"
    try:
        together = _dense_generations(model, DENSE_PROMPTS)
    except Exception as error:
        return MlxLmDefect(
            name="dense-batch-raises", what=f"mlx-lm's own dense BatchGenerator raises {type(error).__name__}: "
                                            f"{error} on two uneven prompts", source=mlx_lm_frame(error) or where,
            fixed_in=NOT_FIXED, consequence="mlx-lm cannot batch this model, so no batch of it can be judged")
    for row, prompt in enumerate(DENSE_PROMPTS):
        (alone,) = _dense_generations(model, [prompt])
        for i, (a, b) in enumerate(zip(alone, together[row])):
            if a.dtype != b.dtype or a.shape != b.shape or not mx.array_equal(a, b).item():
                return MlxLmDefect(
                    name="dense-batch-differs",
                    what=(f"mlx-lm's own dense BatchGenerator gives row {row} (prompt of {len(prompt)} tokens, "
                          f"beside one of {len(DENSE_PROMPTS[1 - row])}) other log-probs at token {i} than the "
                          "same prompt alone"),
                    source=where, fixed_in=NOT_FIXED,
                    consequence="mlx-lm's batched path is not batch-invariant on this model, so a batch's "
                                "divergence cannot be told from the cache's")
    return None


QUANTIZED_FIRST_WRITE = MlxLmDefect(
    name="quantized-kv-first-write-width",
    what=("an empty QuantizedKVCache allocates each token's packed words as dim // (32 // bits), not the "
          "dim * bits / 32 words mx.quantize packs, when 32 is no multiple of bits (3, 5 and 6 bits at some "
          "dims), so its first write raises a broadcast error"),
    source="mlx_lm/models/cache.py QuantizedKVCache.update_and_fetch, init_quant 'dim // el_per_int'",
    fixed_in=NOT_FIXED,
    consequence="mlx-lm's solo run quantized from the first token, the L3 oracle, cannot run here",
    script=script_path("quantized_kv_first_write_width.py"),
)


@lru_cache(maxsize=None)
def first_write_breaks(bits: int, group_size: int, dim: int) -> bool:
    """True when the installed mlx-lm's empty QuantizedKVCache raises on its first write of ``dim`` columns."""
    from mlx_lm.models.cache import QuantizedKVCache

    x = mx.zeros((1, 1, 1, dim))
    try:
        mx.eval(QuantizedKVCache(group_size=group_size, bits=bits).update_and_fetch(x, x))
    except ValueError:
        return True
    return False


def first_write_defect(bits: int, group_size: int, dims) -> Optional[MlxLmDefect]:
    """The first-write defect where it reaches a request of ``bits`` on a model with these packed dims."""
    broken = [d for d in dims if first_write_breaks(bits, group_size, d)]
    if not broken:
        return None
    return replace(QUANTIZED_FIRST_WRITE, consequence=f"{QUANTIZED_FIRST_WRITE.consequence} "
                                                      f"({bits} bits, dims {', '.join(map(str, broken))})")

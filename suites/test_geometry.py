"""A model's geometry is read off the built model, never off config fields
only some architectures have (``oracle/plan.py``): published configs whose
head fields are absent, or whose first cache keeps no keys, are judged or
named; a model that itself leaves nothing to judge (every layer keeps
recurrent state; a head dim no MLX group size divides) is one line and "cannot judge
here" at every level that takes a model; one mlx-lm cannot run on this
backend cannot be judged here; a config.json given by any path is served at
L4 from kvparity's own output, never beside the user's file."""

import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvparity.oracle import mlx_lm_versions
from kvparity.oracle.atomic import STAGING
from kvparity.oracle.mlx_lm_versions import GQA_LEFT_PADDING_MASK, defect_for_model
from kvparity.oracle.models import load_model
from kvparity.oracle.plan import CachePlan, LayerPlan
from kvparity.reports.cli import main
from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, EXIT_OK
from kvparity.suites.l4 import server as l4_server
from kvparity.suites.runners import L4_CATALOG
from kvparity.suites.format.schedule import CATALOG

# The published configs' fields, at fewer layers and narrower widths (what decides the cache kept).
RECURRENT_GEMMA = {  # Griffin: two recurrent blocks, then local attention in a RotatingKVCache
    "model_type": "recurrent_gemma", "attention_bias": False, "attention_window_size": 16, "conv1d_width": 4,
    "block_types": ["recurrent", "recurrent", "attention"], "head_dim": 64, "hidden_size": 128,
    "intermediate_size": 256, "logits_soft_cap": 30.0, "lru_width": 128, "num_attention_heads": 2,
    "num_hidden_layers": 3, "num_key_value_heads": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "vocab_size": 256}
MAMBA = {  # no attention layer at all
    "model_type": "mamba", "conv_kernel": 4, "expand": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "state_size": 16, "time_step_rank": 4, "use_bias": False, "use_conv_bias": True,
    "vocab_size": 256}
EXAONE = {  # EXAONE 3.5: head_dim 80 (hidden 2560 / 32 heads)
    "model_type": "exaone", "head_dim": 80, "hidden_size": 160, "intermediate_size": 256, "layer_norm_epsilon": 1e-5,
    "num_attention_heads": 2, "num_key_value_heads": 1, "num_layers": 2, "rope_theta": 1000000.0,
    "vocab_size": 256}
PYTHIA = {  # gpt_neox: no num_key_value_heads nor head_dim in its config
    "model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 256, "layer_norm_eps": 1e-5,
    "max_position_embeddings": 2048, "num_attention_heads": 2, "num_hidden_layers": 2, "rotary_emb_base": 10000,
    "rotary_pct": 0.25, "tie_word_embeddings": False, "use_parallel_residual": True, "vocab_size": 512}
GPT2 = {  # its widths are n_embd and n_head: no hidden_size, no num_attention_heads
    "model_type": "gpt2", "layer_norm_epsilon": 1e-5, "n_ctx": 1024, "n_embd": 128, "n_head": 2, "n_layer": 2,
    "n_positions": 1024, "vocab_size": 512}
HELIUM = {
    "model_type": "helium", "attention_bias": False, "head_dim": 64, "hidden_size": 128, "intermediate_size": 256,
    "max_position_embeddings": 4096, "mlp_bias": False, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-8, "rope_theta": 20000.0, "tie_word_embeddings": False,
    "vocab_size": 256}
MINICPM = {  # tied, as MiniCPM-2B is: mlx-lm's sanitize adds an lm_head its model has not
    "model_type": "minicpm", "dim_model_base": 256, "hidden_size": 128, "intermediate_size": 256,
    "max_position_embeddings": 2048, "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "scale_depth": 1.4, "scale_emb": 12, "tie_word_embeddings": True, "vocab_size": 512}
BITNET = {  # its linear layers run a Metal kernel of mlx-lm's own
    "model_type": "bitnet", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "vocab_size": 256}
DIES = f"{sys.executable} -c \"import sys; sys.exit(3)\" {{model}} {{port}}"
MLX_LM = f"{sys.executable} -m mlx_lm server --model {{model}} --port {{port}}"


def written(tmp_path: Path, name: str, config: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def models_record(path: str, capsys) -> dict:
    assert main(["models", path, "--json"]) == EXIT_OK
    (record,) = json.loads(capsys.readouterr().out)["models"]
    return record


def test_a_first_cache_without_keys_gives_the_heads_of_the_attention_layers(tmp_path, capsys):
    """RecurrentGemma's first caches are recurrent state: its heads are its
    attention layer's, and mlx-lm's own limit there is named (was a crash
    comparing None heads)."""
    path = written(tmp_path, "recurrentgemma", RECURRENT_GEMMA)
    record = models_record(path, capsys)
    assert record["plan"] == "ArraysCache*2, RotatingKVCache"
    assert record["solo_kv_bits"] == "solo-kv-bits-raises" and "RotatingKVCache Quantization NYI" in record["limit"]
    loaded = load_model(path)
    assert (loaded.head_dim, loaded.n_kv_heads) == (64, 1)  # its attention layer's, though mlx-lm cannot quantize it
    # a run's report, its L0 probes on those shapes included, is written
    args = ["run", "--level", "L2", "--model", path, "--schedule", str(CATALOG / "join-empty.json"),
            "--out", str(tmp_path / "out")]
    assert main(args) == EXIT_CANNOT_JUDGE
    assert "1 mlx-lm defect" in capsys.readouterr().out and list((tmp_path / "out").glob("*/report.json"))


def test_heads_are_what_mlx_lm_s_quantized_attention_receives(tmp_path, monkeypatch):
    pythia = load_model(written(tmp_path, "pythia", PYTHIA))  # its config names no kv heads
    assert (pythia.head_dim, pythia.n_kv_heads, pythia.n_heads) == (64, 2, 2)
    assert (pythia.hidden_size, pythia.vocab_size) == (128, 512)
    gpt2 = load_model(written(tmp_path, "gpt2", GPT2))
    assert (gpt2.head_dim, gpt2.n_kv_heads, gpt2.n_heads, gpt2.hidden_size, gpt2.vocab_size) == (64, 2, 2, 128, 512)
    helium = load_model(written(tmp_path, "helium", HELIUM))
    assert helium.plan.attention_heads == ((4, 2),) and (helium.n_heads, helium.n_kv_heads) == (4, 2)
    # The grouped-query mask defect reaches the grouped model only, as measured.
    monkeypatch.setattr(mlx_lm_versions, "_installed_has_gqa_defect", lambda: True)
    assert defect_for_model(helium) == GQA_LEFT_PADDING_MASK
    assert defect_for_model(pythia) != GQA_LEFT_PADDING_MASK


def test_a_kv_cache_its_block_never_writes_packs_no_dim():
    """Nemotron-NAS's make_cache gives every block a KVCache; a block without
    attention never writes its own (was a crash sorting None with the dims)."""
    plan = CachePlan((LayerPlan(0, "KVCache", True, 128, 128, 2), LayerPlan(1, "KVCache", True)))
    assert plan.dims == [128] and plan.group_sizes_fit(64) is None and plan.nothing_to_judge() is None
    assert plan.summary() == "Q(2x128), Q(no keys)"


@pytest.mark.parametrize("name, config, said", ids=["mamba", "exaone"], argvalues=[
    ("mamba", MAMBA, "nothing to quantize: every layer keeps recurrent state, no attention keys and values "
                     "(its caches: ArraysCache*2)"),
    ("exaone", EXAONE, "head dim 80 is divisible by none of MLX's quantization group sizes (32, 64, 128)"),
])
def test_a_model_that_leaves_nothing_to_judge_is_one_line_at_every_level(name, config, said, tmp_path, capsys):
    path = written(tmp_path, name, config)
    record = models_record(path, capsys)
    assert record["solo_kv_bits"] == "nothing-to-judge" and record["limit"].startswith(said)
    for args in (["check", "--level", "L2"], ["check", "--level", "L3"],
                 ["run", "--level", "L2", "--out", str(tmp_path / "out")],
                 ["run", "--level", "L4", "--server", DIES, "--out", str(tmp_path / "out")],
                 ["bisect", str(CATALOG / "join-empty.json"), "--level", "L2"]):
        assert main([*args, "--model", path]) == EXIT_CANNOT_JUDGE, args
        out, err = capsys.readouterr()
        assert err.strip().splitlines() == [f"kvparity: cannot judge here: {path}: {record['limit']}"], (args, err)
        # before any work: no schedule ran, no report, no server started (run says its wall time)
        assert all(line.startswith("wall time") for line in out.splitlines()) and not (tmp_path / "out").exists()


@pytest.mark.skipif(mx.metal.is_available(), reason="mlx-lm runs its Metal kernel here")
def test_a_model_mlx_lm_cannot_run_on_this_backend_cannot_be_judged_here(tmp_path, capsys, monkeypatch):
    """Not bad input (its config is mlx-lm's to build): one line, 125; in
    ``models --all`` its row says why and the list goes on."""
    from kvparity.reports.commands import models

    path = written(tmp_path, "bitnet", BITNET)
    said = f"kvparity: cannot judge here: {path}: mlx-lm cannot run this model on this MLX's cpu backend: "
    for args in (["models", path], ["check", "--level", "L2", "--model", path]):
        assert main(args) == EXIT_CANNOT_JUDGE
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(said) and "No Metal back-end" in line and "bitlinear_layers.py" in line
    monkeypatch.setattr(models, "architecture_modules", lambda: ["bitnet", "llama"])
    monkeypatch.setattr(models, "known_configs", lambda: {"bitnet": path, "llama": "llama"})
    assert main(["models", "--all", "--json"]) == EXIT_OK
    records = {r["module"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert records["bitnet"]["solo_kv_bits"] == "cannot-run-here" and "No Metal back-end" in records["bitnet"]["limit"]
    assert records["llama"]["layers"] and records["llama"]["solo_kv_bits"] != "cannot-run-here"  # the list went on


def test_a_model_directory_mlx_lm_cannot_load_is_its_defect_before_a_server_starts(tmp_path, capsys):
    """A server that loads with mlx-lm dies on it (it was this server's FAIL):
    mlx-lm's own loader is run on the directory first, and names the defect."""
    args = ["run", "--level", "L4", "--model", written(tmp_path, "minicpm", MINICPM), "--schedule",
            str(L4_CATALOG / "burst.json"), "--server", DIES, "--out", str(tmp_path / "out")]
    assert main(args) == EXIT_CANNOT_JUDGE
    (report,) = (tmp_path / "out").glob("*/report.json")
    (result,) = json.loads(report.read_text())["results"]
    assert result["verdict"] == "mlx-lm defect" and not result["server"]  # the server (which dies) never started
    assert "(load-raises): mlx_lm.utils.load_model raises ValueError" in result["reason"]
    assert "parameters not in model: lm_head.weight" in result["reason"]


@pytest.mark.slow  # mlx-lm's server started twice per run (alone, together), two runs: about 50 s
def test_a_config_json_is_served_at_l4_from_any_path(tmp_path, monkeypatch, capsys):
    """The twin's model directory is written under the run's --out and
    removed when the run ends (the run is called in process here: not at its
    exit), never at the config's own path; relative and absolute alike."""
    user = tmp_path / "user"
    user.mkdir()
    written(user, "helium", HELIUM)
    monkeypatch.chdir(user)
    for given, out in (("helium.json", "out-relative"), (str(user / "helium.json"), str(tmp_path / "out-absolute"))):
        monkeypatch.setattr(l4_server, "_MODEL_ROOT", None)  # each run in a process of its own, as the command is
        monkeypatch.setattr(l4_server, "_MODEL_DIRS", {})
        args = ["run", "--level", "L4", "--model", given, "--schedule", str(L4_CATALOG / "burst.json"),
                "--server", MLX_LM, "--out", out]
        assert main(args) == EXIT_OK, capsys.readouterr()
        (report,) = Path(out).iterdir()  # the twin's folder is gone with the run
        (result,) = json.loads((report / "report.json").read_text())["results"]
        assert result["verdict"] == "pass" and result["model"] == str(user / "helium.json")
        for log in result["server"]["log_files"]:  # each server's log begins with its command line
            twin = Path(re.search(r"--model (\S+) ", (report / log).read_text().splitlines()[0]).group(1))
            assert twin.parent.parent == Path(out).absolute() and twin.parent.name.startswith(STAGING)
            assert "-l4-models-" in twin.parent.name and twin.name.startswith("helium.json-") and not twin.exists()
    assert sorted(p.name for p in user.iterdir()) == ["helium.json", "out-relative"]

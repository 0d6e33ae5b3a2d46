"""Local model directories: a kvparity model written as one, for servers, and
one read as a model like any other (``--model DIR``).

A server under test (L4) loads a model the way it loads a downloaded one:
``config.json``, ``model.safetensors`` and a tokenizer. The directory holds
the model's own config and parameters as mlx-lm names them (so mlx-lm's
``load`` gives the same bytes back), the quantization of a quantized model,
and, for the random models and the zoo, which have no tokenizer, a
word-level one: token ``i`` is the word ``t{i}``, so a prompt of token ids
is the text ``"t5 t17 t3"`` and the server's tokenizer gives those ids
back. Its chat template joins the messages' contents with spaces, so a
chat request's prompt is known token for token too. The model's own
tokenizer (SmolLM2's) is written as it is, with its chat template.

Reading is mlx-lm's own: ``mlx_lm.utils.load_model`` (config.json, the
``model*.safetensors`` files, weight quantization included) and
``load_tokenizer`` (the model's own tokenizer and chat template), so the
model judged is the one ``mlx_lm.load`` gives a server. What it is keys on
the sha256 of its config.json and of its weight files, never on its path.
"""

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.gguf import sha256_file
from kvparity.oracle.models import LoadedModel, ModelPathError

WEIGHTS = "model.safetensors"
UNKNOWN = "<unk>"
# A chat is its messages' contents, one after another: its tokens are theirs.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"


def word(token: int) -> str:
    return f"t{token}"


def text_of(tokens) -> str:
    """The prompt text whose word-level tokens are ``tokens``."""
    return " ".join(word(int(t)) for t in tokens)


def quantization_of(model: nn.Module) -> Optional[dict]:
    """mlx-lm's ``quantization`` config for a quantized model: the most
    common (group size, bits) and every layer that differs; None when no
    layer is quantized."""
    layers = {name: (m.group_size, m.bits) for name, m in model.named_modules() if hasattr(m, "bits")}
    if not layers:
        return None
    values = list(layers.values())
    group_size, bits = max(set(values), key=values.count)
    config = {"group_size": group_size, "bits": bits}
    config.update({name: {"group_size": g, "bits": b} for name, (g, b) in layers.items() if (g, b) != (group_size, bits)})
    return config


TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}  # a random model's dtype, as torch names it


def word_level_tokenizer(vocab_size: int):
    """A ``tokenizers`` word-level tokenizer of ``vocab_size`` tokens, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def _tokenizer_files(loaded: LoadedModel, directory: Path):
    if loaded.tokenizer is not None:  # SmolLM2: its own (oracle/gguf.py)
        tokenizer, template = loaded.tokenizer.tokenizers_tokenizer, loaded.tokenizer.chat_template
        bos, eos = loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id
        names = {"bos_token": tokenizer.id_to_token(bos) if bos is not None else None,
                 "eos_token": tokenizer.id_to_token(eos) if eos is not None else None}
    else:
        tokenizer, template = word_level_tokenizer(loaded.vocab_size), CHAT_TEMPLATE
        # No token ends a generation: a server stops at max_tokens, as the oracle's solo run does.
        # A pad token all the same: some servers' chat paths refuse a tokenizer without one.
        names = {"bos_token": None, "eos_token": None, "pad_token": word(0)}
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False, **names}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_model_dir(loaded: LoadedModel, directory) -> Path:
    """``loaded`` as a model directory at ``directory`` (new: never
    overwritten), written whole or not at all."""
    directory = Path(directory)
    config = dict(loaded.args)
    quantization = quantization_of(loaded.model)
    if quantization is not None:
        config["quantization"] = quantization
    config["kvparity_model"] = {"name": loaded.name, "sha256": loaded.sha256}
    if config.get("dtype") in TORCH_DTYPES:  # servers that read config.json with torch know only its names
        config["dtype"] = TORCH_DTYPES[config["dtype"]]
    target = AtomicDirectory(directory.parent, directory.name)
    with target as staging:
        weights = dict(tree_flatten(loaded.model.parameters()))
        mx.save_safetensors(str(staging / WEIGHTS), weights, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _tokenizer_files(loaded, staging)
    return target.path


# -- reading a model directory ----------------------------------------------------------

CONFIG = "config.json"
WEIGHT_FILES = "model*.safetensors"  # what mlx_lm.utils.load_model reads


def weight_files(directory: Path) -> List[Path]:
    return sorted(directory.glob(WEIGHT_FILES))


def read_config(directory: Path) -> dict:
    """The directory's config.json, or a clear refusal naming the file."""
    path = directory / CONFIG
    if not path.is_file():
        raise ModelPathError(f"{directory}: not a model directory (no {CONFIG}; expected the layout mlx_lm.load reads)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelPathError(f"{path}: not JSON ({error})")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelPathError(f"{path}: model_type: missing (mlx-lm picks the architecture by it)")
    return config


@dataclass(frozen=True)
class WeightsSize:
    """What a directory's weight files hold, read from their safetensors headers
    before anything is loaded."""

    parameters: int  # a quantized matrix counts its unpacked elements
    bytes: int  # the tensors' bytes, as loaded


SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                     "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def safetensors_header(path: Path) -> Dict[str, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def weights_size(directory: Path, config: dict) -> WeightsSize:
    """Parameters and bytes of the weight files; a packed uint32 matrix with
    scales beside it counts 32 / bits elements per word (bits from the
    config's quantization, per layer where it says)."""
    quantization = config.get("quantization") or {}
    parameters = total = 0
    for path in weight_files(directory):
        header = safetensors_header(path)
        for name, tensor in header.items():
            n = 1
            for d in tensor["shape"]:
                n *= d
            total += n * SAFETENSORS_BYTES.get(tensor["dtype"], 4)
            layer = name.rsplit(".", 1)[0]
            if tensor["dtype"] == "U32" and name.endswith(".weight") and f"{layer}.scales" in header:
                bits = (quantization.get(layer) or {}).get("bits", quantization.get("bits", 4))
                n = n * 32 // bits
            elif name.endswith((".scales", ".biases")) and f"{name.rsplit('.', 1)[0]}.weight" in header:
                n = 0  # the quantization's own, not the model's parameters
            parameters += n
    return WeightsSize(parameters, total)


def weights_sha256(directory: Path) -> str:
    """sha256 over the weight files, each as its name and its bytes' sha256, in name order."""
    h = hashlib.sha256()
    for path in weight_files(directory):
        h.update(f"{path.name}|{sha256_file(path)}|".encode())
    return h.hexdigest()


def read_model_dir(directory: Path):
    """(model, config, tokenizer, source) of a local model directory, loaded by
    mlx-lm's own functions; ``source`` is the path and the sha256 of the
    config and of the weights, which ``sha256`` (the solo-run cache's key)
    is made of."""
    from mlx_lm.utils import load_model, load_tokenizer

    read_config(directory)
    if not weight_files(directory):
        raise ModelPathError(f"{directory}: no weights ({WEIGHT_FILES}; mlx_lm.load reads safetensors)")
    try:
        model, config = load_model(directory)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as error:
        raise ModelPathError(f"{directory}: mlx-lm cannot load it: {type(error).__name__}: {error}")
    try:
        tokenizer = load_tokenizer(directory)
    except Exception as error:  # transformers' own errors: any is the directory's
        raise ModelPathError(f"{directory}: mlx-lm cannot load its tokenizer: {type(error).__name__}: {error}")
    config_sha = sha256_file(directory / CONFIG)
    weights_sha = weights_sha256(directory)
    sha = hashlib.sha256(f"config {config_sha}\nweights {weights_sha}\n".encode()).hexdigest()
    return model, config, tokenizer, {"sha256": sha, "path": directory, "config_sha256": config_sha,
                                      "weights_sha256": weights_sha}

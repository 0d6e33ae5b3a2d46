"""Local model directories: a kvparity model written as one, for servers, and
one read as a model like any other (``--model DIR``).

A server under test (L4) loads a model the way it loads a downloaded one:
``config.json``, ``model.safetensors`` and a tokenizer. The directory holds
the model's own config and parameters as mlx-lm names them (so mlx-lm's
``load`` gives the same bytes back), the quantization of a quantized model,
and, for the random models and the zoo, which have no tokenizer, a
byte-level BPE tokenizer of words: token ``i`` is a space and a word of
letters (``" ab"``), so a prompt of token ids is the text ``" ab dk ja"``
and the server's tokenizer gives those ids back. Byte-level BPE, because
transformers' tokenizer loader builds its own class for some model types
(Qwen2's, Qwen3.5's, GPT-2's) from the file's vocabulary and merges alone:
every such class is byte-level BPE, and the merges that spell each word are
in the file, so each reads the same ids. Its chat template joins the
messages' contents, each after a space, so a chat request's prompt is
known token for token too. The model's own tokenizer (SmolLM2's) is
written as it is, with its chat template.

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
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPACE = "\u0120"  # " " as byte-level BPE spells it (GPT-2's bytes_to_unicode)
# A chat is its messages' contents, each after a space: its tokens are theirs.
CHAT_TEMPLATE = "{% for message in messages %} {{ message['content'] | trim }}{% endfor %}"


def word(token: int, vocab_size: int) -> str:
    """Token ``token``'s word: its number in letters, as long as the largest token's."""
    letters = ""
    for _ in range(word_length(vocab_size)):
        token, digit = divmod(token, len(LETTERS))
        letters = LETTERS[digit] + letters
    return letters


def word_length(vocab_size: int) -> int:
    length = 1
    while len(LETTERS) ** length < vocab_size:
        length += 1
    return length


def text_of(tokens, vocab_size: int) -> str:
    """The prompt text whose tokens are ``tokens``: each a space and its word."""
    return "".join(" " + word(int(t), vocab_size) for t in tokens)


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


def word_tokenizer(vocab_size: int):
    """A ``tokenizers`` byte-level BPE of ``vocab_size`` words (``text_of``).

    Token ``i`` is its word after byte-level BPE's space. Each word is one
    pre-token (a space and letters, under GPT-2's pattern and Qwen's alike),
    which the merges spell from the space on, a letter at a time: only the
    piece that starts at the space ever merges, so no merge order can spell
    it otherwise, and any text of words encodes to exactly their ids. The
    pieces (the letters, the space, a space and fewer letters) get the ids
    after the words': no text of words stops at one, so the model never
    sees them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [SPACE + word(i, vocab_size) for i in range(vocab_size)]
    # Every word is as long as the others: a piece (a space and fewer letters) is never a word.
    merges = list(dict.fromkeys((w[:k], w[k]) for w in words for k in range(1, len(w))))
    pieces = [*LETTERS, *dict.fromkeys(w[:k] for w in words for k in range(1, len(w)))]
    vocab = {piece: i for i, piece in enumerate(words + pieces)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _tokenizer_files(loaded: LoadedModel, directory: Path):
    if loaded.tokenizer is not None:  # SmolLM2: its own (oracle/gguf.py)
        tokenizer, template = loaded.tokenizer.tokenizers_tokenizer, loaded.tokenizer.chat_template
        bos, eos = loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id
        names = {"bos_token": tokenizer.id_to_token(bos) if bos is not None else None,
                 "eos_token": tokenizer.id_to_token(eos) if eos is not None else None}
    else:
        tokenizer, template = word_tokenizer(loaded.vocab_size), CHAT_TEMPLATE
        # No token ends a generation: a server stops at max_tokens, as the oracle's solo run does.
        # A pad token all the same: some servers' chat paths refuse a tokenizer without one.
        names = {"bos_token": None, "eos_token": None, "unk_token": None,
                 "pad_token": SPACE + word(0, loaded.vocab_size)}
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

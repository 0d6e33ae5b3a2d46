"""A kvparity model as a standard local model directory, for servers.

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
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.models import LoadedModel

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

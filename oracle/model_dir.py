"""A kvparity model written as a local model directory, for servers (its
reading, ``--model DIR``, is ``oracle/model_path.py``).

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
written as it is, with its chat template. ``mlx_lm_load_defect`` holds
mlx-lm's own loader to a written directory: where it cannot load one (an
architecture whose sanitize adds a head its tied config has not), no server
that loads with mlx-lm can serve the model judged.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.mlx_lm_versions import NOT_FIXED, MlxLmDefect, mlx_lm_frame
from kvparity.oracle.models import LoadedModel

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


def mlx_lm_load_defect(directory: Path) -> Optional[MlxLmDefect]:
    """What mlx-lm's own ``load_model`` raises on a model directory written
    here, as a defect of mlx-lm's, or None where it loads."""
    from mlx_lm.utils import load_model

    try:
        load_model(Path(directory))
    except Exception as error:  # mlx-lm's own loader, on the config and weights the model has
        said = " ".join(str(error).split())[:300]  # its message's lines as one (it names the parameter on the next)
        return MlxLmDefect(
            name="load-raises", what=f"mlx_lm.utils.load_model raises {type(error).__name__}: {said} on the "
                                     "model's directory (its own config.json and parameters)",
            source=mlx_lm_frame(error) or "mlx_lm/utils.py load_model", fixed_in=NOT_FIXED,
            consequence="a server that loads the model with mlx-lm cannot serve it, so no server can be held to it")
    return None

"""kvparity model-dir: a kvparity model as a directory mlx_lm.load (and so a
server) loads like a downloaded one, with bit-identical logits and a
tokenizer whose ids are known from the text."""

import json

import pytest
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvparity.oracle.model_dir import text_of, word_tokenizer
from kvparity.oracle.models import RANDOM_MODELS, load_model, zoo_models
from kvparity.reports.cli import main
from kvparity.reports.verdicts import EXIT_OK, EXIT_USAGE

PROMPT = [3, 17, 5, 9, 2, 11]


def round_trip(name, tmp_path):
    """(the in-memory model's logits, the directory's, the directory's tokenizer, the prompt as text)."""
    assert main(["model-dir", name, str(tmp_path / name)]) == EXIT_OK
    model, tokenizer = load(str(tmp_path / name))
    loaded = load_model(name)
    x = mx.array([PROMPT])
    return (loaded.model(x, cache=make_prompt_cache(loaded.model)), model(x, cache=make_prompt_cache(model)),
            tokenizer, text_of(PROMPT, loaded.vocab_size))


@pytest.mark.parametrize("name", list(RANDOM_MODELS))
def test_a_random_model_loads_back_bit_for_bit(name, tmp_path, capsys):
    ours, theirs, tokenizer, text = round_trip(name, tmp_path)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and mx.array_equal(ours, theirs).item()
    assert tokenizer.encode(text, add_special_tokens=False) == PROMPT and tokenizer.decode(PROMPT) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}, {"role": "assistant", "content": text},
                                          {"role": "user", "content": text.strip()}], tokenize=True,
                                         add_generation_prompt=True)
    assert list(chat) == PROMPT * 3, "the chat template adds no token: a chat's prompt is known token for token"


@pytest.mark.slow  # every architecture of the zoo, loaded twice
@pytest.mark.parametrize("name", zoo_models())
def test_every_architecture_loads_back_bit_for_bit(name, tmp_path, capsys):
    """Whatever tokenizer class transformers' loader picks for its model_type
    (Qwen2's and Qwen3.5's build their own from the file's vocabulary and
    merges), and whatever its config class validates, the words read back."""
    ours, theirs, tokenizer, text = round_trip(name, tmp_path)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and mx.array_equal(ours, theirs).item()
    assert tokenizer.encode(text, add_special_tokens=False) == PROMPT


def test_every_word_of_a_vocabulary_reads_back_as_itself_in_any_order():
    """The words' tokenizer, as written and as transformers' Qwen2 and Qwen3.5
    classes rebuild it from the file's vocabulary and merges alone: every
    token id, beside others in any order, encodes back to itself; without
    the merges that spell the words it would not."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer, Qwen3_5Tokenizer

    vocab_size = 700  # three letters a word
    written = word_tokenizer(vocab_size)
    spec = json.loads(written.to_str())["model"]
    rebuilt = [cls(vocab=spec["vocab"], merges=[tuple(m) for m in spec["merges"]], unk_token=None, eos_token=None,
                   pad_token=None) for cls in (Qwen2Tokenizer, Qwen3_5Tokenizer)]
    ids = list(range(vocab_size))
    for order in (ids, ids[::-1], ids[::7] + ids[3::5]):
        text = text_of(order, vocab_size)
        assert written.encode(text).ids == order and written.decode(order) == text
        for tokenizer in rebuilt:
            assert tokenizer.encode(text, add_special_tokens=False) == order and tokenizer.decode(order) == text
    unspelled = Tokenizer(BPE(vocab=spec["vocab"], merges=[]))
    unspelled.pre_tokenizer = written.pre_tokenizer
    assert unspelled.encode(text_of(ids, vocab_size)).ids != ids


@pytest.mark.real_model
def test_smollm2_loads_back_with_its_own_tokenizer(tmp_path, capsys):
    ours, theirs, tokenizer, _ = round_trip("smollm2", tmp_path)
    assert ours.dtype == theirs.dtype and mx.array_equal(ours, theirs).item()
    text = "The capital of France is"
    assert tokenizer.encode(text, add_special_tokens=False) == load_model("smollm2").tokenizer.encode(text)


def test_a_bad_name_or_an_existing_directory_is_refused(tmp_path, capsys):
    assert main(["model-dir", "nope", str(tmp_path / "a")]) == EXIT_USAGE
    assert "NAME 'nope': unknown model" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    assert main(["model-dir", "llama-h64-bf16", str(tmp_path / "b")]) == EXIT_USAGE
    assert "exists (never overwritten)" in capsys.readouterr().err

"""L4's reading of a server's answers, with no server running: the answer
and stream shapes of OpenAI-style servers (log-probs by id, by token text, or
only text), a server wanting the legacy logprobs form, rounded log-probs, where
a streamed text first differs, the conversation a turn asks, when a request is
compared with itself alone, and prompts the model's tokenizer does not read back.
(The runs against real servers are ``test_l4.py``.)"""

import json
from dataclasses import replace

import pytest

from kvparity.suites.format.checks import ALONE, LOGPROBS, TEXT
from kvparity.suites.l3.engines import EngineRequest
from kvparity.suites.l4.client import Answer, Dialect, Sent, ask, asked_of, joined, read_answer, read_stream
from kvparity.suites.l4.traffic import conversations, timing_of, unread_prompt
from kvparity.suites.l4.comparisons import diff, precision_of, text_diff, unlike_alone


def test_the_answer_shapes_of_openai_servers():
    mlx_lm = {"choices": [{"logprobs": {"content": [{"id": 3, "logprob": -0.5}, {"id": 9, "logprob": -1.25}]}}],
              "usage": {"prompt_tokens": 4}}
    assert read_answer(mlx_lm) == ([3, 9], [-0.5, -1.25], 4)
    legacy = {"choices": [{"logprobs": {"tokens": ["t3", "t9"], "token_logprobs": [-0.5, -1.25]}}]}
    vocabulary = {"t3": 3, "t9": 9}.get
    assert read_answer(legacy, vocabulary) == ([3, 9], [-0.5, -1.25], None)
    chat = {"choices": [{"logprobs": {"content": [{"token": "t9", "logprob": -1.25, "bytes": [116, 57]}]}}]}
    assert read_answer(chat, vocabulary) == ([9], [-1.25], None)
    with pytest.raises(ValueError, match="no token of the model's vocabulary"):
        read_answer({"choices": [{"logprobs": {"tokens": ["zz"], "token_logprobs": [-0.5]}}]}, vocabulary)
    with pytest.raises(ValueError):
        read_answer({"choices": [{"logprobs": {"tokens": [3, 4], "token_logprobs": [-0.5]}}]})
    with pytest.raises(KeyError):
        read_answer({"choices": [{"text": "no log-probs"}]})


def test_a_server_that_wants_the_legacy_logprobs_form_is_asked_it_once_and_thereafter():
    """OpenAI's legacy completions take logprobs as a count, mlx_lm.server as true:
    a 400 about logprobs switches the form, for this request and the next."""
    import asyncio

    import httpx

    asked = []

    def legacy_server(request):
        body = json.loads(request.content)
        asked.append(body["logprobs"])
        if body["logprobs"] is True:
            return httpx.Response(400, json={"error": "`logprobs` must be an integer 0-5"})
        return httpx.Response(200, json={"choices": [{"logprobs": {"tokens": ["t3"], "token_logprobs": [-0.5]}}],
                                         "usage": {"prompt_tokens": 2}})

    dialect = Dialect({"t3": 3}.get)
    request = EngineRequest("a", (1, 2), arrival=0, max_tokens=1, bits=4, group_size=64, quantized_kv_start=0,
                            prefill_step_size=2048)
    sent = Sent(request, "t1 t2", "completions", 0)

    async def twice():
        async with httpx.AsyncClient(transport=httpx.MockTransport(legacy_server), base_url="http://server") as c:
            return [await ask(c, None, sent, 0.0, dialect) for _ in range(2)]

    answers = asyncio.run(twice())
    assert [(a.tokens, a.logprobs, a.error) for a in answers] == [([3], [-0.5], "")] * 2
    assert asked == [True, 1, 1] and dialect.logprobs == {"completions": 1, "chat": True}


def test_rounded_log_probs_are_detected_and_said():
    exact = [-1.1376628875732422, -2.09375]  # float32 values
    assert precision_of(exact) is None
    assert precision_of([-1.1377, -2.0938]) == 4
    got = Answer([7, 8], [-1.1377, -2.0938], None, 0.0, 1.0)
    found = diff("a", None, [7, 8], exact, got, "against mlx-lm", precision=4)
    assert [(d.check, d.step) for d in found] == [(LOGPROBS, 0), (LOGPROBS, 1)]
    assert "equal once rounded to 4 decimal places" in found[0].detail
    # A token that differs stops the comparison: later tokens follow other text.
    found = diff("a", ALONE, [7, 8], exact, Answer([7, 5], exact, None, 0.0, 1.0), "against itself alone")
    assert [(d.check, d.step, d.expected, d.actual) for d in found] == [(ALONE, 1, 8, 5)]
    assert diff("a", None, [7, 8], exact, Answer([7, 8], list(exact), None, 0.0, 1.0), "") == []


def test_streams_are_read_with_their_log_probs_or_as_text():
    """OpenAI's chunks carry each token's log-prob; mlx_lm.server's carry
    only text, which is then what is compared (read as the stream's text)."""
    def data(chunk):
        return json.dumps(chunk)

    with_logprobs = [data({"choices": [{"delta": {"content": "t3"}, "logprobs": {"content": [
                         {"id": 3, "logprob": -0.5}]}}]}),
                     data({"choices": [{"delta": {"content": " t9"}, "logprobs": {"content": [
                         {"id": 9, "logprob": -1.25}]}}]}),
                     data({"choices": [], "usage": {"prompt_tokens": 4}}), "[DONE]"]
    assert read_stream(with_logprobs) == ([3, 9], [-0.5, -1.25], {"prompt_tokens": 4}, "t3 t9")
    usage = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}
    text_only = [data({"choices": [{"text": "t3 "}]}), data({"choices": [{"text": "t9", "finish_reason": "length"}]}),
                 data({"choices": [], "usage": usage}), "[DONE]"]
    assert read_stream(text_only) == ([], [], usage, "t3 t9")
    with pytest.raises(ValueError, match=r"\[DONE\]"):
        read_stream(text_only[:-1])  # a stream cut short is no answer
    timing = timing_of({"a": Answer([], [], 4, 0.0, 1.0, text="t3", first=0.25)}, 1.0)
    assert timing["time to first token p50 ms"] == 250.0


def test_a_streamed_text_diverges_at_its_first_differing_character_and_token():
    ends = [2, 5, 8]  # "t3 t9 t7": the text's length after each token
    (found,) = text_diff("a", TEXT, "t3 t9 t7", "t3 t8 t7", ends, "against mlx-lm")
    assert (found.check, found.request, found.step, found.expected, found.actual) == (TEXT, "a", 1, "9 t7", "8 t7")
    assert "character 4 (in token 1)" in found.detail
    (short,) = text_diff("a", ALONE, "t3 t9", "t3", None, "alone")
    assert (short.step, short.expected, short.actual) == (None, " t9", "")
    assert text_diff("a", TEXT, "t3", "t3", ends, "") == []


def turn(rid, text, endpoint="completions", continues=None):
    request = EngineRequest(rid, (), arrival=0, max_tokens=2, bits=None, group_size=64, quantized_kv_start=None,
                            prefill_step_size=2048, continues=continues)
    return Sent(request, text, endpoint, 0)


def test_a_turn_asks_its_conversation_so_far_and_is_served_alone_with_it():
    a, a2, b, a3 = turn("a", "t1 t2"), turn("a2", "t5", continues="a"), turn("b", "t7"), turn("a3", "t8", continues="a2")
    answered = Answer([3], [-0.5], 2, 0.0, 1.0, text="t3")
    assert asked_of(a2, [(a, answered)]) == "t1 t2 t3 t5"  # a space where neither text gives one
    assert asked_of(replace(a2, endpoint="chat"), [(a, answered)]) == [
        {"role": "user", "content": "t1 t2"}, {"role": "assistant", "content": "t3"}, {"role": "user", "content": "t5"}]
    assert joined("Hi", " there") == "Hi there" and joined("", "t1") == "t1"
    assert [[s.id for s in chain] for chain in conversations([a, a2, b, a3])] == [["a", "a2", "a3"], ["b"]]


def test_alone_is_compared_only_where_the_server_started_it_from_the_same_prefix():
    """A stored prefix is not bit-identical to a fresh prefill: a turn whose
    conversation started from another user's stored system prompt among the
    others, and fresh alone, is judged on mlx-lm's run, and says why."""
    sent = {s.id: s for s in (turn("a", "t1"), turn("a2", "t5", continues="a"))}

    def answer(cached, asked="t1"):
        return Answer([3], [-0.5], 2, 0.0, 1.0, cached=cached, asked=asked)

    alone = {"a": answer(0), "a2": answer(3, "t1 t3 t5")}
    assert unlike_alone("a2", {"a": answer(0), "a2": answer(3, "t1 t3 t5")}, alone, sent) == ""
    assert "its conversation's turn 'a' took 2 prompt tokens from the server's prompt cache among the others and 0" \
        in unlike_alone("a2", {"a": answer(2), "a2": answer(3, "t1 t3 t5")}, alone, sent)
    assert "asked something else alone" in unlike_alone("a2", {"a": answer(0), "a2": answer(3, "t1 t4 t5")}, alone,
                                                        sent)
    assert unlike_alone("a", {"a": answer(None)}, {"a": answer(None)}, sent) == ""  # a server that does not say


class Words:
    """A tokenizer of the words t0, t1, ... split on spaces, and what it reads back."""

    def __init__(self, encode=None, decode=None):
        self._encode, self._decode = encode, decode

    def encode(self, text, add_special_tokens=True):
        return self._encode(text) if self._encode else [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return self._decode(ids) if self._decode else " ".join(f"t{i}" for i in ids)


def test_a_prompt_the_model_s_tokenizer_does_not_read_back_is_named_with_why():
    a = Sent(EngineRequest("a", (3, 9), arrival=0, max_tokens=1, bits=None, group_size=64, quantized_kv_start=None,
                           prefill_step_size=2048), "t3 t9", "completions", 0)
    assert unread_prompt([a], Words(), 16) == ""
    nothing = unread_prompt([a], Words(encode=lambda text: []), 16)
    assert "request 'a'" in nothing and "'t3 t9'" in nothing and "makes no tokens of it" in nothing
    assert "makes token 9 of it, outside the model's 8" in unread_prompt([a], Words(), 8)
    assert "read back as another text, 't3t9'" in unread_prompt([a], Words(decode=lambda ids: "t3t9"), 16)
    assert "makes no tokens" in unread_prompt([replace(a, request=replace(a.request, prompt=()))], Words(), 16)

"""L4's HTTP client: what a request asks of the server (completion or chat,
whole or streamed) and how its answer is read: tokens, log-probs, text,
cached prompt tokens, when each came."""

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from kvparity.suites.format.arrivals import ENDPOINTS
from kvparity.suites.l3.engines import EngineRequest


REQUEST_TIMEOUT = 300.0  # --request-timeout: seconds one request may take whole, a stream to its end


@dataclass
class Dialect:
    """How a server wants to be asked, learnt as it answers. OpenAI's legacy
    completions take ``logprobs`` as the number of top tokens (0 to 5), its
    chat completions (and mlx_lm.server, on both) as true or false: a server
    that refuses one form is asked the other. ``token_id``: a token's text to
    its id (the server's tokenizer), for answers that give no ids."""

    token_id: Optional[object] = None
    logprobs: Dict[str, object] = field(default_factory=lambda: {endpoint: True for endpoint in ENDPOINTS})

    def refused_logprobs(self, endpoint: str, response) -> bool:
        """Whether the server refused the form asked, which is then switched."""
        if response.status_code != 400 or "logprobs" not in response.text or self.logprobs[endpoint] is not True:
            return False
        self.logprobs[endpoint] = 1
        return True


@dataclass
class Answer:
    """One request's answer, as the server gave it."""

    tokens: List[int]
    logprobs: List[float]
    prompt_tokens: Optional[int]  # usage.prompt_tokens, where given
    sent: float  # seconds after the traffic began
    done: float
    error: str = ""  # an HTTP error, a timeout or an answer of the wrong shape
    text: Optional[str] = None  # the answer's text, where given
    first: Optional[float] = None  # a stream: when its first token arrived
    cached: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens: from the server's prompt cache
    asked: object = None  # the prompt text, or the chat messages, it answers

    @property
    def seconds(self) -> float:
        return self.done - self.sent

    @property
    def text_only(self) -> bool:
        """A stream of text without per-token ids and log-probs (mlx_lm.server's)."""
        return not self.tokens and not self.error and self.text is not None


@dataclass(frozen=True)
class Sent:
    """A request as L4 sends it: its text and endpoint, and the request
    mlx-lm's solo run gets, whose prompt is what the server's tokenizer makes
    of the text, the way the server calls it."""

    request: EngineRequest
    text: str
    endpoint: str
    at_ms: int
    stream: bool = False

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def prompt(self) -> tuple:
        return self.request.prompt

    @property
    def continues(self) -> Optional[str]:
        return self.request.continues


async def served_model(client) -> Optional[str]:
    """The id the server lists first (what its requests name), or None."""
    listed = (await client.get("/v1/models")).json().get("data") or []
    return listed[0].get("id") if listed and isinstance(listed[0], dict) else None


def asked_of(s: Sent, history=()):
    """What a request sends: its text, after the turns of its conversation
    and their answers (a chat's messages, or a completion's running text)."""
    if s.endpoint == "chat":
        messages = []
        for earlier, answer in history:
            messages += [{"role": "user", "content": earlier.text}, {"role": "assistant", "content": answer.text}]
        return messages + [{"role": "user", "content": s.text}]
    text = ""
    for earlier, answer in history:
        text = joined(joined(text, earlier.text), answer.text or "")
    return joined(text, s.text)


def joined(text: str, more: str) -> str:
    """Two texts as one, a space between them where neither gives one."""
    return text + more if not text or not more or text[-1].isspace() or more[0].isspace() else f"{text} {more}"


def prompt_of(asked, tokenizer) -> tuple:
    """The prompt tokens the server's tokenizer makes of what was asked, as the server calls it."""
    if isinstance(asked, list):
        return tuple(int(t) for t in tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=True))
    return tuple(int(t) for t in tokenizer.encode(asked))


async def ask(client, model: Optional[str], s: Sent, began: float, dialect: "Dialect", history=(),
              limit=(REQUEST_TIMEOUT, "--request-timeout")) -> Answer:
    """One request, sent and read whole (a stream to its end) within
    ``limit`` (seconds, and the option that sets them)."""
    import httpx  # loaded by traffic already
    body = {"max_tokens": s.request.max_tokens, "temperature": 0.0, "logprobs": dialect.logprobs[s.endpoint],
            "stream": s.stream}
    if s.stream:
        body["stream_options"] = {"include_usage": True}
    if model:
        body["model"] = model
    asked = asked_of(s, history)
    path = "/v1/chat/completions" if s.endpoint == "chat" else "/v1/completions"
    body["messages" if s.endpoint == "chat" else "prompt"] = asked
    sent = time.perf_counter() - began

    async def exchange():
        answer = await post(client, path, body, s.stream, began)
        if dialect.refused_logprobs(s.endpoint, answer[0]):  # the other form of the same question, once
            body["logprobs"] = dialect.logprobs[s.endpoint]
            answer = await post(client, path, body, s.stream, began)
        return answer

    seconds, option = limit
    try:
        response, events, first = await asyncio.wait_for(exchange(), seconds)
    except httpx.HTTPError as error:
        return Answer([], [], None, sent, time.perf_counter() - began,
                      f"{path}: no answer ({type(error).__name__}: {error})", asked=asked)
    except asyncio.TimeoutError:  # a silent server, or a stream that drips and never ends
        return Answer([], [], None, sent, time.perf_counter() - began,
                      f"{path}: no whole answer within {seconds:g} s ({option})", asked=asked)
    done = time.perf_counter() - began
    if response.status_code != 200:
        return Answer([], [], None, sent, done, f"{path}: HTTP {response.status_code}: {response.text[:300]}",
                      asked=asked)
    try:
        if s.stream:
            tokens, logprobs, usage, text = read_stream(events, dialect.token_id)
        else:
            doc = response.json()
            (tokens, logprobs, _), usage = read_answer(doc, dialect.token_id), doc.get("usage") or {}
            choice = doc["choices"][0]
            text = choice.get("text", (choice.get("message") or {}).get("content"))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        shown = "\n".join(events)[:300] if s.stream else response.text[:300]
        return Answer([], [], None, sent, done, f"{path}: an answer without per-token ids and log-probs "
                                                f"({type(error).__name__}: {error}): {shown}", asked=asked)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return Answer(tokens, logprobs, usage.get("prompt_tokens"), sent, done, text=text, first=first,
                  cached=cached if isinstance(cached, int) else None, asked=asked)


async def post(client, path: str, body: dict, stream: bool, began: float):
    """(the response, a stream's event data in order, when its first event
    came); a whole answer's body is read by the response."""
    if not stream:
        return await client.post(path, json=body), [], None
    events, first = [], None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response, [], None
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                first = time.perf_counter() - began if first is None else first
                events.append(line[len("data:"):].strip())
    return response, events, first


def read_stream(events: List[str], token_id=None):
    """(token ids, log-probs, usage, text) of a stream of OpenAI chunks: ids
    and log-probs where its chunks carry them (mlx_lm.server's carry none)."""
    if not events or events[-1] != "[DONE]":
        raise ValueError("the stream did not end with [DONE]")
    tokens, values, text, usage = [], [], [], {}
    for data in events[:-1]:
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if choice.get("logprobs"):
                more, logprobs, _ = read_answer({"choices": [choice]}, token_id)
                tokens += more
                values += logprobs
    return tokens, values, usage, "".join(text)


def read_answer(doc: dict, token_id=None):
    """(token ids, their log-probs, usage.prompt_tokens) of an OpenAI answer:
    ``logprobs.content`` entries with an ``id`` (mlx_lm.server) or only a
    ``token`` (OpenAI's chat form), or the legacy completions form with
    ``tokens`` and ``token_logprobs``; ``token_id`` maps a token's text to
    its id (the server's tokenizer) where the answer gives no ids."""
    choice = doc["choices"][0]
    logprobs = choice["logprobs"]

    def id_of(entry):
        if isinstance(entry, dict) and "id" in entry:
            return int(entry["id"])
        text = entry["token"] if isinstance(entry, dict) else entry
        if isinstance(text, int):
            return text
        found = token_id(text) if token_id is not None and isinstance(text, str) else None
        if found is None:
            raise ValueError(f"token {text!r} is no token of the model's vocabulary")
        return int(found)

    if "content" in logprobs:
        entries = logprobs["content"]
        tokens, values = [id_of(e) for e in entries], [float(e["logprob"]) for e in entries]
    else:
        tokens, values = [id_of(t) for t in logprobs["tokens"]], [float(v) for v in logprobs["token_logprobs"]]
    if len(tokens) != len(values):
        raise ValueError(f"{len(tokens)} tokens but {len(values)} log-probs")
    return tokens, values, (doc.get("usage") or {}).get("prompt_tokens")

"""L4's traffic: the requests of an arrivals file as the server will be
asked them, sent at their arrival times with at most ``concurrency`` in
flight, a conversation's turn after the turn it continues; the timing of
what came back."""

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from kvparity.suites.format.arrivals import ArrivalSchedule
from kvparity.suites.l3.run import engine_requests
from kvparity.suites.l4.client import REQUEST_TIMEOUT, Answer, Sent, served_model, asked_of, prompt_of, ask


def to_send(schedule: ArrivalSchedule, loaded, tokenizer) -> List[Sent]:
    """Each request's text (its own, or its synthetic tokens as the model's
    text), and the prompt tokens the server's tokenizer makes of it (a turn's
    are known once the turns before it have their answers)."""
    out = []
    for request, spec in zip(engine_requests(schedule, loaded.vocab_size, loaded.tokenizer),
                             schedule.requests.values()):
        text = spec.text if spec.text is not None else tokenizer.decode(list(request.prompt))
        s = Sent(request, text, spec.endpoint, spec.sent_at_ms, spec.stream)
        out.append(s if s.continues else replace(s, request=replace(request, prompt=prompt_of(asked_of(s), tokenizer))))
    return out


def unread_prompt(sent: List[Sent], tokenizer, vocab_size: int) -> str:
    """Why a request's text is not the prompt mlx-lm's run gets ("" where
    every one is): the model's tokenizer makes no tokens of it, tokens outside
    the model's vocabulary, or tokens that read back as another text."""
    for s in sent:
        ids = list(tokenizer.encode(s.text, add_special_tokens=False))
        prompt = list(s.prompt) if not s.continues else ids  # a turn's is known once the turns before it are
        outside = next((t for t in ids + prompt if not 0 <= t < vocab_size), None)
        if not ids or not prompt:
            why = "the model's tokenizer makes no tokens of it"
        elif outside is not None:
            why = f"the model's tokenizer makes token {outside} of it, outside the model's {vocab_size}"
        elif tokenizer.decode(ids) != s.text:
            why = f"its tokens read back as another text, {tokenizer.decode(ids)[:60]!r}"
        else:
            continue
        return f"request {s.id!r}: its prompt is sent as the text {s.text[:60]!r}, and {why}"
    return ""


def token_id_of(tokenizer):
    """A token's text, as an answer without ids gives it, to its id: a
    vocabulary entry as it is (``\u0120ab``), or the text one token encodes
    to (`` ab``, as OpenAI's servers give a byte-level token); else None."""
    vocabulary = tokenizer.get_vocab()

    def token_id(text: str) -> Optional[int]:
        if text in vocabulary:
            return vocabulary[text]
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None
    return token_id


def conversations(sent: List[Sent]) -> List[List[Sent]]:
    """Each first request with the turns that continue it, in order: what is
    served alone together (a turn alone is its conversation alone)."""
    root = {}
    for s in sent:
        root[s.id] = root[s.continues] if s.continues else s.id
    return [[t for t in sent if root[t.id] == s.id] for s in sent if not s.continues]


@dataclass
class Visit:
    """What the servers of one L4 schedule run share: the time its traffic
    ends by (``--run-timeout``), and each server's log as the report
    directory keeps it (file name -> its end), whatever became of the server."""

    schedule: str
    ends: float  # time.monotonic() at the run's deadline
    logs: Dict[str, str] = field(default_factory=dict)

    def log_name(self, which: str) -> str:
        return f"{self.schedule}-{which}.log"

    def limit(self, request_timeout: float):
        """(seconds the next request may take, the option that bounds it)."""
        left = self.ends - time.monotonic()
        if request_timeout <= left:
            return request_timeout, "--request-timeout"
        return max(left, 0.0), "--run-timeout"


async def traffic(url: str, sent: List[Sent], concurrency: int, dialect, visit: Visit,
                  request_timeout: float = REQUEST_TIMEOUT) -> Dict[str, Answer]:
    """Every request at its time, at most ``concurrency`` in flight, each
    whole within ``request_timeout`` seconds and all by ``visit``'s deadline."""
    import httpx  # here, not at the top: every command imports this module, few send traffic

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, limits=limits, trust_env=False) as client:
        model = await served_model(client)
        began = time.perf_counter()

        by_id, turns, history = {s.id: s for s in sent}, {}, {}

        async def one(s: Sent) -> Answer:
            history[s.id], since = [], 0.0
            if s.continues:  # a turn: sent its time after the turn it continues has its answer
                earlier = await turns[s.continues]
                if earlier.error:
                    return Answer([], [], None, earlier.done, earlier.done,
                                  f"not sent: the turn it continues, {s.continues!r}, got no answer")
                history[s.id], since = history[s.continues] + [(by_id[s.continues], earlier)], earlier.done
            due = since + s.at_ms / 1000 - (time.perf_counter() - began)
            await asyncio.sleep(min(max(0.0, due), max(0.0, visit.ends - time.monotonic())))  # the deadline ends it
            async with gate:
                return await ask(client, model, s, began, dialect, history[s.id], visit.limit(request_timeout))

        for s in sent:
            turns[s.id] = asyncio.ensure_future(one(s))
        answers = await asyncio.gather(*turns.values())
    return dict(zip(turns, answers))


def timing_of(answers: Dict[str, Answer], wall: float) -> dict:
    """Throughput and latency, information beside the verdict."""
    seconds = sorted(a.seconds for a in answers.values())
    tokens = sum(len(a.tokens) for a in answers.values())
    timing = {"requests": len(answers), "tokens": tokens, "wall seconds": round(wall, 3),
              "tokens per second": round(tokens / wall, 2) if wall > 0 else None,
              "latency p50 ms": round(1000 * _quantile(seconds, 0.5), 1),
              "latency p95 ms": round(1000 * _quantile(seconds, 0.95), 1)}
    first = sorted(a.first - a.sent for a in answers.values() if a.first is not None)
    if first:  # only a stream shows when its first token came
        timing.update({"time to first token p50 ms": round(1000 * _quantile(first, 0.5), 1),
                       "time to first token p95 ms": round(1000 * _quantile(first, 0.95), 1)})
    return timing


def _quantile(values: List[float], q: float) -> float:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else 0.0

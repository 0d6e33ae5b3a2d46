"""L4's comparisons: each answer served together against the same request
served alone, and against mlx-lm's solo runs (quantized and dense, from
the same stored prefix where the server took one), token by token and
log-prob by log-prob, or by text where a stream carries no log-probs."""

import struct
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import numpy as np
from mlx_lm.models.cache import trim_prompt_cache

from kvparity.oracle.generation import (
    StoredPrefix, cached_generate_alone, generate_alone, generate_from_prefix, matched,
)
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import ScheduleResult
from kvparity.suites.format.checks import ALONE, KV_APPLIED, LENGTH, LOGPROBS, TEXT, TOKENS
from kvparity.suites.format.levels import L4, LEVELS
from kvparity.suites.l3.trail import SERVE_LABEL
from kvparity.suites.l4.client import Answer, Sent
from kvparity.suites.l4.server import ServerUnderTest
from kvparity.suites.l4.server_process import ServerDied, ServerProblem


# A kv_applied finding whose request, served alone, answered as mlx-lm's kv_bits run.
QUANTIZED_ALONE = ("quantized alone, dense when batched with others (served alone it answers as mlx-lm's kv_bits "
                   "run)")


@dataclass
class SoloRuns:
    """mlx-lm's solo runs the answers are compared with. Fresh, where the
    server took no prompt tokens from its prompt cache; else from the entry
    an earlier request's run leaves (its prompt and answer, as mlx-lm's
    server stores a finished request) in mlx-lm's own LRUPromptCache: the one
    that gives the request as many cached tokens as the server says it took.
    That earlier run is itself made as the server made it: from its own entry."""

    loaded: object
    server: ServerUnderTest
    tokenizer: object
    use_cache: bool
    sent: Dict[str, Sent]
    answers: Dict[str, Answer]
    starts: Dict[tuple, tuple] = field(default_factory=dict)
    entries: Dict[tuple, StoredPrefix] = field(default_factory=dict)

    def run(self, rid: str, dense: bool = False):
        """(mlx-lm's run, cut at the end of sequence; where it began), or
        (None, why none is comparable)."""
        request = self.server.oracle(self.sent[rid].request, dense)
        stored, why = self.start(rid, dense)
        if why:
            return None, why
        if stored is None:
            fresh = cached_generate_alone(self.loaded.model, request, self.loaded.sha256, self.use_cache)
            return cut_at_eos(fresh, self.tokenizer), ""
        solo, cached = generate_from_prefix(self.loaded.model, request, request.prompt, stored)
        return cut_at_eos(solo, self.tokenizer), f"from the prompt cache entry of {stored.source!r} ({cached} tokens)"

    def start(self, rid: str, dense: bool):
        """(the entry the request starts from, None: a fresh prefill; why no
        entry gives what the server says, "" where one does)."""
        if (rid, dense) not in self.starts:
            got = self.answers[rid]
            self.starts[rid, dense] = (None, "")
            if got.cached:
                prompt = self.sent[rid].prompt
                # Those that had their answers before it was sent first (stored then), the latest first.
                earlier = sorted((o for o in self.sent if self.answers[o].done < got.done and not self.answers[o].error),
                                 key=lambda o: (self.answers[o].done > got.sent, -self.answers[o].done))
                found = (self.entry(o, dense) for o in earlier if not self.start(o, dense)[1])
                self.starts[rid, dense] = next(((e, "") for e in found if matched(e, prompt) == got.cached), (
                    None, f"the server took {got.cached} prompt tokens from its prompt cache, and no request that "
                          f"finished before it leaves mlx-lm's LRUPromptCache an entry that gives as many"))
        return self.starts[rid, dense]

    def entry(self, rid: str, dense: bool) -> StoredPrefix:
        """What mlx-lm's server stores when a request finishes: its prompt and
        its answer (through the end-of-sequence token), with the cache."""
        if (rid, dense) not in self.entries:
            request = self.server.oracle(self.sent[rid].request, dense)
            stored = self.start(rid, dense)[0]
            solo = generate_alone(self.loaded.model, request) if stored is None else \
                generate_from_prefix(self.loaded.model, request, request.prompt, stored)[0]
            layers = solo.cache
            kept = len(cut_at_eos(solo, self.tokenizer).tokens)
            trim_prompt_cache(layers, len(solo.tokens) - kept)
            self.entries[rid, dense] = StoredPrefix(0, tuple(request.prompt) + tuple(solo.tokens[:kept]), layers,
                                                    rid, 0, "assistant")
        return self.entries[rid, dense]


def cut_at_eos(solo, tokenizer):
    """mlx-lm's run through its first end-of-sequence token, where a server
    stops (mlx_lm.server answers that token too, with its log-prob)."""
    stops = stop_tokens(tokenizer)
    for i, token in enumerate(solo.tokens):
        if token in stops:
            return replace(solo, tokens=solo.tokens[:i + 1], logprobs=solo.logprobs[:i + 1])
    return solo


def stop_tokens(tokenizer) -> set:
    return set(getattr(tokenizer, "eos_token_ids", ()) or ())


def as_answered(solo, got: Answer, tokenizer):
    """mlx-lm's run as the server's answer form gives it: without the stop
    token where the answer leaves it out (OpenAI's servers do), or gives text."""
    if solo.tokens and solo.tokens[-1] in stop_tokens(tokenizer) and (
            got.text_only or len(got.tokens) == len(solo.tokens) - 1):
        return replace(solo, tokens=solo.tokens[:-1], logprobs=solo.logprobs[:-1])
    return solo


def precision_of(values: List[float]) -> Optional[int]:
    """None when every log-prob is a float32 value (compared bit for bit);
    else the decimal places the server rounds to."""
    if all(float(np.float32(v)) == v for v in values):
        return None
    return max(len(repr(v).partition(".")[2]) for v in values)


def same(a: float, b: float) -> bool:
    """Bit for bit, as doubles (a float32 is one exactly)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def in_flight_with(rid: str, answers: Dict[str, Answer]) -> List[str]:
    """The requests whose time at the server overlapped this one's: batched with it, or queued beside it."""
    mine = answers[rid]
    return sorted(o for o, a in answers.items() if o != rid and a.sent < mine.done and mine.sent < a.done)


def compare(result: ScheduleResult, s: Sent, expected, dense, precision, together: Dict[str, Answer],
            alones: Dict[str, Answer], sent: Dict[str, Sent], oracle: str, last_error: str = "", tokenizer=None,
            why_not: str = ""):
    """One request's evidence: (a) against itself alone, (b) against
    mlx-lm's run with the declared settings, (c) against the dense one.
    ``expected`` None: no mlx-lm run is comparable, for ``why_not``."""
    rid = s.id
    got, alone = together[rid], alones[rid]
    text = got.text_only or alone.text_only  # a text carries no tokens or log-probs to count
    beside = in_flight_with(rid, together)
    where = f"in flight with {', '.join(beside)}" if beside else "alone at the server"
    rounded = "" if precision is None else f"the server rounds log-probs to {precision} decimal places"
    row = result.row(rid)
    row.metrics = {"oracle": oracle, "latency ms": round(1000 * got.seconds, 1), "in flight with": len(beside),
                   "prompt tokens from the server's cache": "not said" if got.cached is None else got.cached}
    if not text:
        row.metrics.update({"tokens compared": 0, "log-prob values compared": 0,
                            "log-prob precision": "float32, exact" if precision is None else f"{precision} decimals"})
    for answer, what in ((got, "among the others"), (alone, "alone")):
        if answer.error:
            said = f"; the server's log's last error: {last_error}" if last_error else ""
            result.note(0, TOKENS, [rid], 0, [Divergence(TOKENS, SERVE_LABEL, rid, tensor=TOKENS,
                                                         detail=f"served {what}: {answer.error}{said}")])
            return
    if got.prompt_tokens is not None and got.prompt_tokens != len(s.prompt):
        result.note(0, TOKENS, [rid], 1, [Divergence(
            TOKENS, SERVE_LABEL, rid, tensor="prompt", expected=len(s.prompt), actual=got.prompt_tokens,
            detail="prompt tokens: the server's usage against its tokenizer's tokens of the text")])
        return
    apart = unlike_alone(rid, together, alones, sent)
    # What this row stands on: what its answer's form and the server's prompt cache let be compared.
    checks = (((TEXT,) if text else (TOKENS, LOGPROBS)) if expected is not None else ()) + (() if apart else (ALONE,))
    if why_not:
        row.metrics["mlx-lm's run not compared"] = why_not
    if apart:
        row.metrics["alone not compared"] = apart
    row.requires = () if checks == LEVELS[L4].requires else checks
    expected, dense = (None if run is None else as_answered(run, got, tokenizer) for run in (expected, dense))
    if text:
        compare_text(result, s, got, alone, expected, dense, oracle, where, tokenizer, apart)
        return
    if not apart:
        found = diff(rid, ALONE, alone.tokens, alone.logprobs, got, f"against itself served alone; {where}")
        result.note(0, ALONE, [rid], len(got.tokens), found[:1])
    if expected is None:
        return
    wanted = [float(v[t].item()) for t, v in zip(expected.tokens, expected.logprobs)]
    unsaid = "the server does not say how many prompt tokens its prompt cache gave: from a fresh prefill" \
        if got.cached is None and s.continues else ""
    found = diff(rid, None, expected.tokens, wanted, got, "; ".join(
        p for p in (f"against mlx-lm's solo run ({oracle})", where, rounded, unsaid) if p), precision)
    made = min(len(got.tokens), len(expected.tokens))
    row.metrics["tokens compared"] = row.metrics["log-prob values compared"] = made
    result.note(0, TOKENS, [rid], made, [d for d in found if d.check in (TOKENS, LENGTH)][:1])
    result.note(0, LOGPROBS, [rid], made, [d for d in found if d.check == LOGPROBS][:1])
    if dense is not None:
        dense_values = [float(v[t].item()) for t, v in zip(dense.tokens, dense.logprobs)]
        differs = next((i for i, (a, b, x, y) in enumerate(zip(dense.tokens, expected.tokens, dense_values, wanted))
                        if a != b or not same(x, y)), None)
        if differs is not None:  # else mlx-lm's two runs agree here and cannot tell
            as_dense = got.tokens == dense.tokens and all(same(a, b) for a, b in zip(got.logprobs, dense_values))
            # Served alone as mlx-lm's kv_bits run: it quantizes, but not when it batches.
            alone_quantized = not apart and alone.tokens == expected.tokens and all(
                same(a, b) for a, b in zip(alone.logprobs, wanted))
            result.note(0, KV_APPLIED, [rid], 1, [Divergence(
                KV_APPLIED, SERVE_LABEL, rid, tensor=LOGPROBS,
                detail=f"the server declares {oracle}, but answers as mlx-lm's dense run (no kv_bits), token for "
                       f"token and log-prob for log-prob, where the two differ (first at token {differs}): "
                       + (QUANTIZED_ALONE if alone_quantized else "it did not quantize its KV cache"))]
                if as_dense else [])


def unlike_alone(rid: str, together: Dict[str, Answer], alone: Dict[str, Answer], sent: Dict[str, Sent]) -> str:
    """Why a request's answer among the others cannot be compared with its
    answer alone ("" where it can): asked something else (its conversation's
    earlier answers differed), or it or a turn before it started from another
    prefix of the server's prompt cache (a stored prefix is not bit-identical
    to a fresh prefill, and a turn's stored entry holds its start)."""
    if together[rid].asked != alone[rid].asked:
        return "asked something else alone: the answers of the turns before it differed"
    turn = rid
    while turn:
        got, apart = together[turn].cached, alone[turn].cached
        if got != apart:
            whose = "it" if turn == rid else f"its conversation's turn {turn!r}"
            return (f"{whose} took {got} prompt tokens from the server's prompt cache among the others and "
                    f"{apart} alone (a stored prefix is not bit-identical to a fresh prefill)")
        turn = sent[turn].continues
    return ""


def compare_text(result: ScheduleResult, s: Sent, got: Answer, alone: Answer, expected, dense, oracle: str,
                 where: str, tokenizer, apart: str = ""):
    """A stream of text without per-token log-probs: its text against the
    same request's served alone and against mlx-lm's detokenizer over the
    solo run's tokens, in place of tokens and log-probs (the row says so)."""
    rid = s.id
    mine, theirs = text_of_answer(got, tokenizer), text_of_answer(alone, tokenizer)
    result.row(rid).metrics["text characters compared"] = len(mine)
    want, ends = detokenized(tokenizer, expected.tokens) if expected is not None else (None, None)
    if not apart:
        # Alone, it streams mlx-lm's text where it holds (b): that text's tokens then place a divergence.
        result.note(0, ALONE, [rid], 1, text_diff(rid, ALONE, theirs, mine, ends if theirs == want else None,
                                                  f"streamed text against itself served alone; {where}"))
    if expected is None:
        return
    result.note(0, TEXT, [rid], 1, text_diff(rid, TEXT, want, mine, ends,
                                             f"streamed text against mlx-lm's solo run ({oracle}); {where}"))
    if dense is not None:
        dense_text = detokenized(tokenizer, dense.tokens)[0]
        if dense_text != want:  # else mlx-lm's two runs read the same and cannot tell
            alone_quantized = not apart and theirs == want
            result.note(0, KV_APPLIED, [rid], 1, [Divergence(
                KV_APPLIED, SERVE_LABEL, rid, tensor=TEXT,
                detail=f"the server declares {oracle}, but streams the text of mlx-lm's dense run (no kv_bits), "
                       f"where the two differ: "
                       + (QUANTIZED_ALONE if alone_quantized else "it did not quantize its KV cache"))]
                if mine == dense_text else [])


def text_of_answer(answer: Answer, tokenizer) -> str:
    return answer.text if answer.text is not None else detokenized(tokenizer, answer.tokens)[0]


def detokenized(tokenizer, tokens):
    """mlx-lm's streaming detokenizer over tokens, as a server streams them:
    the text, and how long it is after each token."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    ends = []
    for token in tokens:
        detokenizer.add_token(token)
        ends.append(len(detokenizer.text))
    detokenizer.finalize()
    return detokenizer.text, ends


def text_diff(rid: str, check: str, want: str, got: str, ends: Optional[List[int]], against: str) -> List[Divergence]:
    """The first character where ``got`` leaves ``want``, with the token of
    ``want`` it falls in where ``ends`` are known."""
    if got == want:
        return []
    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    token = None if ends is None else next((i for i, end in enumerate(ends) if end > at), len(ends))
    in_token = "" if token is None else f" (in token {token})"
    return [Divergence(check, SERVE_LABEL, rid, tensor=TEXT, step=token, expected=want[at:at + 40],
                       actual=got[at:at + 40], detail=f"character {at}{in_token}; {against}")]


def diff(rid: str, check: Optional[str], tokens: List[int], values: List[float], got: Answer, against: str,
         precision: Optional[int] = None) -> List[Divergence]:
    """The first differences of ``got`` from (tokens, values), in order:
    a log-prob at a position, then a token (after which the texts differ)."""
    found = []
    for i, want in enumerate(tokens):
        if i >= len(got.tokens):
            found.append(Divergence(check or LENGTH, SERVE_LABEL, rid, tensor=TOKENS, step=i, expected=len(tokens),
                                    actual=len(got.tokens), detail=f"token {i} never came; {against}"))
            break
        if i < len(values) and not same(values[i], got.logprobs[i]):
            hint = ""
            if precision is not None and round(values[i], precision) == got.logprobs[i]:
                hint = f"; equal once rounded to {precision} decimal places"
            found.append(Divergence(check or LOGPROBS, SERVE_LABEL, rid, tensor=LOGPROBS, step=i,
                                    expected=values[i], actual=got.logprobs[i],
                                    detail=f"log-prob of token {i}; {against}{hint}"))
        if got.tokens[i] != want:
            found.append(Divergence(check or TOKENS, SERVE_LABEL, rid, tensor=TOKENS, step=i, expected=want,
                                    actual=got.tokens[i], detail=f"token {i}; {against}"))
            break
    else:
        if len(got.tokens) > len(tokens):
            found.append(Divergence(check or LENGTH, SERVE_LABEL, rid, tensor=TOKENS, step=len(tokens),
                                    expected=len(tokens), actual=len(got.tokens),
                                    detail=f"more tokens than asked for; {against}"))
    return found


def _kind(problem: ServerProblem) -> str:
    return "died" if isinstance(problem, ServerDied) else "answered garbage"

"""L4, a real server over HTTP: what a team ships, judged from outside.

The server under test serves a kvparity model written as a model directory
(``oracle/model_dir.py``). An arrivals file's requests are sent to it by an
asynchronous HTTP client at their ``arrival_ms`` (or ``arrival`` steps of
``STEP_MS``), at most ``concurrency`` in flight, greedy, with ``logprobs``,
to ``/v1/completions`` or ``/v1/chat/completions``, whole or streamed as
server-sent events. Each request's tokens and log-probs are compared with

(a) the same request served alone by a fresh instance of the same server
    (check ``alone``): a server's prompt cache would make a repeated prompt
    something else than alone;
(b) mlx-lm's solo ``generate_step`` with the KV settings the server declares
    to kvparity (none: dense), on the prompt tokens the server's own
    tokenizer makes of the text (checks ``tokens``, ``logprobs``, ``length``);
(c) where it declares quantized KV, mlx-lm's dense solo run (``kv_applied``):
    answers that equal the dense run and not the quantized one, where those
    differ, mean the server did not quantize.

Log-probs are compared bit for bit: a JSON number of a float32 is exact. A
server that rounds them is detected (its values are not float32 values) and
the precision it gives is said with each divergence, never hidden. A stream
that carries no per-token log-probs (mlx_lm.server's) is judged on its text
(check ``text``): (a) the text served alone, (b) the text mlx-lm's own
detokenizer makes of the solo run's tokens; the row says so.

A turn of a conversation is sent after the answer of the turn it continues,
asking the conversation so far. A server's prompt cache serves it (and a
prompt sharing a system prompt) from a stored prefix: where the server says
how many prompt tokens it took (``cached_tokens``), (b) and (c) start from
the same stored prefix in mlx-lm's own LRUPromptCache (``SoloRuns``), and
(a) is compared only where alone took the same (``unlike_alone``).

A server that dies or answers garbage is its FAIL, with its log's end; one
that never becomes ready cannot be judged here (``ServerNeverReady`` goes up
to the command); a bad command template is a usage error.
"""

import asyncio
import json
import math
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.utils import load_tokenizer

from kvparity.oracle.atomic import OUTPUT_ROOT, STAGING, make_folder
from kvparity.oracle.generation import (
    StoredPrefix, cached_generate_alone, generate_alone, generate_from_prefix, matched, semantics,
)
from kvparity.oracle.model_dir import mlx_lm_load_defect, write_model_dir
from kvparity.oracle.models import load_model
from kvparity.oracle.plan import solo_kv_bits_limit
from kvparity.suites.format.arrivals import ENDPOINTS, ArrivalSchedule, check_fits
from kvparity.suites.format.checks import ALONE, KV_APPLIED, LENGTH, LOGPROBS, RAISED, TEXT, TOKENS
from kvparity.suites.core.compare import Divergence
from kvparity.suites.l3.engines import EngineRequest
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, NOT_SUPPORTED, ScheduleResult
from kvparity.suites.l3.run import SERVE, SERVE_LABEL, engine_requests
from kvparity.suites.format.levels import L4, LEVELS
from kvparity.suites.core.processes import stopping_on_signals
from kvparity.suites.l4.server_process import (
    SERVER_LOGS, AttachedServer, LaunchedServer, ServerDied, ServerGarbage, ServerProblem,
)

FIRST = "first"  # --quantized-kv-start first: quantized from the first token
REQUEST_TIMEOUT = 300.0  # --request-timeout: seconds one request may take whole, a stream to its end
RUN_TIMEOUT = 1800.0  # --run-timeout: seconds an L4 schedule run's servers and requests may take together
LOG_LINES = 200  # how much of the server's log report.json keeps
LOG_BYTES = 2**20  # how much of each server's log the report directory keeps (its end), in SERVER_LOGS
SERVER = "the server"  # what failed at L4, where L1 to L3 name a protocol member
# A kv_applied finding whose request, served alone, answered as mlx-lm's kv_bits run.
QUANTIZED_ALONE = ("quantized alone, dense when batched with others (served alone it answers as mlx-lm's kv_bits "
                   "run)")


@dataclass(frozen=True)
class ServerUnderTest:
    """The server as the command line gives it, with what it declares."""

    command: Optional[str] = None  # a template with {model} and {port}
    url: Optional[str] = None  # a loopback server the user runs
    kv_bits: Optional[int] = None  # None: a dense server
    kv_group_size: int = 64
    # mlx-lm's kv_bits conversion from this token (a dense prefill converted
    # after it), or None: quantized from the first token (QuantizedKVCache
    # from the start, as BatchGenerator(kv_bits) and most batched servers do).
    quantized_kv_start: Optional[int] = 0
    prefill_step_size: int = 2048  # mlx_lm.server's default
    concurrency: int = 8
    ready_timeout: float = 300.0
    request_timeout: float = REQUEST_TIMEOUT
    run_timeout: float = RUN_TIMEOUT
    # Words that turn the server's prompt cache off, added to its command
    # (mlx_lm.server: --prompt-cache-size 0): every request's alone answer then
    # comes from one server; "": from a fresh server per conversation.
    prompt_cache_off: str = ""
    models_under: Path = OUTPUT_ROOT  # where kvparity writes a model directory it serves: the run's --out

    @property
    def name(self) -> str:
        start = "the first token" if self.quantized_kv_start is None else f"token {self.quantized_kv_start}"
        kv = f" (kv_bits {self.kv_bits}, group {self.kv_group_size}, from {start})" if self.kv_bits else " (dense)"
        return (self.command or self.url) + kv

    def options(self) -> List[str]:
        """What it declares, as kvparity's command line says it (a finding's reproduction)."""
        kv = ["--kv-bits", str(self.kv_bits), "--kv-group-size", str(self.kv_group_size),
              "--quantized-kv-start", FIRST if self.quantized_kv_start is None else str(self.quantized_kv_start)] \
            if self.kv_bits is not None else []
        off = ["--prompt-cache-off", self.prompt_cache_off] if self.prompt_cache_off else []
        return kv + ["--prefill-step-size", str(self.prefill_step_size), "--concurrency", str(self.concurrency)] + off

    @property
    def alone_from(self) -> str:
        """Where each request's alone answer comes from (``serve_alone``)."""
        if self.url:
            return "the server at --url, one request at a time"
        if self.prompt_cache_off:
            return f"one fresh server with its prompt cache off ({self.prompt_cache_off}), one request at a time"
        return "a fresh server per conversation"

    def unfit(self, plan) -> Optional[str]:
        """Why the declared KV settings cannot be the model's (a group size
        that does not divide a quantized layer's dims), or None."""
        unfit = plan.group_sizes_fit(self.kv_group_size) if self.kv_bits is not None else None
        return unfit and f"the server declares --kv-group-size {self.kv_group_size}: {unfit}"

    def limit(self, loaded):
        """mlx-lm's limit that keeps its own solo run under the declared
        settings from existing on this model (what the answers are judged
        against), or None; a dense run always exists."""
        if self.kv_bits is None:
            return None
        return solo_kv_bits_limit(loaded.model, loaded.plan, self.kv_bits, self.kv_group_size)

    def record(self, log: str, **timing) -> dict:
        """What a report keeps of it (``ScheduleResult.server``): a finding's reproduction reads it."""
        return {"command": self.command or "", "url": self.url or "", "declares": self.options(), "log": log,
                **timing}

    def oracle(self, request, dense: bool = False):
        """The request as mlx-lm's solo run gets it under the declared settings."""
        quantized = self.kv_bits is not None and not dense
        return replace(request, bits=self.kv_bits if quantized else None, group_size=self.kv_group_size,
                       quantized_kv_start=self.quantized_kv_start if quantized else None,
                       prefill_step_size=self.prefill_step_size)


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


_MODEL_DIRS: Dict[str, Path] = {}
_MODEL_ROOT: Optional[tempfile.TemporaryDirectory] = None


def model_dir(loaded, under: Path) -> Path:
    """The model as a directory a server loads: the one it was loaded from,
    else written once per run into a folder of kvparity's own output
    (``under``, the run's --out), removed when the run ends
    (``release_model_dirs``) or else with the process; named by the
    model's file name and hash, never at a path the user gave (the
    config.json a twin is made from)."""
    global _MODEL_ROOT
    if loaded.directory is not None:
        return loaded.directory
    if loaded.sha256 not in _MODEL_DIRS:
        # A staging name (oracle/atomic.py): what a killed run leaves, a later writer there removes.
        _MODEL_ROOT = _MODEL_ROOT or tempfile.TemporaryDirectory(prefix=f"{STAGING}{os.getpid()}-l4-models-",
                                                                 dir=make_folder(under).absolute())
        name = f"{Path(loaded.name).name}-{loaded.sha256[:12]}"
        _MODEL_DIRS[loaded.sha256] = write_model_dir(loaded, Path(_MODEL_ROOT.name) / name)
    return _MODEL_DIRS[loaded.sha256]


def release_model_dirs():
    """Remove the model directories written for this run's servers: a run
    leaves under its --out only its report, also when called in process."""
    global _MODEL_ROOT
    if _MODEL_ROOT is not None:
        _MODEL_ROOT.cleanup()
    _MODEL_ROOT = None
    _MODEL_DIRS.clear()
    load_defect.cache_clear()  # keyed by a directory that is gone


@lru_cache(maxsize=None)
def load_defect(directory: Path):
    """mlx-lm's own loader on a model directory kvparity wrote, once a process (``mlx_lm_load_defect``)."""
    return mlx_lm_load_defect(directory)


def run_l4(schedule: ArrivalSchedule, server: ServerUnderTest, model_name: Optional[str] = None,
           use_cache: bool = True) -> ScheduleResult:
    loaded = load_model(model_name or schedule.model)
    result = ScheduleResult(schedule.name, L4, server.name, [SERVE], path=schedule.path, model=loaded.name,
                            model_sha256=loaded.sha256, model_source=loaded.source())
    for rid in schedule.requests:
        result.row(rid)
    start = time.perf_counter()
    unfit = check_fits(schedule, loaded.plan, loaded.vocab_size, loaded.tokenizer is not None,
                       group_sizes=False) or server.unfit(loaded.plan)
    if unfit:
        result.stop(NOT_SUPPORTED, unfit)
        return result
    limit = server.limit(loaded)
    if limit is not None:
        result.stop(MLX_LM_DEFECT, limit.attribution())
        return result
    directory = model_dir(loaded, server.models_under)
    unloadable = loaded.directory is None and load_defect(directory)  # a user's own directory loaded already
    if unloadable:
        result.stop(MLX_LM_DEFECT, unloadable.attribution())
        return result
    tokenizer = load_tokenizer(directory)  # the tokenizer the server loads, from the same files
    sent = to_send(schedule, loaded, tokenizer)
    unread = unread_prompt(sent, tokenizer, loaded.vocab_size)
    if unread:
        result.stop(NOT_SUPPORTED, f"{L4} {schedule.name} on {loaded.name}: {unread}")
        return result
    everyone = [s.id for s in sent]
    visit = Visit(schedule.name, time.monotonic() + server.run_timeout)
    try:
        dialect = Dialect(token_id_of(tokenizer))  # learnt alone, used together
        alone = serve_alone(server, directory, sent, dialect, visit)
        together = serve(server, directory, sent, server.concurrency, dialect, visit, "together", keep_log=True)
    except (ServerDied, ServerGarbage) as problem:
        said = f"the server {_kind(problem)}: {problem}"
        result.raised_by = SERVER
        result.server = {**server.record(problem.log_tail), "logs": visit.logs}
        result.stop(FAIL, f"{L4} {schedule.name}: {said}")
        result.note(0, RAISED, everyone, 0, [Divergence(RAISED, SERVE_LABEL, detail=said)])
        return result
    started = [served.load_seconds for served in alone + [together] if served.load_seconds is not None]
    result.server = {**server.record(together.log, **together.timing, **{
        "server starts": len(started), "load seconds": round(sum(started), 3), "alone from": server.alone_from}),
        "logs": visit.logs}
    log, together = together.log, together.answers
    alone = {rid: answer for served in alone for rid, answer in served.answers.items()}
    last_error = next((line.strip() for line in reversed(log.splitlines()) if "error" in line.lower()), "")
    precision = precision_of([v for a in together.values() for v in a.logprobs])
    # A turn's prompt is what the server's tokenizer makes of what it was asked (its conversation so far).
    sent = [replace(s, request=replace(s.request, prompt=prompt_of(together[s.id].asked, tokenizer)))
            if s.continues and together[s.id].asked is not None else s for s in sent]
    solo = SoloRuns(loaded, server, tokenizer, use_cache, {s.id: s for s in sent}, together)
    for s in sent:
        expected, began = solo.run(s.id)
        dense = solo.run(s.id, dense=True)[0] if server.kv_bits is not None and expected else None
        oracle = semantics(server.oracle(s.request)) + (f", {began}" if began and expected else "")
        compare(result, s, expected, dense, precision, together, alone, solo.sent, oracle, last_error, tokenizer,
                why_not=began if not expected else "")
    result.seconds = time.perf_counter() - start
    return result


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


@dataclass
class Served:
    """What one server (or the attached one) answered."""

    answers: Dict[str, Answer]
    log: str  # its log's end, where asked for
    timing: dict  # throughput and latency
    load_seconds: Optional[float]  # how long a started server took to answer; None: the one the user runs


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


def serve_alone(server: ServerUnderTest, directory: Path, sent: List[Sent], dialect, visit: Visit) -> List[Served]:
    """Each request served alone: sent one at a time, a conversation's turns
    in order, to one fresh server with its prompt cache off where the server
    declares how (``prompt_cache_off``), else each conversation to a fresh
    server of its own: a prompt cache would serve a request from another
    request's stored prefix, which is not bit-identical to a fresh prefill."""
    if server.prompt_cache_off or server.url:
        return [serve(server, directory, sent, 1, dialect, visit, "alone", prompt_cache=False)]
    return [serve(server, directory, chain, 1, dialect, visit, f"alone-{k}")
            for k, chain in enumerate(conversations(sent), 1)]


def serve(server: ServerUnderTest, directory: Path, sent: List[Sent], concurrency: int, dialect, visit: Visit,
          which: str, keep_log: bool = False, prompt_cache: bool = True) -> Served:
    """The requests sent to a fresh server (or the attached one), its prompt
    cache turned off where ``prompt_cache`` is false and the server declares
    how; its log kept in ``visit`` as ``which``'s, its problems pointing there.
    Past the run's deadline no server starts: each request is an error."""
    if visit.limit(server.request_timeout)[0] <= 0:
        late = f"not sent: the L4 run's deadline of {server.run_timeout:g} s (--run-timeout) had passed"
        return Served({s.id: Answer([], [], None, 0.0, 0.0, late) for s in sent}, "", timing_of({}, 0.0), None)
    with tempfile.TemporaryDirectory(prefix="kvparity-l4-") as scratch:
        log = Path(scratch) / "server.log"
        if server.url:
            running = AttachedServer(server.url)
        else:
            env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(Path(scratch) / "hub"))
            (Path(scratch) / "hub").mkdir()
            command = server.command if prompt_cache else f"{server.command} {server.prompt_cache_off}"
            running = LaunchedServer(command, directory, log, ready_timeout=server.ready_timeout, env=env,
                                     shown_log=f"{SERVER_LOGS}/{visit.log_name(which)} in the report directory")
        asked = time.perf_counter()
        try:
            with stopping_on_signals(), running:  # SIGTERM and SIGHUP leave through the with, as Ctrl-C does
                began = time.perf_counter()
                answers = asyncio.run(traffic(running.url, sent, concurrency, dialect, visit, server.request_timeout))
                wall = time.perf_counter() - began
                running.check_alive()
                tail = running.log_tail(LOG_LINES) if keep_log else ""
        finally:  # stopped, or never ready: its last words are in
            if log.exists():
                visit.logs[visit.log_name(which)] = log_end(log)
    return Served(answers, tail, timing_of(answers, wall), None if server.url else round(began - asked, 3))


def log_end(path: Path) -> str:
    """The last ``LOG_BYTES`` of a log, as text."""
    with open(path, "rb") as log:
        log.seek(max(log.seek(0, os.SEEK_END) - LOG_BYTES, 0))
        return log.read().decode("utf-8", "replace")


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

"""L4's server under test: its command and what it declares, the model
directory it loads, serving every request alone or together (a fresh
server for each, or one with its prompt cache off), and its log's end."""

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional

from kvparity.oracle.atomic import OUTPUT_ROOT, STAGING, make_folder
from kvparity.oracle.model_dir import mlx_lm_load_defect, write_model_dir
from kvparity.oracle.plan import solo_kv_bits_limit
from kvparity.suites.core.processes import stopping_on_signals
from kvparity.suites.l4.client import REQUEST_TIMEOUT, Answer, Sent
from kvparity.suites.l4.server_process import SERVER_LOGS, AttachedServer, LaunchedServer
from kvparity.suites.l4.traffic import conversations, Visit, traffic, timing_of


FIRST = "first"  # --quantized-kv-start first: quantized from the first token
RUN_TIMEOUT = 1800.0  # --run-timeout: seconds an L4 schedule run's servers and requests may take together
LOG_LINES = 200  # how much of the server's log report.json keeps
LOG_BYTES = 2**20  # how much of each server's log the report directory keeps (its end), in SERVER_LOGS


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


@dataclass
class Served:
    """What one server (or the attached one) answered."""

    answers: Dict[str, Answer]
    log: str  # its log's end, where asked for
    timing: dict  # throughput and latency
    load_seconds: Optional[float]  # how long a started server took to answer; None: the one the user runs


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

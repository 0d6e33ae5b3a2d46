"""A cache in another process, driven as a Python class.

``--impl 'exec:COMMAND'`` names a program (COMMAND is split into words as a
POSIX shell splits them; no shell runs) that speaks the process protocol on
its standard input and output: a hello, then one answer per request
(docs/protocol.md, "Caches in other languages"; the frame is
``suites/core/process_frame.py``). ``process_batch_class`` makes a real class
whose members each send one request, so that every command and every level
(a model's forward, mlx-lm's ``BatchGenerator``) drives it as any class, and
the adapter's watching wraps its members as any class's. Batches live in the
process, named by the handles it gives; solo rows live here and cross as
tensors.

What the process does wrong is the member's failure, raised from the member
that was running, with the end of what the process wrote on stderr:
exiting or dying (``ProcessDied``), no answer within ``--member-timeout``
(``MemberHung``; the process is killed), anything on stdout that is not the
answer (``ProcessGarbage``; the process is killed). A batch of a process
that ended raises ``ProcessDied`` from each member; the next ``merge``
starts the process again. Each Python process starts its own (a forked
worker never speaks on its parent's pipes). No cache process outlives
kvparity: it dies with the process that started it (``die_with_parent``),
is stopped at exit, and the isolated parent sweeps what is left.
"""

import atexit
import builtins
import os
import shlex
import subprocess
import tempfile
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache

from kvparity.suites.core.flight import FLIGHT, MEMBER_TIMEOUT_S, MemberHung, ProcessDied
from kvparity.suites.core.process_frame import (
    PROTOCOL, FrameGarbage, FrameReader, FrameTimeout, encode, write_all,
)
from kvparity.oracle.signals import signal_name
from kvparity.suites.core.processes import die_with_parent

EXEC = "exec:"  # the --impl prefix of a command
# The ops that only read a batch. Between two requests of any other op, the
# answer to each read of a batch is kept and given again: at L1 the checks
# read the same batch several times after every member call (about a third of
# all reads repeat one), and a read that changes the cache is no read.
READS = frozenset(("size", "offset", "left_padding", "state", "nbytes", "bits", "group_size", "empty"))
TRIPLE = ("packed", "scales", "biases")
STDERR_KEPT = 2000  # characters of the process's stderr a failure quotes
EXIT_GRACE_S = 2.0  # how long a process that closed its pipes has to exit before it is killed
# The proxy stops waiting this much before --member-timeout runs out (a
# quarter of it at most), so that its failure, with the process's stderr,
# comes before the isolated parent, which looks every 0.1 s, kills the
# process running the schedules.
WATCH_MARGIN_S = 1.0


class ProcessGarbage(Exception):
    """The cache process wrote on stdout what is not the answer asked for."""


def command_of(spec: str) -> List[str]:
    """``exec:COMMAND`` -> its words; ValueError for an empty or unbalanced one."""
    words = shlex.split(spec[len(EXEC):])
    if not words:
        raise ValueError("no command after 'exec:'")
    return words


class Deadline:
    """When a member call's wait for the process ends: one for all a member
    call sends (a process started again and its hello, batches freed, the
    request), as the parent's watch times the call whole. ``timeout``: the
    run's member timeout, as failures say it."""

    def __init__(self):
        self.timeout = FLIGHT.timeout if FLIGHT.timeout else MEMBER_TIMEOUT_S
        self.at = time.monotonic() + self.timeout - min(WATCH_MARGIN_S, self.timeout / 4)


_REMOTE_ERRORS: Dict[str, type] = {}


def remote_error(kind: str, message: str) -> Exception:
    """The exception a member raised in the process, by its type's name:
    Python's own where the name is one (``ValueError``,
    ``NotImplementedError``), else a class of that name."""
    found = getattr(builtins, kind, None)
    if not (isinstance(found, type) and issubclass(found, Exception)):
        if not kind.isidentifier():
            kind = "RemoteError"
        found = _REMOTE_ERRORS.setdefault(kind, type(kind, (RuntimeError,), {"__module__": "cache process"}))
    return found(message)


class CacheProcess:
    """One running cache process, its pipes, and its stderr (kept in a file)."""

    def __init__(self, argv: List[str], after_failing=None):
        self.argv, self.after_failing = argv, after_failing
        self.hello: Optional[dict] = None  # read by the first member call, within its deadline
        self.stderr = tempfile.TemporaryFile()
        self.ended: Optional[str] = None  # how it ended, once it did
        self.freed: List[int] = []  # handles of batches Python dropped, sent before the next request
        self.read: Dict[Tuple[int, str], tuple] = {}  # (batch, read op) -> its answer, since the last change
        self.last_id = 0
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                      preexec_fn=die_with_parent, start_new_session=True)
        os.set_blocking(self.popen.stdin.fileno(), False)
        self.reader = FrameReader(self.popen.stdout.fileno())
        self.owner = os.getpid()
        _STARTED.append(self)

    # -- failures ---------------------------------------------------------------------

    def stderr_tail(self) -> str:
        self.stderr.flush()
        size = self.stderr.seek(0, os.SEEK_END)
        self.stderr.seek(max(0, size - STDERR_KEPT))
        text = self.stderr.read().decode(errors="replace").strip()
        if not text:
            return "; it wrote nothing on stderr"
        return f"; its stderr {'ended' if size > STDERR_KEPT else 'was'}: {text!r}"

    def _fail(self, error: Exception, ended: str):
        """The process is done for: kill what is left of it, and raise
        ``error`` (its message, with stderr) from the member running."""
        self.ended = ended
        self.stop(grace=0)
        said = f"{error}{self.stderr_tail()}"
        self.stderr.close()  # a campaign may start the command again many times
        if self.after_failing is not None:
            self.after_failing()
        raise type(error)(said)

    def _exited(self, during: str, deadline: Deadline):
        """Its pipes closed: how it ended, within ``EXIT_GRACE_S`` (and the member call's deadline)."""
        try:
            status = self.popen.wait(timeout=max(0.05, min(EXIT_GRACE_S, deadline.at - time.monotonic())))
        except subprocess.TimeoutExpired:
            self._fail(ProcessDied(f"the cache process closed its stdout {during}"), f"closed its stdout {during}")
        how = f"exited with status {status}" if status >= 0 else f"died of {signal_name(status)}"
        self._fail(ProcessDied(f"the cache process {how} {during}"), f"{how} {during}")

    # -- messages ------------------------------------------------------------------------

    def _read(self, member: Optional[str], deadline: Deadline):
        """The next frame, the answer to ``member`` (None: the hello)."""
        during = f"during {member}" if member else "before its hello"
        try:
            return self.reader.read(deadline.at)
        except EOFError:
            self._exited(during, deadline)
        except FrameTimeout:
            asked = f"did not answer {member}" if member else "gave no hello"
            self._fail(MemberHung(f"the cache process {asked} within {deadline.timeout:g} s (--member-timeout); "
                                  "it was stopped"), f"hung {during}")
        except FrameGarbage as garbage:
            self._fail(ProcessGarbage(f"garbage on stdout {'after ' + member if member else during}: "
                                      f"{garbage.reason}: {garbage.seen!r}"), f"wrote garbage {during}")

    def greet(self, deadline: Deadline) -> dict:
        """Its hello, read once."""
        if self.hello is None:
            self.hello = self._hello(deadline)
        return self.hello

    def _hello(self, deadline: Deadline) -> dict:
        header, _ = self._read(None, deadline)
        result = header.get("result")
        if header.get("id") != 0 or header.get("ok") is not True or not isinstance(result, dict):
            self._fail(ProcessGarbage(f"garbage on stdout before its hello: a first message that is not a hello "
                                      f"(id 0, ok, result): {str(header)[:200]}"), "gave no hello")
        if result.get("protocol") != PROTOCOL:
            self._fail(ProcessGarbage(f"the cache process speaks protocol {result.get('protocol')!r}, "
                                      f"kvparity speaks {PROTOCOL}"), "speaks another protocol")
        return result

    def call(self, op: str, args: dict, tensors: Sequence[Tuple[str, mx.array]] = (), member: str = None,
             deadline: Deadline = None):
        """Send one request and wait for its answer: (result, tensors by name).
        What the process raised is raised here, as the type it named."""
        member, deadline = member or op, deadline or Deadline()
        if self.ended is not None:
            raise ProcessDied(f"the cache process is gone (it {self.ended}), so {member} cannot run")
        self.greet(deadline)
        if self.freed:
            freed, self.freed = self.freed, []
            try:
                self._exchange("free", {"batches": freed}, (), f"free (sent before {member})", deadline)
            except (ProcessDied, ProcessGarbage):
                raise
            except Exception as error:  # the process's own answer: say which request it answered
                raise type(error)(f"free of batches {freed}, sent before {member}, raised: {error}") from error
        if op not in READS:
            self.read.clear()
            return self._exchange(op, args, tensors, member, deadline)
        key = (args.get("batch"), op)
        if key not in self.read:
            self.read[key] = self._exchange(op, args, tensors, member, deadline)
        return self.read[key]

    def _exchange(self, op, args, tensors, member, deadline: Deadline):
        self.last_id += 1
        asked = self.last_id
        frame = encode({"id": asked, "op": op, "args": args}, tensors)
        during = f"during {member}"
        try:
            write_all(self.popen.stdin.fileno(), frame, deadline.at)
        except (BrokenPipeError, ConnectionResetError):
            self._exited(during, deadline)
        except FrameTimeout:
            self._fail(MemberHung(f"the cache process did not read {member}'s request within {deadline.timeout:g} s "
                                  "(--member-timeout); it was stopped"), f"hung {during}")
        header, found = self._read(member, deadline)
        extra = self.reader.extra()
        if extra:
            self._fail(ProcessGarbage(f"garbage on stdout after {member}: bytes after its answer: {extra!r}"),
                       f"wrote garbage {during}")
        if header.get("id") != asked:
            self._fail(ProcessGarbage(f"garbage on stdout after {member}: the answer to request {asked} came "
                                      f"with id {header.get('id')!r}"), f"wrote garbage {during}")
        if header.get("ok") is True and isinstance(header.get("result", {}), dict):
            return header.get("result", {}), found
        error = header.get("error")
        if header.get("ok") is False and isinstance(error, dict) and isinstance(error.get("type"), str):
            raise remote_error(error["type"], str(error.get("message", "")))
        self._fail(ProcessGarbage(f"garbage on stdout after {member}: an answer neither ok with a result nor "
                                  f"an error with a type: {str(header)[:200]}"), f"wrote garbage {during}")

    # -- stopping -------------------------------------------------------------------------

    def stop(self, grace: float = EXIT_GRACE_S):
        """Close its stdin (its cue to exit), then kill it if it is still
        there after ``grace`` seconds."""
        if self.ended is None:
            self.ended = "was stopped by kvparity"
        for pipe in (self.popen.stdin, self.popen.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


_STARTED: List[CacheProcess] = []  # the cache processes started, stopped at exit by the process that started each


@atexit.register
def _stop_started():
    for process in _STARTED:
        if process.owner == os.getpid() and process.popen.poll() is None:  # a forked child's parent's are not its own
            process.stop()


class Processes:
    """The cache process of one ``exec:`` implementation in this Python
    process: the running one, or a new one where none runs (a forked child
    starts its own). One that failed is started again at once, so that it
    starts while kvparity goes on (the next merge reads its hello): a start
    counts in no member call's time but the one that finds it not ready."""

    def __init__(self, argv: List[str]):
        self.argv = argv
        self.process: Optional[CacheProcess] = None
        self.pid = None

    def current(self) -> CacheProcess:
        if self.process is None or self.pid != os.getpid() or self.process.ended is not None:
            self.process, self.pid = None, os.getpid()
            self.process = CacheProcess(self.argv, self._again)
        return self.process

    def _again(self):
        if self.pid == os.getpid():
            try:
                self.process = CacheProcess(self.argv, self._again)
            except OSError:  # the next merge tries again, and says why
                self.process = None

    def stop(self):
        if self.process is not None and self.pid == os.getpid():
            self.process.stop()


# -- tensors of the protocol's objects ----------------------------------------------------


def triple_tensors(prefix: str, triple) -> List[Tuple[str, mx.array]]:
    return [(f"{prefix}.{part}", x) for part, x in zip(TRIPLE, triple)]


def triple_of(found: Dict[str, mx.array], prefix: str, member: str):
    missing = [f"{prefix}.{part}" for part in TRIPLE if f"{prefix}.{part}" not in found]
    if missing:
        raise ProcessGarbage(f"the answer to {member} lacks the tensor {missing[0]}")
    return tuple(found[f"{prefix}.{part}"] for part in TRIPLE)


def field_of(result: dict, name: str, member: str, kinds=(int,)):
    value = result.get(name)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProcessGarbage(f"the answer to {member} lacks {name} (got {value!r})")
    return value


def row_message(i: int, row) -> Tuple[dict, List[Tuple[str, mx.array]]]:
    """A solo row as merge sends it: its fields, and its arrays as they are held."""
    filled = row.keys is not None
    quantized = hasattr(row, "bits")
    fields = {"offset": int(row.offset), "bits": row.bits if quantized else None,
              "group_size": row.group_size if quantized else None, "filled": filled}
    tensors = []
    if filled and quantized:
        tensors = triple_tensors(f"rows.{i}.keys", row.keys) + triple_tensors(f"rows.{i}.values", row.values)
    elif filled:
        tensors = [(f"rows.{i}.keys", row.keys), (f"rows.{i}.values", row.values)]
    return fields, tensors


def per_row(result: dict, found: Dict[str, mx.array], name: str, member: str):
    """``offset`` or ``left_padding`` as the process gave it: a tensor, or an integer."""
    if name in found:
        return found[name]
    return field_of(result, name, member)


class ProcessBatch(_BaseCache):
    """A batch of the cache process: mlx-lm's batch cache protocol over
    quantized triples, each member one request. A class per implementation
    derives from it (``process_batch_class``); ``rollback`` is there only
    where the process's hello offers per-row rollback."""

    _processes: Processes = None
    hello: Optional[dict] = None

    def _attach(self, process: CacheProcess, handle: int):
        self._process, self._handle = process, handle
        weakref.finalize(self, process.freed.append, handle)

    def _call(self, op: str, member: str = None, tensors=(), **args):
        return self._process.call(op, {"batch": self._handle, **args}, tensors, member or op)

    @classmethod
    def merge(cls, caches):
        deadline = Deadline()
        process = cls._processes.current()
        rows, tensors = [], []
        for i, row in enumerate(caches):
            fields, arrays = row_message(i, row)
            rows.append(fields)
            tensors += arrays
        result, _ = process.call("merge", {"rows": rows}, tensors, "merge", deadline)
        batch = cls.__new__(cls)
        batch._attach(process, field_of(result, "batch", "merge"))
        return batch

    def __deepcopy__(self, memo):
        """An independent copy, made in the process (mlx-lm's
        ``BatchGenerator`` deep-copies its batches' caches when it splits a
        batch); not a protocol member, so not counted."""
        result, _ = self._call("copy", "copy (a deep copy)")
        batch = type(self).__new__(type(self))
        batch._attach(self._process, field_of(result, "batch", "copy"))
        return batch

    def extend(self, other):
        if not isinstance(other, ProcessBatch) or getattr(other, "_process", None) is not self._process:
            raise TypeError(f"extend with a {type(other).__name__}: only a batch of the same cache process "
                            "can cross to it")
        self._call("extend", other=other._handle)

    def filter(self, batch_indices):
        self._call("filter", indices=[int(i) for i in batch_indices])

    def extract(self, idx):
        result, found = self._call("extract", index=int(idx))
        row = QuantizedKVCache(group_size=field_of(result, "group_size", "extract"),
                               bits=field_of(result, "bits", "extract"))
        row.offset = field_of(result, "offset", "extract")
        if field_of(result, "filled", "extract", (bool,)):
            row.keys, row.values = triple_of(found, "keys", "extract"), triple_of(found, "values", "extract")
        return row

    def update_and_fetch(self, keys, values):
        _, found = self._call("update_and_fetch", tensors=[("keys", keys), ("values", values)])
        return triple_of(found, "keys", "update_and_fetch"), triple_of(found, "values", "update_and_fetch")

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        result, found = self._call("make_mask", N=int(N), return_array=bool(return_array), window_size=window_size)
        kind = result.get("mask")
        if kind == "array" and "mask" in found:
            return found["mask"]
        if kind is None or kind == "causal":
            return kind
        raise ProcessGarbage(f"the answer to make_mask has mask {kind!r}: expected null, 'causal' or 'array' "
                             "with a tensor mask")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return field_of(self._call("trim", n=int(n))[0], "trimmed", "trim")

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        def listed(values):
            return None if values is None else [int(v) for v in values]

        self._call("prepare", left_padding=listed(left_padding), lengths=listed(lengths),
                   right_padding=listed(right_padding))

    def finalize(self):
        self._call("finalize")

    def size(self) -> int:
        return field_of(self._call("size")[0], "size", "size")

    def empty(self) -> bool:
        return field_of(self._call("empty")[0], "empty", "empty", (bool,))

    @property
    def offset(self):
        return per_row(*self._call("offset"), "offset", "offset")

    @property
    def left_padding(self):
        return per_row(*self._call("left_padding"), "left_padding", "left_padding")

    @property
    def state(self):
        """The key triple and the value triple (None and None before a write)."""
        result, found = self._call("state")
        if not field_of(result, "filled", "state", (bool,)):
            return None, None
        return triple_of(found, "keys", "state"), triple_of(found, "values", "state")

    @property
    def nbytes(self) -> int:
        return field_of(self._call("nbytes")[0], "nbytes", "nbytes")

    @property
    def bits(self) -> int:
        return field_of(self._call("bits")[0], "bits", "bits")

    @property
    def group_size(self) -> int:
        return field_of(self._call("group_size")[0], "group_size", "group_size")


def rollback(self, amounts):
    """Per-row rollback, where the process offers it."""
    self._call("rollback", amounts=[int(a) for a in amounts])


def process_batch_class(spec: str) -> type:
    """The proxy class of ``exec:COMMAND``. Its first process starts now,
    for the capabilities its hello names; a process that gives no hello is
    not an error here: each ``merge`` starts it again and fails, naming how."""
    processes = Processes(command_of(spec))
    try:
        hello = processes.current().greet(Deadline())
    except (ProcessDied, ProcessGarbage):
        hello = None
    namespace = {"_processes": processes, "hello": hello, "__module__": __name__,
                 "__doc__": f"The cache of the process {spec[len(EXEC):]!r}."}
    if hello and "per_row_rollback" in (hello.get("capabilities") or ()):
        namespace["rollback"] = rollback
    return type("ProcessBatch", (ProcessBatch,), namespace)

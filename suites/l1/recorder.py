"""The conformance vectors' format (its words, the manifest's names) and
its recorder: a schedule run through the one L1 replay on the reference,
each protocol call written with what the replay handed the cache and what
must hold after it, the rows' bytes as spans over mlx-lm's tapes."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np

from kvparity.oracle import tensor_file
from kvparity.suites.core.adapter import REFERENCE, Implementation, detect_capabilities, load_implementation
from kvparity.suites.core.members import WRITE
from kvparity.suites.core.compare import TRIPLE
from kvparity.suites.l1.run import L1Run
from kvparity.suites.l1.masks import MASK_WIDTHS, expected_mask


FORMAT = "kvparity-vectors"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The protocol calls a schedule makes on a batch, in the order it makes them (the checks' reads are not calls).
RECORDED = ("merge", "extend", "filter", "extract", "trim", "rollback", WRITE, "prepare", "finalize")
PARTS = tuple(f"{name}.{part}" for name in ("keys", "values") for part in TRIPLE)
# What a batch call leaves, for the rows' columns: "aligned" rows own [left_padding, size());
# "prefill" (a padded prefill before finalize) rows own [left_padding, left_padding + length), the padding
# merge gave them; "none" (prepare) nothing yet.
ALIGNED, PREFILL, NONE = "aligned", "prefill", "none"
LAYOUTS = (ALIGNED, PREFILL, NONE)
WHOLE, SELECTED = "whole", "selected"  # the manifest's catalog: every L1 schedule, or those --schedule named


class VectorsError(Exception):
    """The vectors cannot be made or read: the message names the file and why."""


# -- recording the calls -----------------------------------------------------------------


class _Log:
    """The protocol calls made on a recording class, outermost only (a member
    calling another is one call), as (member, self or class, args, kwargs, result)."""

    def __init__(self):
        self.calls: list = []
        self.depth = 0


def recording(base: type, log: _Log) -> type:
    """A subclass of ``base`` noting each recorded call with its arguments (the
    export drives the reference, a class of our own, so a subclass may stand in)."""

    def wrap(name, fn):
        def member(first, *args, **kwargs):
            self_depth = log.depth
            log.depth += 1
            try:
                out = fn(first, *args, **kwargs)
            finally:
                log.depth -= 1
            if not self_depth:
                log.calls.append((name, first, args, kwargs, out))
            return out
        member.__name__ = name
        return member

    attributes = {}
    for name in RECORDED:
        attr = base.__dict__.get(name) or next(k.__dict__[name] for k in base.__mro__ if name in k.__dict__)
        attributes[name] = classmethod(wrap(name, attr.__func__)) if isinstance(attr, classmethod) else wrap(name, attr)
    return type(base.__name__, (base,), attributes)


# -- tapes: every token's bytes, as mlx-lm holds them -----------------------------------


class Tapes:
    """Per (layer, stream, part): the bytes of each token of the stream, filled
    from mlx-lm's rows; a token seen again must hold the same bytes."""

    def __init__(self):
        self.parts: Dict[tuple, np.ndarray] = {}  # (layer, stream, part) -> [H, tokens, width]
        self.filled: Dict[tuple, np.ndarray] = {}  # (layer, stream, part) -> bool per token
        self.codes: Dict[str, str] = {}  # part -> safetensors dtype
        self.seen: set = set()  # (state key, layer) already compared

    def note(self, key, layer: int, cache, tokens: List[tuple], where: str):
        """mlx-lm's row ``cache`` (holding ``tokens``, (stream, index) each) into
        the tapes; raises VectorsError where a token's bytes differ from before."""
        if (key, layer) in self.seen or not tokens:
            return
        if cache.offset != len(tokens):
            raise VectorsError(f"{where}: mlx-lm's row holds {cache.offset} tokens, the replay says {len(tokens)}")
        for name in ("keys", "values"):
            for part, x in zip(TRIPLE, getattr(cache, name)):
                code, bits = tensor_file.bits_of(x[0, :, : cache.offset, :])
                self.codes[f"{name}.{part}"] = code
                self._take(layer, f"{name}.{part}", bits, tokens, where)
        self.seen.add((key, layer))

    def _take(self, layer, part, bits, tokens, where):
        for stream, start, stop, column in token_spans(tokens, with_columns=True):
            tape = self._tape(layer, stream, part, stop, bits)
            filled = self.filled[(layer, stream, part)]
            piece = bits[:, column : column + stop - start, :]
            known = filled[start:stop]
            if not np.array_equal(tape[:, start:stop][:, known], piece[:, known]):
                raise VectorsError(f"{where}: mlx-lm's bytes of {part} for tokens {stream}[{start}:{stop}] differ "
                                   "from the same tokens in another of its rows")
            tape[:, start:stop] = piece
        for stream, start, stop in token_spans(tokens):
            self.filled[(layer, stream, part)][start:stop] = True

    def _tape(self, layer, stream, part, stop, like) -> np.ndarray:
        key = (layer, stream, part)
        tape = self.parts.get(key)
        if tape is None or tape.shape[1] < stop:
            grown = np.zeros((like.shape[0], max(stop, 2 * (0 if tape is None else tape.shape[1])), like.shape[2]),
                             like.dtype)
            if tape is not None:
                grown[:, : tape.shape[1]] = tape
            self.parts[key] = tape = grown
        filled = self.filled.get(key)
        if filled is None or len(filled) < tape.shape[1]:
            grown = np.zeros(tape.shape[1], bool)
            if filled is not None:
                grown[: len(filled)] = filled
            self.filled[key] = grown
        return tape

    def tensors(self) -> Dict[str, tuple]:
        """Each tape cut to its last token seen: ``tape/L{layer}/{stream}/{part}``."""
        out = {}
        for (layer, stream, part), tape in self.parts.items():
            filled = self.filled[(layer, stream, part)]
            length = int(np.nonzero(filled)[0].max()) + 1 if filled.any() else 0
            out[f"tape/L{layer}/{stream}/{part}"] = (self.codes[part], tape[:, :length])
        return out


def token_spans(tokens: List[tuple], with_columns: bool = False) -> List[list]:
    """(stream, index) tokens as [stream, start, stop] runs (and the column each starts at)."""
    spans, column = [], 0
    for stream, index in tokens:
        last = spans[-1] if spans else None
        if last is not None and last[0] == stream and last[2] == index:
            last[2] += 1
        else:
            spans.append([stream, index, index + 1] + ([column] if with_columns else []))
        column += 1
    return spans


# -- one schedule run ----------------------------------------------------------------------


@dataclass
class Recorded:
    """One schedule's vectors: the cases document and its tensors."""

    name: str
    cases: dict
    tensors: Dict[str, tuple] = field(default_factory=dict)


class Recorder:
    """Records an ``L1Run`` of the reference: its calls (``on_call``) and the
    state after each event (``check``)."""

    def __init__(self, run: L1Run, log: _Log):
        self.run, self.log = run, log
        self.tapes = Tapes()
        self.calls: List[dict] = []
        self.events: List[dict] = []
        self.tensors: Dict[str, tuple] = {}
        self.batches: Dict[int, int] = {}  # id(batch) -> its handle
        self.alive: list = []  # the batches handed out, so that an id is never reused
        self.stored: List[int] = []  # the extract calls whose rows went into a store
        self.first_call = 0
        self.after, self.checked = run.calls.after, run.check
        run.replay.on_call, run.check = self.on_call, self.on_event

    # -- the oracle's rows ---------------------------------------------------------

    def row(self, rid: str, layer: int) -> dict:
        """``rid`` alone in mlx-lm's caches now, in ``layer``: its length and tokens (spans over the tapes)."""
        state = self.run.solo.states[rid]
        cache, tokens = state.solo.layers[layer], self.run.replay.held[rid]
        where = f"schedule {self.run.schedule.name!r}, event {self.run.replay.event.label}, request {rid!r}"
        if not hasattr(cache, "bits"):
            raise VectorsError(f"{where}: mlx-lm's row is not quantized where the batch holds it")
        self.tapes.note(state.key, layer, cache, tokens, where)
        return {"request": rid, "length": cache.offset, "tokens": token_spans(tokens)}

    def merged(self, rids: List[str], layer: int, prefill: bool, sources) -> List[dict]:
        """The rows merge was handed: in a padded prefill, each the stored
        prefix it starts from (``sources``, as batched_join_stored hands
        them) or no tokens; else each row alone now."""
        if not prefill:
            return [self.row(rid, layer) for rid in rids]
        lengths = [source.offset for source in sources] if sources else [0] * len(rids)
        return [{"request": rid, "length": n, "tokens": token_spans(self.run.replay.held[rid][:n])}
                for rid, n in zip(rids, lengths)]

    def layout(self, rows: List[dict], how: str) -> dict:
        lengths = [r["length"] for r in rows]
        out = {"layout": how, "rows": rows}
        if how == ALIGNED:
            size = max(lengths, default=0)
            out.update(size=size, left_padding=[size - n for n in lengths])
        return out

    def handle(self, batch) -> int:
        if id(batch) not in self.batches:
            self.batches[id(batch)] = len(self.batches)
            self.alive.append(batch)
        return self.batches[id(batch)]

    # -- hooks on the run ------------------------------------------------------------

    def on_call(self, member: str, layer: int, batch, rows: List[str], **what):
        self.after(member, layer, batch, rows, **what)  # the run's own evidence first: it brings the oracle up
        name, _, args, kwargs, _ = self.log.calls[-1]
        self.log.calls.clear()
        if name != member:
            raise VectorsError(f"the replay reported {member}, the last call made was {name}")
        k, event = len(self.calls), self.run.replay.event
        record = {"call": k, "event": event.index, "layer": layer, "member": member,
                  "batch": self.handle(batch)}
        prefill = bool(what.get("prefill"))
        if member == "merge":
            record["args"] = {"rows": self.merged(rows, layer, prefill, what.get("sources"))}
        elif member == "extend":
            record["args"] = {"other": self.handle(args[0])}
        elif member == "filter":
            record["args"] = {"indices": [int(i) for i in args[0]]}
        elif member == "extract":
            record["args"] = {"index": int(args[0])}
        elif member == "trim":
            record["args"] = {"n": int(args[0])}
        elif member == "rollback":
            record["args"] = {"amounts": [int(n) for n in args[0]]}
        elif member == WRITE:
            record["args"] = {"keys": f"call/{k}/keys", "values": f"call/{k}/values"}
            for part, x in zip(("keys", "values"), args):
                self.tensors[f"call/{k}/{part}"] = tensor_file.bits_of(x)
        elif member == "prepare":
            record["args"] = {key: [int(n) for n in value] for key, value in kwargs.items()}
        else:
            record["args"] = {}
        if member == "extract":
            expected = self.row(what["row"], layer)
            record["expected"] = {"extracted": expected}
            if event.kind == "store":
                self.stored.append(k)
        elif member == "prepare":
            record["expected"] = self.layout([], NONE)
        else:
            how = PREFILL if prefill and member == WRITE else ALIGNED
            solo = record["args"]["rows"] if member == "merge" else [self.row(rid, layer) for rid in rows]
            record["expected"] = self.layout(solo, how)
            if how == PREFILL:  # each row after the padding its merge gave it
                merged = next(r for r in reversed(self.calls) if r["batch"] == record["batch"] and r["member"] == "merge")
                record["expected"]["left_padding"] = merged["expected"]["left_padding"]
        self.calls.append(record)

    def on_event(self, event):
        self.checked(event)  # the run's checks: the reference must pass them
        replay, index = self.run.replay, event.index
        layers = []
        for layer, batch in enumerate(replay.layers or ()):
            state = self.layout([self.row(rid, layer) for rid in replay.rows], ALIGNED)
            masks = {}
            for n in MASK_WIDTHS:
                name = f"event/{index}/L{layer}/mask{n}"
                masks[str(n)] = name
                self.tensors[name] = ("BOOL", expected_mask(state["left_padding"], state["size"], n))  # the L1 check's
            layers.append({"layer": layer, "batch": self.handle(batch), **state, "masks": masks})
        self.events.append({"event": index, "label": event.label, "kind": event.kind,
                            "calls": [self.first_call, len(self.calls)], "layers": layers,
                            "stored": list(self.stored)})
        self.first_call = len(self.calls)


def record_schedule(schedule, reference: Implementation = None) -> Recorded:
    """One L1 schedule's vectors, from a passing run of the reference."""
    base = (reference or load_implementation(REFERENCE)).batch_class
    log = _Log()
    cls = recording(base, log)
    implementation = Implementation(f"{REFERENCE} (recording)", cls, detect_capabilities(cls))
    run = L1Run(schedule, implementation)
    recorder = Recorder(run, log)
    run.advance(schedule.events)
    result = run.finish()
    failed = [d for row in result.rows for d in row.divergences]
    if result.stopped or failed:
        why = result.reason or str(failed[0])
        raise VectorsError(f"{schedule.path or schedule.name}: the reference cache does not pass it "
                           f"({result.stopped or 'FAIL'}: {why}); no vectors are written from a run that fails")
    shapes = [{"kv_heads": s.kv_heads, "key_dim": s.key_dim, "value_dim": s.value_dim} for s in schedule.shapes]
    cases = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "schedule": schedule.name,
        "source": Path(schedule.path).name if schedule.path else None,
        "bits": schedule.bits, "group_size": schedule.group_size, "dtype": schedule.dtype, "layers": shapes,
        "mask_widths": list(MASK_WIDTHS), "parts": list(PARTS), "tensors": f"{schedule.name}.safetensors",
        "calls": recorder.calls, "events": recorder.events, "document": schedule.to_json(),
    }
    return Recorded(schedule.name, cases, {**recorder.tapes.tensors(), **recorder.tensors})

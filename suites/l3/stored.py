"""L3's stored prompt caches: what the engine's prompt store holds and
gives back against mlx-lm's own store holding mlx-lm's own rows, and a
request resumed from an entry against mlx-lm's solo run from it."""

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

from kvparity.oracle.generation import SoloGeneration, StoredPrefix, cached_generate_alone, generate_from_prefix
from kvparity.suites.format.checks import EXTRACT
from kvparity.suites.core.compare import Divergence, compare_named
from kvparity.suites.l3.engines import EngineRequest, EngineRun
from kvparity.suites.core.evidence import ScheduleResult

from kvparity.suites.l3.trail import SERVE_LABEL, EXTRACT_MEMBER, output_diverged_by, tokens_of


def solo_from_entry(result: ScheduleResult, loaded, request: EngineRequest, entry, use) -> Optional[SoloGeneration]:
    """The request alone from the entry the engine started it from; None (and
    a divergence noted) when mlx-lm's QuantizedKVCache cannot hold that entry."""
    if entry.layers is None:
        result.note(0, EXTRACT, [request.id], 0, [Divergence(
            EXTRACT, SERVE_LABEL, request.id, detail=f"{entry.describe()}, which {request.id!r} started from, "
                                                     f"is no solo QuantizedKVCache: {entry.unusable}")])
        return None
    solo, cached = generate_from_prefix(loaded.model, request, request.prompt, entry)
    if cached != use.cached:  # one entry, one trie: mlx-lm picks the same prefix
        raise RuntimeError(f"request {request.id!r}: the engine took {use.cached} prompt tokens from "
                           f"{entry.describe()}, the oracle {cached}")
    return solo


def check_stored(result: ScheduleResult, loaded, requests: List[EngineRequest], run: EngineRun,
                 made: Callable[[StoredPrefix], Tuple[str, ...]], use_cache: bool,
                 ran: Optional[Dict[str, SoloGeneration]] = None) -> List[StoredPrefix]:
    """Each entry the engine stored, as ``extract`` returned it, against
    mlx-lm's own cache of its request generated alone (from the entry that
    request started from, as the oracle starts it), on the tokens it is
    stored under: its offset is their count, its bits and group size the
    request's, and every quantized layer's bytes on them mlx-lm's. What the
    engine and the oracle later start from is that entry, so a wrong row
    would be judged against itself; here it is a divergence before anything
    that consumed it, carrying the members that can have made it wrong
    (``made(entry)``: those that reshaped the batch until it was stored, and
    ``extract``), which join it to the group of the one among them at
    fault, as a request's wrong token joins. Unless the request's own output
    diverged before the entry was stored: that output is then the first
    divergence. Entries of a request that started from a wrong one are not
    checked again: their first divergence is that entry's. ``ran``: the solo
    generations the requests' outputs were compared with, whose caches are
    those (a request not among them is generated, or read from the solo-run
    cache, here). Returns the entries that diverged."""
    asked, wrong = {r.id: r for r in requests}, []
    alone = {rid: solo.cache for rid, solo in (ran or {}).items()}
    for number in sorted(run.stored):
        entry = run.stored[number]
        source = asked.get(entry.source)
        use = run.prefixes.get(entry.source)
        started_wrong = use is not None and any(w.number == use.entry for w in wrong)
        if entry.layers is None or source is None or started_wrong:  # unusable: said where a request starts from it
            continue
        if entry.source not in alone:
            alone[entry.source] = mlx_lm_cache_alone(loaded, source, run, use_cache)
        found, compared = entry_divergences(entry, alone[entry.source], loaded.plan)
        if found:
            wrong.append(entry)
            if output_diverged_by(result, run, entry.source, entry.step):  # its first divergence is that output's
                continue
            members = tuple(made(entry))
            found = [replace(d, reshaped=members + (EXTRACT_MEMBER,) * (EXTRACT_MEMBER not in members))
                     for d in found]
        result.note(0, EXTRACT, [entry.source], compared, found)
    return wrong


def mlx_lm_cache_alone(loaded, request: EngineRequest, run: EngineRun, use_cache: bool) -> list:
    """mlx-lm's prompt cache of ``request`` generated alone to its end (a
    next turn with the prompt the engine served it, from the entry it
    started from): every token it holds, as mlx-lm computes it. From nothing,
    it is the cache the solo run its tokens are compared with ended with (one
    oracle cache entry); from an entry, computed here, as that solo run is."""
    prompt = run.prompts.get(request.id, request.prompt)
    request = replace(request, prompt=tuple(prompt), continues=None)
    use = run.prefixes.get(request.id)
    if use is None:
        return cached_generate_alone(loaded.model, request, loaded.sha256, use_cache).cache
    return generate_from_prefix(loaded.model, request, prompt, run.stored[use.entry])[0].cache


def entry_divergences(entry: StoredPrefix, alone: list, plan) -> Tuple[List[Divergence], int]:
    """(divergences, comparisons) of a stored entry's quantized layers
    against mlx-lm's cache ``alone`` on the entry's tokens."""
    n, found, compared = len(entry.tokens), [], 0
    where = dict(request=entry.source, detail=f"{entry.describe()}, as extract returned it, against mlx-lm's "
                                              "cache of that request alone")
    for planned, stored, solo in zip(plan.layers, entry.layers, alone):
        if not planned.quantized:
            continue
        compared += 1
        layer, name = planned.index, f"stored entry #{entry.number}"
        described, asked = (stored.offset, stored.bits, stored.group_size), (n, solo.bits, solo.group_size)
        if described != asked:
            found += [Divergence(EXTRACT, SERVE_LABEL, tensor=f"{name}: {what}", layer=layer, expected=e, actual=a,
                                 **where)
                      for what, e, a in zip(("offset", "bits", "group_size"), asked, described) if e != a]
            continue
        found += [replace(d, check=EXTRACT, detail=where["detail"]) for d in compare_named(
            tokens_of(solo, n), tokens_of(stored, n), f"{name}: ", event=SERVE_LABEL, request=entry.source,
            layer=layer)]
    return found, compared

"""A campaign's supervisor (``run_campaign``): starts the workers, collects
their counts and findings, replaces a worker that died (its crash is the
implementation's finding) and stops them all on a signal."""

import json
import multiprocessing
import queue as queues
import time
from typing import Callable, Optional, Tuple
from kvparity.oracle.signals import signal_name
from kvparity.suites.core.flight import SCHEDULE_FILE, Watch, ended, how_it_ended, read_flight
from kvparity.suites.core.processes import STOP_GRACE_S, died_of_a_crash, oom_kills, stop_signal

from kvparity.suites.search.campaign import LEVELS, CampaignError, Campaign, Tally, Found, CampaignResult
from kvparity.suites.search.workers import worker_folder, work


# How long a worker may take to import and load before the campaign starts.
START_TIMEOUT_S = 300


def run_campaign(campaign: Campaign, on_progress: Optional[Callable] = None,
                 progress_s: float = 5.0) -> CampaignResult:
    """Run the campaign's workers to the end; ``on_progress(result)`` every
    ``progress_s`` seconds and once at the end. The first failure found
    stops the other workers after their current round; a stop signal
    (Ctrl-C, SIGTERM, SIGHUP) stops them at once, and the result so far is
    returned, ``interrupted``."""
    if campaign.level not in LEVELS:
        raise ValueError(f"level {campaign.level!r}: one of {', '.join(LEVELS)}")
    context = multiprocessing.get_context("spawn")  # MLX in a forked child is not safe
    messages, ready, go, stop = context.Queue(), context.Queue(), context.Event(), context.Event()
    workers = campaign.starting_workers

    watches = {}  # each worker's flight record, as the campaign looks at it

    def started(worker, share=None):
        process = context.Process(target=work, args=(campaign, worker, messages, ready, go, stop, share),
                                  daemon=True)
        process.start()
        watches[worker] = Watch(worker_folder(campaign, worker))
        return process

    processes = {w: started(w) for w in range(workers)}
    result = CampaignResult(campaign, {w: Tally() for w in range(workers)}, [], 0.0)
    oom_before = oom_kills()

    def failed_in_the_cache(worker, record) -> bool:
        """``record`` (``flight.ended``) a failure found, where the worker was running a schedule."""
        found = found_dead(campaign, worker, record)
        if found is not None:
            result.found.append(found)
            stop.set()
        return found is not None

    def crashed_in_the_cache(worker, exitcode) -> bool:
        return (exitcode is not None and exitcode < 0 and died_of_a_crash(exitcode, oom_before, oom_kills())
                and failed_in_the_cache(worker, ended(read_flight(watches[worker].folder) or {}, exitcode)))

    try:
        for _ in range(workers):  # every worker imported and loaded: start them together
            kind, worker, payload = ready.get(timeout=START_TIMEOUT_S)
            if kind == "error":
                raise CampaignError(f"worker {worker} could not start:\n{payload}")
        start = time.perf_counter()
        go.set()
        running, last = set(range(workers)), start
        while running:
            try:
                kind, worker, payload = messages.get(timeout=1.0)
            except queues.Empty:
                for dead in [w for w in running if not processes[w].is_alive()] if messages.empty() else ():
                    running.discard(dead)
                    exitcode = processes[dead].exitcode
                    if crashed_in_the_cache(dead, exitcode):
                        continue
                    replacement = replace_dead(campaign, result, dead, exitcode,
                                               len(processes), time.perf_counter() - start, stop.is_set())
                    if replacement is not None:
                        worker, share = replacement
                        processes[worker], result.tallies[worker] = started(worker, share), Tally()
                        running.add(worker)
                kind = None
            if kind == "tally":
                result.tallies[worker] = payload
            elif kind == "found":
                result.found.append(payload)
                stop.set()
            elif kind == "done":
                running.discard(worker)
            elif kind == "database":
                result.database_lost.append(f"worker {worker}: {payload}")
            elif kind == "error":
                raise CampaignError(f"worker {worker} failed:\n{payload}")
            for hung, record in [(w, watches[w].overrun()) for w in running]:
                if record is not None:  # its member call outran the member timeout
                    processes[hung].kill()
                    processes[hung].join()
                    running.discard(hung)
                    failed_in_the_cache(hung, ended(record, processes[hung].exitcode, record["timeout"]))
            result.seconds = time.perf_counter() - start
            if on_progress and time.perf_counter() - last >= progress_s:
                on_progress(result)
                last = time.perf_counter()
        if on_progress:
            on_progress(result)
    except KeyboardInterrupt:  # what the workers reported so far is the campaign's result
        result.interrupted = stop_signal() or "SIGINT"
    finally:
        stop.set()
        go.set()
        for process in processes.values():  # interrupted: SIGTERM now, not after their round
            process.join(timeout=0 if result.interrupted else 30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
    return result


def found_dead(campaign: Campaign, worker: int, record: dict) -> Optional[Found]:
    """A worker that died of a crash or was stopped hung (``record``: its
    flight recorder's last word, with the signal and the timeout it
    overran) while it ran a schedule of the cache under test: that failure,
    with the schedule as far as it had grown. None where no schedule was
    running: nothing to blame it on."""
    try:
        doc = json.loads((worker_folder(campaign, worker) / SCHEDULE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not record.get("label"):
        return None
    return Found(worker, doc, f"{record['label']}: {how_it_ended(record)}; worker {worker} was stopped"
                 if record.get("hung") is not None else f"{record['label']}: {how_it_ended(record)}", record)


def replace_dead(campaign: Campaign, result: CampaignResult, dead: int, exitcode: int, made: int,
                 elapsed: float, stopping: bool) -> Optional[Tuple[int, Tuple[Optional[int], Optional[float]]]]:
    """A worker that ended without a word (killed from outside, or a crash
    in native code): noted in ``result.lost`` with what its last tally kept,
    and replaced by a new worker for what it had left (examples, seconds),
    up to one replacement per worker the campaign started with. Returns
    (the new worker's number, its share) or None."""
    kept = result.tallies[dead]
    how = signal_name(exitcode) if exitcode is not None and exitcode < 0 else f"exit {exitcode}"
    said = (f"worker {dead} died ({how}) after {kept.schedules} generated schedules; what it judged up to "
            f"its last report is kept, the schedules it was running are lost")
    share = campaign.share(dead)
    left = None if share is None else max(share - kept.schedules, 0)
    seconds = None if campaign.seconds is None else campaign.seconds - elapsed
    replaced = made - campaign.starting_workers
    if stopping or left == 0 or (seconds is not None and seconds <= 0) or replaced >= campaign.workers:
        result.lost.append(said + "; not replaced")
        return None
    result.lost.append(f"{said}; worker {made} took its place")
    return made, (left, seconds)

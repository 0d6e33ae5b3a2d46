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

import time
from dataclasses import replace
from typing import Optional

from mlx_lm.utils import load_tokenizer

from kvparity.oracle.generation import semantics
from kvparity.oracle.models import load_model
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, NOT_SUPPORTED, ScheduleResult
from kvparity.suites.format.arrivals import ArrivalSchedule, check_fits
from kvparity.suites.format.checks import RAISED
from kvparity.suites.format.levels import L4
from kvparity.suites.l3.trail import SERVE, SERVE_LABEL
from kvparity.suites.l4.client import Dialect, prompt_of
from kvparity.suites.l4.comparisons import SoloRuns, precision_of, compare, _kind
from kvparity.suites.l4.server import ServerUnderTest, model_dir, load_defect, serve_alone, serve
from kvparity.suites.l4.server_process import ServerDied, ServerGarbage
from kvparity.suites.l4.traffic import to_send, unread_prompt, token_id_of, Visit


SERVER = "the server"  # what failed at L4, where L1 to L3 name a protocol member


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

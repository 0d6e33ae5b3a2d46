"""Report directories, written atomically, and what goes in them.

A run writes into a hidden temporary directory beside its destination and
renames it into place only when every file is complete, so an interrupted
run leaves no half-written report and never overwrites an earlier one.

Each directory holds report.md (tables), report.json (the machine record,
described by schema/report.schema.json), junit.xml (CI) and report.html
(one self-contained page with plots).
"""

import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from kvparity.oracle.atomic import AtomicDirectory
from kvparity.reports import html, junit
from kvparity.reports.policy import Policy
from kvparity.reports.verdicts import RunVerdict, ScheduleVerdict
from kvparity.suites.core.processes import signals_deferred
from kvparity.suites.l4.server_process import SERVER_LOGS

from kvparity.reports.report_json import build_record, _groups
from kvparity.reports.markdown import tables, render_markdown


class ReportUnwritten(Exception):
    """The report directory could not be written (a full disk, a folder
    made read-only during the run): what the command printed stands."""


class ReportDirectory(AtomicDirectory):
    """``with ReportDirectory(root) as staging:`` write files into ``staging``;
    on success it becomes ``.path``, a new directory under ``root`` named by
    the time (an earlier report is never overwritten)."""

    def names(self):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        yield stamp
        yield from (f"{stamp}-{n}" for n in range(1, 1000))


def server_logs(verdicts: List[ScheduleVerdict]) -> Dict[str, str]:
    """L4: each server's log (file name -> its end) the schedule runs kept."""
    return {name: text for v in verdicts for name, text in v.evidence.server.get("logs", {}).items()}


def write_report(verdicts: List[ScheduleVerdict], environment: dict, root, *, policy: Policy,
                 run_verdict: RunVerdict, probes=None, capabilities=None, sections=(), expectations=None,
                 shard=None, extra: Optional[Callable[[Path], None]] = None, failures=None,
                 configuration=None) -> Path:
    """Write report.md, report.json, junit.xml and report.html into a new
    directory under ``root``; returns that directory.

    ``verdicts`` are the schedule runs' (``verdicts.judge``) and
    ``run_verdict`` is ``verdicts.verdict_of_run`` over them; ``policy`` is
    the one they were judged under. ``probes`` are L0 probe records, ``capabilities``
    {name: supported} (default: the environment's), ``sections`` extra
    (title, headers, rows) tables, and ``extra(directory)`` adds files
    (benchmarks) before the directory appears. ``expectations`` is the
    expectations file the runs were judged with, if any; ``shard`` the
    shard block of a shard's or a merge's report (``reports/shards.py``).
    ``failures``: as for ``build_record``; ``configuration`` the run's
    settings (``settings.Configuration``, or a record's ``configuration``).
    """
    options = dict(policy=policy, run_verdict=run_verdict, probes=probes, capabilities=capabilities,
                   sections=sections, expectations=expectations,
                   failures=_groups(verdicts, failures, run_verdict), configuration=configuration)
    record = build_record(verdicts, environment, shard=shard, **options)
    report_tables = tables(verdicts, environment, **options)
    report = ReportDirectory(root)
    # A stop signal waits for the report: a run that finished is reported whole.
    with signals_deferred():
        try:
            with report as directory:
                text = json.dumps(record, indent=2, allow_nan=False) + "\n"
                (directory / "report.json").write_text(text)
                (directory / "report.md").write_text(render_markdown(record, report_tables))
                (directory / "junit.xml").write_bytes(junit.render(record))
                (directory / "report.html").write_text(html.render(record, report_tables))
                for name, text in server_logs(verdicts).items():
                    (directory / SERVER_LOGS).mkdir(exist_ok=True)
                    (directory / SERVER_LOGS / name).write_text(text)
                if extra is not None:
                    extra(directory)
        except OSError as error:  # a full disk, a folder made read-only meanwhile: nothing half-written stays
            raise ReportUnwritten(f"the report could not be written under {root}: "
                                  f"{error.strerror or error}{f' ({error.filename})' if error.filename else ''}")
    return report.path

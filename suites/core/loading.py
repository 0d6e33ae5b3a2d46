"""A schedule read and proved: its fields as the format checks them
(``format.schedule.parse_fields``), then a dry run of the replay core, which
says what the schedule needs of an implementation and which calls each
request makes. A file that cannot happen is a ``ScheduleError`` naming the
file, the event and the reason, before anything runs."""

from kvparity.suites.core.dry_run import dry_run
from kvparity.suites.format.schedule import Schedule, parse_fields, read_document, reject


def parse(doc, source="<schedule>") -> Schedule:
    schedule = parse_fields(doc, source)
    schedule.needs, schedule.calls, schedule.order = dry_run(schedule)
    silent = [rid for rid, calls in schedule.calls.items() if not calls]
    if silent:
        reject(source, f"request {silent[0]!r}", "never joins: a request no event runs has nothing to compare")
    return schedule


def load(path) -> Schedule:
    return parse(read_document(path), source=str(path))

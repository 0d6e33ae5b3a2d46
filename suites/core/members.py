"""The protocol's members, each word declared once: the members an
implementation must have, the optional capabilities and the member that
provides each, and which members write, reshape or only read a batch."""

from typing import Dict


REQUIRED_MEMBERS = (
    "merge",
    "extend",
    "filter",
    "extract",
    "trim",
    "update_and_fetch",
    "make_mask",
    "prepare",
    "finalize",
    "size",
    "state",
    "nbytes",
)

# capability -> (what it means, the optional member that provides it)
CAPABILITIES: Dict[str, tuple] = {
    "per_row_rollback": (
        "rows keep different counts after a speculative round "
        "(rollback(amounts), re-aligning the rows)",
        "rollback",
    ),
}
OPTIONAL_MEMBERS = {member: capability for capability, (_, member) in CAPABILITIES.items()}
# The members that change which rows the batch holds or how long they are; the
# others run at every forward (a write, its mask) or only read.
RESHAPING_MEMBERS = ("merge", "extend", "filter", "extract", "trim", "prepare", "finalize", "rollback")
WRITE = "update_and_fetch"
# The members that write or reshape a batch when the schedule calls them (extract, which the
# checks call too, only reads it).
CHANGING_MEMBERS = (*(m for m in RESHAPING_MEMBERS if m != "extract"), WRITE)
# The members whose own output a check reads (a mask, an extracted row, a
# count, a width, a position): a divergence there is theirs by construction,
# whatever call came before it.
READING_MEMBERS = ("make_mask", "extract", "nbytes", "size", "offset")
# A member that applies what an earlier one recorded and no check can read in between (prepare
# keeps the right padding that finalize then acts on): where it is at fault, so may be the other.
APPLIES_WHAT_RECORDED = {"finalize": "prepare"}

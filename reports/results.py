"""What a run finds: per schedule, per row, the verdict and the first divergence."""

from dataclasses import asdict, dataclass, field
from typing import List, Optional

PASS = "pass"
FAIL = "FAIL"
NOT_SUPPORTED = "not supported"
SKIPPED = "skipped"  # the schedule does not fit the chosen model


@dataclass(frozen=True)
class Divergence:
    check: str  # which property broke: "bytes", "offset", "mask", "alias", ...
    event: str  # the event after which it was seen
    request: Optional[str] = None  # None: the batch as a whole
    tensor: str = ""  # e.g. "keys.scales", "logits"
    layer: Optional[int] = None
    step: Optional[int] = None
    index: Optional[int] = None  # flat index of the first differing element
    expected: object = None
    actual: object = None
    detail: str = ""

    def message(self) -> str:
        where = [f"after event {self.event}"]
        if self.request is not None:
            where.append(f"row {self.request!r}")
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        if self.tensor:
            where.append(self.tensor)
        if self.index is not None:
            where.append(f"flat index {self.index}")
        text = f"{self.check}: " + ", ".join(where)
        if self.expected is not None or self.actual is not None:
            text += f": expected {self.expected!r}, got {self.actual!r}"
        if self.detail:
            text += f" ({self.detail})"
        return text


@dataclass
class RowResult:
    request: str
    verdict: str = PASS
    divergences: List[Divergence] = field(default_factory=list)
    checks: int = 0
    metrics: dict = field(default_factory=dict)  # L2: logit statistics
    tier: str = ""  # the strongest verdict tier the row reached
    series: dict = field(default_factory=dict)  # L2: per-step logit series (index = step)
    required: str = "bit-exact"  # the tier the policy asked for

    @property
    def first(self) -> Optional[Divergence]:
        return self.divergences[0] if self.divergences else None


@dataclass
class ScheduleResult:
    schedule: str
    level: str
    implementation: str
    events: int
    rows: List[RowResult] = field(default_factory=list)
    verdict: str = PASS
    reason: str = ""  # why not supported, or what raised
    path: Optional[str] = None
    seconds: float = 0.0

    @property
    def divergences(self) -> List[Divergence]:
        return [d for row in self.rows for d in row.divergences]

    def row(self, request: str) -> RowResult:
        for row in self.rows:
            if row.request == request:
                return row
        self.rows.append(RowResult(request))
        return self.rows[-1]

    def to_json(self) -> dict:
        return asdict(self)

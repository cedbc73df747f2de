"""No replacement churn.

A worker whose replacements keep dying within their first seconds is not replaced again, and the
orchestrator says why, once.

Replacements that die young, one after another, are a fault no new process fixes. It may be a flag
this machine cannot honour, a broken device, or a bug on the path every new worker takes. Starting
more only takes CPU and memory from the survivors; a run that did so started 16 in a row. Deaths
count per lineage, that is, the first worker and every replacement after it (`info.replaces`).

This is pure state. The orchestrator asks `allowed` before it starts a replacement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

YOUNG_S = 10.0  # a replacement that dies within this of starting died young
LIMIT = 3  # young deaths in a row before a lineage is no longer replaced


@dataclass
class Churn:
    young_s: float = YOUNG_S
    limit: int = LIMIT
    young: dict[str, int] = field(default_factory=dict)  # lineage -> young replacement deaths in a row
    stopped: dict[str, str] = field(default_factory=dict)  # lineage -> why it is no longer replaced

    def died(self, lineage: str, replacement: bool, age_s: float | None, reason: str) -> str | None:
        """Records that a worker of `lineage` died `age_s` after it registered.

        `age_s` is None if it died before it registered. Returns, the one time it does, the message
        that says this lineage is no longer replaced."""
        if not replacement or (age_s is not None and age_s > self.young_s):
            self.young.pop(lineage, None)
            return None
        n = self.young[lineage] = self.young.get(lineage, 0) + 1
        if n < self.limit or lineage in self.stopped:
            return None
        age = "before it registered" if age_s is None else f"{age_s:.1f} s after it registered"
        self.stopped[lineage] = (f"{n} replacements in a row died within {self.young_s:.0f} s of starting; "
                                 f"the last {age}: {reason}")
        return self.stopped[lineage]

    def allowed(self, lineage: str) -> bool:
        return lineage not in self.stopped

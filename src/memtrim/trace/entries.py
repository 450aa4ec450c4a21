"""Which entry of a region entered several times a trace is: ``memtrim run --region NAME`` records
each entry as its own trace and keeps the chosen one, noting every entry's peaks in its metadata
(``metadata["region_entries"]``) so that the report — also of the saved file — can show them.

>>> log = TraceLog()
>>> both = (RegionEntry(1, 90, 100, 40), RegionEntry(2, 60, 140, 0))
>>> note_entries(log, RegionEntries("step", 2, "highest", both))
>>> region_entries(log).chosen_entry.absolute
140
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from memtrim.trace.model import TraceLog

ENTRIES = "region_entries"
"""The metadata key."""

Picked = Literal["highest", "asked"]
"""How the entry was chosen: the highest absolute peak (the default), or ``--entry N``."""


@dataclass(frozen=True)
class RegionEntry:
    """One entry's peaks on its headline device."""

    number: int
    """1 for the first time the region was entered."""
    peak: int
    """Above the entry's start."""
    absolute: int
    """With what was alive at the entry's start that memtrim knows of (``Analysis.absolute_peak_bytes``)."""
    optimizer_state_made: int
    """Optimizer state the entry created (a training loop's first step makes Adam's moments)."""


@dataclass(frozen=True)
class RegionEntries:
    region: str
    chosen: int
    """The entry this trace is (1-based)."""
    picked: Picked
    entries: tuple[RegionEntry, ...]

    @property
    def chosen_entry(self) -> RegionEntry:
        return self.entries[self.chosen - 1]


def note_entries(log: TraceLog, entries: RegionEntries) -> None:
    log.metadata[ENTRIES] = {
        "region": entries.region,
        "chosen": entries.chosen,
        "picked": entries.picked,
        "entries": [asdict(e) for e in entries.entries],
    }


def region_entries(log: TraceLog) -> RegionEntries | None:
    """The entries noted in ``log``, or None when there are none (or they are not as written here:
    metadata is free-form, so a hand-edited file loses the table, not the trace)."""
    raw: Any = log.metadata.get(ENTRIES)
    try:
        entries = tuple(
            RegionEntry(*(int(e[k]) for k in ("number", "peak", "absolute", "optimizer_state_made")))
            for e in raw["entries"]
        )
        chosen, picked, region = int(raw["chosen"]), raw["picked"], str(raw["region"])
    except (TypeError, KeyError, ValueError):
        return None
    if not 1 <= chosen <= len(entries) or picked not in ("highest", "asked"):
        return None
    return RegionEntries(region, chosen, picked, entries)

"""The doctor: a registry of small rules that read an :class:`~memtrim.analysis.Analysis` and say how to
cut its peak, each finding with the peak a what-if replay of the recorded timeline gives with its fix.

It sits above the analysis (which never imports it): ``diagnoses(analysis)`` runs every rule once per
analysis and keeps the result in the analysis's memo. The rules live in :mod:`memtrim.doctor.rules`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrim.doctor.diagnosis import (
    DIAGNOSES,
    KEEPS,
    MATERIAL,
    PROOF,
    Diagnosis,
    Keeps,
    VerifyMode,
    diagnose,
    finding,
)

if TYPE_CHECKING:
    from memtrim.analysis import Analysis


def diagnoses(analysis: Analysis) -> tuple[Diagnosis, ...]:
    """Every rule's findings on ``analysis`` that would lower its peak, largest saving first; computed
    once per analysis."""
    return analysis.memo("doctor.diagnoses", lambda: tuple(diagnose(analysis)))


__all__ = [
    "DIAGNOSES",
    "KEEPS",
    "MATERIAL",
    "PROOF",
    "Diagnosis",
    "Keeps",
    "VerifyMode",
    "diagnose",
    "diagnoses",
    "finding",
]

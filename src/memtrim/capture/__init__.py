"""The capture stage: a dispatch-mode recorder that turns a running program into a trace log."""

from memtrim.capture.api import record
from memtrim.capture.recorder import Recorder

__all__ = ["Recorder", "record"]

"""The capture stage: a dispatch-mode recorder that turns a running program into a trace."""

from memtrim.capture.api import track
from memtrim.capture.recorder import Recorder

__all__ = ["Recorder", "track"]

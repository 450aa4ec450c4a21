"""The capture stage: a dispatch-mode recorder that turns a running program into a trace log."""

from memtrim.capture.api import record
from memtrim.capture.fork import recorded_here
from memtrim.capture.frames import set_library_roots, site_packages
from memtrim.capture.recorder import Recorder

__all__ = ["Recorder", "record", "recorded_here", "set_library_roots", "site_packages"]

"""Writing a view to a file: atomically (a temporary file in the same folder, then a rename), with the
permissions ``open()`` would give, as traces are written."""

from __future__ import annotations

from memtrim.trace.serialize import atomic_file, write_text_atomically


def write_bytes_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash never leaves half a file."""
    with atomic_file(path, binary=True) as handle:
        handle.write(data)


def write_text(path: str, text: str) -> None:
    write_text_atomically(path, text)

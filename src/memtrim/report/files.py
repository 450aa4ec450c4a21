"""Writing a view to a file: atomically (a temporary file in the same folder, then a rename), with the
permissions ``open()`` would give, as traces are written."""

from __future__ import annotations

import os
import secrets

from memtrim.trace.serialize import write_text_atomically


def write_bytes_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash never leaves half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(4)}.memtrim-tmp")
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str, text: str) -> None:
    write_text_atomically(path, text)

"""Text from a trace or from user code, made safe to print: control and format characters (ANSI escape
sequences, OSC window titles, carriage returns, bidi overrides) are shown as ``\\x1b``-style escapes
instead of being interpreted by the terminal."""

from __future__ import annotations

import unicodedata
from functools import lru_cache


@lru_cache(maxsize=4096)
def safe(text: str) -> str:
    """``text`` with every control (Cc) and format (Cf) character escaped; printable text unchanged."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or (ch == " "):
            out.append(ch)
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            code = ord(ch)
            out.append(
                f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
            )
        else:  # other separators (e.g. no-break space): harmless
            out.append(ch)
    return "".join(out)

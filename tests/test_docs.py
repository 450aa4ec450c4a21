"""The manual runs: every code block marked runnable in README.md and docs/*.md is executed; links resolve.

Markers, each on the line just before a fenced block:

- ``<!-- run -->`` before a ```` ```python ```` block runs it with this interpreter; before a
  ```` ```bash ```` block runs it with ``bash -e`` (the ``memtrim`` command on ``PATH``). Each block runs
  in a fresh temporary folder, in its own process, with a timeout.
- ``<!-- file: NAME -->`` before a block writes it to ``NAME`` in that folder for every runnable block
  after it in the same file (``prog.py`` for a ``memtrim run prog.py`` block), so each block is
  self-contained: what it needs is written out again, never left over from another block.

A failing block fails with its ``file:line``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANUAL = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- (run|file: (\S+)) -->\s*$")
FENCE = re.compile(r"^```(\w*)")
TIMEOUT_S = 120
README_MAX_LINES = 450


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    file_name: str | None  # set for a file: block, None for a run block

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def marked_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        marker = MARKER.match(line)
        if not marker:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            where = f"{doc.relative_to(ROOT)}:{i + 1}"
            raise AssertionError(f"{where}: a {line.strip()} marker must sit just before a ``` fence")
        try:
            end = next(j for j in range(i + 2, len(lines)) if lines[j].rstrip() == "```")
        except StopIteration:
            raise AssertionError(f"{doc.relative_to(ROOT)}:{i + 2}: the marked block never closes") from None
        blocks.append(
            Block(doc, i + 2, fence.group(1), "\n".join(lines[i + 2 : end]) + "\n", marker.group(2))
        )
    return blocks


ALL_BLOCKS = [block for doc in MANUAL for block in marked_blocks(doc)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if block.file_name is None]


NEAR_MARKER = re.compile(r"^\s*<!--\s*(run|file)\b", re.IGNORECASE)


def test_every_marker_is_spelled_so_the_collector_sees_it() -> None:
    # A misspelt marker (``<!--run-->``, ``<!-- file:prog.py -->``) would silently turn its block's check off.
    misspelt = [
        f"{doc.relative_to(ROOT)}:{number}: {line.strip()}"
        for doc in MANUAL
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1)
        if NEAR_MARKER.match(line) and not MARKER.match(line)
    ]
    fix = "write markers exactly as <!-- run --> or <!-- file: NAME -->:\n"
    assert not misspelt, fix + "\n".join(misspelt)
    assert any(block.doc.name == "README.md" for block in RUN_BLOCKS), "the README's quick starts must run"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.where for block in RUN_BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    for earlier in ALL_BLOCKS:
        if earlier.doc == block.doc and earlier.line < block.line and earlier.file_name:
            (tmp_path / earlier.file_name).write_text(earlier.text, encoding="utf-8")
    stem = re.sub(r"\W", "_", block.doc.stem)
    if block.lang == "python":
        script = tmp_path / f"{stem}_{block.line}.py"
        command = [sys.executable, script.name]
    elif block.lang == "bash":
        script = tmp_path / f"{stem}_{block.line}.sh"
        command = ["bash", "-e", script.name]
    else:
        pytest.fail(f"{block.where}: a runnable block must be python or bash, not {block.lang!r}")
    script.write_text(block.text, encoding="utf-8")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    try:
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: the block ran past {TIMEOUT_S} s")
    assert done.returncode == 0, (
        f"{block.where}: the block exited with status {done.returncode}\n"
        f"--- stdout (end)\n{done.stdout[-3000:]}\n--- stderr (end)\n{done.stderr[-3000:]}"
    )


def test_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into a guide under docs/"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def github_slugs(doc: Path) -> set[str]:
    """The anchors GitHub gives a file's headings (lowercase, punctuation dropped, spaces as hyphens)."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def links(doc: Path) -> list[tuple[int, str]]:
    found = []
    in_code = False
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        text = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        found += [(number, target) for target in LINK.findall(text)]
    return found


@pytest.mark.parametrize("doc", MANUAL, ids=[str(doc.relative_to(ROOT)) for doc in MANUAL])
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for number, target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(f"{doc.relative_to(ROOT)}:{number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in github_slugs(resolved):
            broken.append(f"{doc.relative_to(ROOT)}:{number}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)

"""Make the README's pictures from a real run: `memtrim run` on docs/example_train.py, then the HTML
report in headless Chromium (docs/report.png) and the PNG export (docs/timeline.png)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import chromium  # noqa: E402  (the tests' DevTools-over-a-pipe helper)


def main() -> int:
    docs = ROOT / "docs"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.html"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "memtrim",
                "run",
                "-o",
                str(Path(tmp) / "t.json"),
                "--html",
                str(report),
                "--png",
                str(docs / "timeline.png"),
                str(docs / "example_train.py"),
            ],
            check=True,
            env=env,
        )
        executable, why = chromium.find()
        if executable is None:
            print(f"no screenshot of the report: {why}", file=sys.stderr)
            return 1
        browser = chromium.Browser(executable, width=1100, height=860)
        try:
            browser.open(report)
            problems = browser.problems()
            if problems:
                print("\n".join(problems), file=sys.stderr)
                return 1
            browser.screenshot(docs / "report.png", full_page=False)
        finally:
            browser.close()
    print(f"wrote {docs / 'report.png'} and {docs / 'timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

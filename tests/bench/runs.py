"""Running `python -m bench.run` from a test: its JSON results, and what it printed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(args: list[str], out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """bench.run with these arguments and `--json out`; fails the test if it exits non-zero."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())

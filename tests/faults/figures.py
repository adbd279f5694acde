"""The fault suite's figures: printed, and kept in test-output/faults.json (one entry per test,
the last run's) for docs/operator/high-availability.md."""

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "test-output" / "faults.json"


def report(name: str, figures: dict) -> None:
    print(f"\n{name}: {json.dumps(figures)}")
    OUT.parent.mkdir(exist_ok=True)
    try:
        known = json.loads(OUT.read_text())
    except (OSError, ValueError):
        known = {}
    known[name] = figures
    OUT.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")

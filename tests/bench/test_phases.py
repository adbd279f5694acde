"""`python -m bench.phases` end to end on SQLite: its probe still finds every phase it times
(it wraps the group writers and the upstream send, so a change to those must keep it working)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # starts a bench run: servers and databases
def test_phases_times_every_phase_of_each_request(tmp_path):
    requests = 30
    done = subprocess.run(
        [sys.executable, "-m", "bench.phases", "--backend", "sqlite"]
        + ["--concurrency", "2", "--requests", str(requests)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"statuses {{200: {requests}}}" in out, out
    counts = {
        name.strip(): int(n)
        for name, n in re.findall(r"^(\D+?)\s+(\d+)\s+[\d.]+\s+[\d.]+", out, re.MULTILINE)
    }
    # Every request waits once for its hold, once for its settle, once for its upstream; its
    # own path between them is timed once each, and only for the measured requests.
    for phase in (
        "arrival to end ms",
        "arrival to hold submitted ms",
        "hold wait ms",
        "hold answered to upstream call ms",
        "upstream answer (headers) ms",
        "headers to first body byte ms",
        "settle wait ms",
    ):
        assert counts.get(phase) == requests, (phase, out)
    assert 1 <= counts["group statement ms"] <= 2 * requests, out
    assert counts["loop lag ms"] >= 1, out

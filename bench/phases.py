"""Where a request's time goes inside the server: its own path from its arrival to its hold's
submission, the wait for its hold's group to commit, its path from there to the upstream call,
the wait for the upstream's answer (headers), from those to the first byte of the body sent to
the client, the wait for its settle's group, the group statements themselves, and how late the
event loop runs a timer (what any ready callback waits for the work ahead of it).

    python -m bench.phases [--backend pg|sqlite] [--concurrency 16] [--requests 4000] [--stream]

Starts the sim and ours (budgets on, one worker) with `bench/phase_probe` first on the
server's PYTHONPATH: its sitecustomize wraps the chat route, the group writers and the upstream
send with timers and writes what it gathered on SIGUSR1. The timers cost the server a little
CPU, so the request rates here are not the bench's; compare phases with each other.
"""

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import load
from bench.procs import cpu_seconds, start_sim
from bench.run import SIM_KEY, chat_body, parse_args, start_ours

PROBE = Path(__file__).resolve().parent / "phase_probe"
ORDER = (
    "arrival to end",
    "arrival to hold submitted",
    "hold wait",
    "hold answered to upstream call",
    "upstream answer (headers)",
    "headers to first body byte",
    "settle wait",
    "group statement",
    "database round trip",
    "group size",
    "loop lag",
    "gc, generation 0",
    "gc, generation 1",
    "gc, generation 2",
)


def _wait_for(path: Path) -> Path:
    """The probe's file, once the server has written it whole."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            json.loads(path.read_text())
            return path
        time.sleep(0.05)
    raise RuntimeError(f"the server wrote no phases to {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("pg", "sqlite"), default="pg")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--pg", default=os.environ.get("METERING_BENCH_PG", ""))
    args = p.parse_args(argv)
    bench_args = parse_args(
        ["--modes", args.backend, "--hot", "0", "--paced", "0"]
        + (["--pg", args.pg] if args.pg else [])
    )
    with (
        tempfile.TemporaryDirectory(prefix="metering-phases-") as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        out = tmp / "phases.json"
        saved = dict(os.environ)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PROBE), str(PROBE.parents[1]), saved.get("PYTHONPATH")])
        )
        os.environ["METERING_PHASES_OUT"] = str(out)
        try:
            sim, sim_port = start_sim(tmp, stack, SIM_KEY)
            (tmp / "ours").mkdir()
            server = start_ours(bench_args, args.backend, sim_port, tmp / "ours", stack)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        token = server.principals["on"]["token"]["token"]
        target = load.Target(
            url=f"{server.base}/v1/chat/completions",
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
            body=chat_body(args.stream, 20, 20, False),
            stream=args.stream,
        )
        cpu = {}

        def on_measure(phase: str) -> None:
            cpu[phase] = cpu_seconds(server.pid)
            if phase == "start":  # what the warm-up gathered is written and dropped
                os.kill(server.pid, signal.SIGUSR1)
                _wait_for(out).unlink()

        measured, _ = load.run(
            target, args.requests, args.concurrency, max(20, 2 * args.concurrency), on_measure
        )
        os.kill(server.pid, signal.SIGUSR1)
        phases = json.loads(_wait_for(out).read_text())
        latencies = sorted(measured.latencies_s)
        n = len(latencies)
        kind = "stream" if args.stream else "non-stream"
        print(
            f"{args.backend}, {kind}, C={args.concurrency}: {n / measured.elapsed_s:.0f} req/s, "
            f"p50 {latencies[n // 2] * 1000:.2f} ms, server CPU "
            f"{(cpu['end'] - cpu['start']) / n * 1000:.2f} ms/req, "
            f"statuses {dict(measured.statuses)}"
        )
        print(f"{'phase':<34}{'n':>8}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")
        for name in ORDER:
            if name in phases:
                row = phases[name]
                unit = "" if name == "group size" else " ms"
                print(
                    f"{name + unit:<34}{row['n']:>8}{row['mean']:>9.2f}{row['p50']:>9.2f}"
                    f"{row['p90']:>9.2f}{row['p99']:>9.2f}{row['max']:>9.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

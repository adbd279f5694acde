"""Proxy latency with and without a hanging webhook receiver, while thresholds cross.

    python -m bench.alerts [--requests 400] [--concurrency 8] [--rounds 5] [--pg postgresql://...]

Two `metering serve` processes side by side (each on its own SQLite file, or its own fresh
PostgreSQL database with --pg) and the simulated upstream: one with no webhook, one with a
webhook at a hanging receiver; their phases are interleaved round by round. Each phase gives every worker a fresh token whose limit its share of the requests
fills, with ten thresholds (10%, 20%, ... 100%): every token crosses all ten, so the outbox
gets events throughout. A first, unmeasured phase warms each server up. "without": no webhook. "with": a webhook for
every event at a receiver that accepts connections and never answers (the worker's timeout is
30 s, so its deliveries hang; at most METERING_WEBHOOK_PER_ENDPOINT of them at once). The figure
is the median over the rounds of the ratio with / without of p50, p95 and throughput; 1.0 means
the hanging receiver costs the proxy nothing.
"""

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import uuid
from decimal import Decimal
from pathlib import Path

import httpx

from bench import load
from bench.procs import Process, free_port, metering_command, start_sim
from bench.run import SIM_KEY, SIM_KEY_ENV, Admin, catalog_toml, postgres_database
from metering.alerts.record import TYPES

THRESHOLDS = list(range(10, 101, 10))
OVER = 'sim:usage={"prompt_tokens":100000,"completion_tokens":100000,"total_tokens":200000}'


class HangingReceiver:
    """Accepts connections, reads what comes, never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.held: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)  # kept open, never answered

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def body() -> bytes:
    content = f"bench {uuid.uuid4().hex[:16]} {OVER}"
    message = {"role": "user", "content": content}
    return json.dumps({"model": "gpt-sim", "messages": [message], "max_tokens": 5}).encode()


def tokens(admin: Admin, count: int, limit: Decimal | None) -> list[str]:
    team = admin.ok("POST", "/v1/teams", 201, json={"name": f"alerts-{uuid.uuid4().hex[:8]}"})
    user = admin.ok(
        "POST",
        "/v1/users",
        201,
        json={
            "email": f"{uuid.uuid4().hex[:10]}@bench.example",
            "name": "b",
            "team_id": team["id"],
        },
    )
    made = []
    for _ in range(count):
        spec = {"name": "t", "credit_limit": None if limit is None else str(limit)}
        spec["alert_thresholds"] = THRESHOLDS
        token = admin.ok("POST", f"/v1/users/{user['id']}/tokens", 201, json=spec)
        made.append(token["token"])
        if len(made) % 10 == 0:  # at most 10 active tokens per user
            user = admin.ok(
                "POST",
                "/v1/users",
                201,
                json={
                    "email": f"{uuid.uuid4().hex[:10]}@bench.example",
                    "name": "b",
                    "team_id": team["id"],
                },
            )
    return made


def hold_of(admin: Admin, base: str) -> Decimal:
    (probe,) = tokens(admin, 1, None)
    answer = httpx.post(
        f"{base}/v1/chat/completions",
        content=body(),
        headers={"authorization": f"Bearer {probe}", "content-type": "application/json"},
        timeout=30,
    )
    answer.raise_for_status()
    event = admin.ok("GET", "/v1/usage", params={"limit": 1})["data"][0]
    return Decimal(event["cost"])


def phase(admin: Admin, base: str, hold: Decimal, args) -> load.LoadResult:
    per_worker = -(-args.requests // args.concurrency) + -(-args.warmup // args.concurrency)
    keys = tokens(admin, args.concurrency, hold * per_worker)
    target = load.Target(
        url=f"{base}/v1/chat/completions",
        headers={"content-type": "application/json"},
        body=body(),
        stream=False,
        spread=[{"authorization": f"Bearer {k}", "content-type": "application/json"} for k in keys],
    )
    measured, _ = load.run(target, args.requests, args.concurrency, args.warmup, deadline_s=600)
    return measured


def serve(stack: contextlib.ExitStack, tmp: Path, name: str, args, sim_port: int):
    """One `metering serve` on a database of its own; its base URL, admin and a request's hold."""
    if args.pg:
        _, database_url = stack.enter_context(postgres_database(args.pg))
    else:
        database_url = f"sqlite:///{tmp / f'{name}.db'}"
    config = tmp / f"{name}.toml"
    config.write_text(catalog_toml(sim_port))
    admin_key = "bench-admin-" + uuid.uuid4().hex
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "METERING_DATABASE_URL": database_url,
        "METERING_ADMIN_KEY": admin_key,
        "METERING_CONFIG": str(config),
        "METERING_WEBHOOKS_ALLOW_LOOPBACK": "true",
        "METERING_WEBHOOK_TIMEOUT_S": "30",
        "METERING_LEASE_SHARE": "0",
        SIM_KEY_ENV: SIM_KEY,
    }
    argv_ = [*metering_command(), "serve", "--port", str(port), "--log-level", "warning"]
    workdir = tmp / name
    workdir.mkdir()
    server = Process(f"metering-{name}", argv_, env, workdir, workdir)
    stack.callback(server.stop)
    server.wait_http(f"{base}/healthz", timeout=120)
    admin = Admin(base, admin_key)
    return base, admin, hold_of(admin, base)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg", help="PostgreSQL admin DSN: run on fresh databases there")
    args = parser.parse_args(argv)

    rows: list[tuple[int, str, load.LoadResult]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        _, sim_port = start_sim(tmp, stack, SIM_KEY)
        plain = serve(stack, tmp, "without", args, sim_port)
        hung = serve(stack, tmp, "with", args, sim_port)
        receiver = HangingReceiver()
        stack.callback(receiver.close)
        hung[1].ok("POST", "/v1/webhooks", 201, json={"url": receiver.url, "events": list(TYPES)})
        for base, admin, hold in (plain, hung):
            phase(admin, base, hold, args)  # a first pass, so no measured phase pays warming up
        for round_ in range(1, args.rounds + 1):
            # Interleaved, alternating which goes first: the machine's noise falls on both.
            order = [("without", plain), ("with a hanging receiver", hung)]
            for name, (base, admin, hold) in order if round_ % 2 else order[::-1]:
                rows.append((round_, name, phase(admin, base, hold, args)))
        alerts = hung[1].ok("GET", "/v1/alerts", params={"limit": 1000})["data"]

    backend = "postgresql" if args.pg else "sqlite"
    print(
        f"backend: {backend}; {args.rounds} rounds of {args.requests} requests at C={args.concurrency}"
    )
    print(f"{'round':<7}{'phase':<26}{'ok':>6}{'p50 ms':>10}{'p95 ms':>10}{'req/s':>10}")
    for round_, name, r in sorted(rows, key=lambda row: (row[0], row[1] != "without")):
        print(
            f"{round_:<7}{name:<26}{r.ok:>6}{r.percentile_ms(50):>10.2f}"
            f"{r.percentile_ms(95):>10.2f}{r.rps:>10.1f}"
        )
    ratios: dict[str, list[float]] = {"p50": [], "p95": [], "throughput": []}
    for round_ in range(1, args.rounds + 1):
        pair = {name: r for n, name, r in rows if n == round_}
        without, with_ = pair["without"], pair["with a hanging receiver"]
        ratios["p50"].append(with_.percentile_ms(50) / without.percentile_ms(50))
        ratios["p95"].append(with_.percentile_ms(95) / without.percentile_ms(95))
        ratios["throughput"].append(with_.rps / without.rps)
    print(
        "median ratio with/without over the rounds: "
        + ", ".join(f"{k} {median(v):.3f}" for k, v in ratios.items())
        + " (per round p50: "
        + " ".join(f"{v:.2f}" for v in ratios["p50"])
        + ")"
    )
    crossed = sum(e["type"] == "budget.threshold_crossed" for e in alerts)
    print(
        f"threshold events (last 1000 listed): {crossed}; connections the receiver holds: "
        f"{receiver.accepted}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

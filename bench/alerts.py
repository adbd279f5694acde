"""Proxy latency with and without a hanging webhook receiver, while thresholds cross.

    python -m bench.alerts [--requests 400] [--concurrency 8] [--pg postgresql://...]

One `metering serve` (SQLite, or a fresh PostgreSQL database with --pg) and the simulated
upstream. Each phase gives every worker a fresh token whose limit its share of the requests
fills, with ten thresholds (10%, 20%, ... 100%): every token crosses all ten, so the outbox
gets events throughout. A first, unmeasured phase warms the server up. Phase "without": no webhook. Phase "with": a webhook for every event
at a receiver that accepts connections and never answers (the worker's timeout is 30 s, so
every delivery hangs for the whole phase). The figure is the ratio with / without of p50, p95
and throughput; 1.0 means the hanging receiver costs the proxy nothing.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--pg", help="PostgreSQL admin DSN: run on a fresh database there")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        _, sim_port = start_sim(tmp, stack, SIM_KEY)
        if args.pg:
            _, database_url = stack.enter_context(postgres_database(args.pg))
        else:
            database_url = f"sqlite:///{tmp / 'bench.db'}"
        config = tmp / "metering.toml"
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
        server = Process("metering", argv_, env, tmp, tmp)
        stack.callback(server.stop)
        server.wait_http(f"{base}/healthz", timeout=120)
        admin = Admin(base, admin_key)
        hold = hold_of(admin, base)

        phase(admin, base, hold, args)  # a first pass, so neither phase pays the warming up
        without = phase(admin, base, hold, args)
        receiver = HangingReceiver()
        stack.callback(receiver.close)
        admin.ok("POST", "/v1/webhooks", 201, json={"url": receiver.url, "events": list(TYPES)})
        with_ = phase(admin, base, hold, args)
        alerts = admin.ok("GET", "/v1/alerts", params={"limit": 1000})["data"]

    rows = {
        "without": without,
        "with a hanging receiver": with_,
    }
    print(
        f"backend: {'postgresql' if args.pg else 'sqlite'}; {args.requests} requests at C={args.concurrency}"
    )
    print(f"{'phase':<26}{'ok':>6}{'p50 ms':>10}{'p95 ms':>10}{'req/s':>10}")
    for name, r in rows.items():
        print(
            f"{name:<26}{r.ok:>6}{r.percentile_ms(50):>10.2f}{r.percentile_ms(95):>10.2f}{r.rps:>10.1f}"
        )
    print(
        f"ratio with/without: p50 {with_.percentile_ms(50) / without.percentile_ms(50):.3f}, "
        f"p95 {with_.percentile_ms(95) / without.percentile_ms(95):.3f}, "
        f"throughput {with_.rps / without.rps:.3f}"
    )
    crossed = sum(e["type"] == "budget.threshold_crossed" for e in alerts)
    print(
        f"threshold events (last 1000 listed): {crossed}; connections the receiver holds: "
        f"{receiver.accepted}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Soak: `metering serve` on PostgreSQL at a steady load for a while; its RSS and open file
descriptors must stay flat.

    python -m bench.soak                      # 600 s at 50 requests/s
    python -m bench.soak --duration 60        # a short check

Starts the simulated upstream and `metering serve` as subprocesses (so the RSS and descriptors
sampled are the server's own) on a fresh PostgreSQL database (created and dropped here), makes
--tokens tokens, then sends --rate requests a second at a fixed pace (open loop: a slow server
does not slow the load down), half of them streamed, one stream in --hangup-every dropped by the
client after its first bytes. Every --sample-s seconds it samples the server's RSS and open
descriptors. The samples after --warmup-s are judged: a figure is flat when the mean of their
last third is at most 10% above the mean of their first third (descriptors: plus 5, as the
requests in flight hold a few each; a single sample is noisy, a leak grows). At the end, once
the load has stopped and every hold is settled, descriptors are sampled again at rest (shown,
not judged: the pools stay open) and the ledger is checked: one event per answered request,
nothing reserved, no 5xx.
"""

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import aiohttp

from bench.procs import Process, free_port, metering_command, start_sim, tree, tree_rss_kib
from bench.run import MODEL, SIM_KEY_ENV, Admin, catalog_toml, postgres_database

FLAT = Decimal("0.10")
FD_SLACK = 5
MAX_IN_FLIGHT = 500


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    p.add_argument("--rate", type=float, default=50, help="requests per second (default 50)")
    p.add_argument("--tokens", type=int, default=4, help="API tokens the load is spread over")
    p.add_argument("--sample-s", type=float, default=5, help="seconds between samples")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="seconds of load before the samples judged (default min(60, duration/6))",
    )
    p.add_argument("--hangup-every", type=int, default=10, help="one stream in N is dropped")
    p.add_argument("--chunks", type=int, default=10, help="content chunks per streamed answer")
    p.add_argument("--delay-ms", type=int, default=20, help="the sim's pause between chunks")
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG",
            os.environ.get("METERING_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ),
        help="a PostgreSQL database to connect to for CREATE/DROP DATABASE",
    )
    args = p.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = min(60.0, args.duration / 6)
    return args


def open_fds(pid: int) -> int:
    total = 0
    for member in tree(pid):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{member}/fd"))
    return total


@dataclass
class Sample:
    t: float
    rss_kib: int
    fds: int
    done: int
    in_flight: int


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    hung_up: int = 0
    skipped: int = 0  # not sent: MAX_IN_FLIGHT requests were already waiting
    in_flight: int = 0
    ok_by_token: Counter = field(default_factory=Counter)

    @property
    def done(self) -> int:
        return sum(self.statuses.values()) + sum(self.errors.values()) + self.hung_up


def body(n: int, stream: bool, args) -> dict:
    text = f"Soak request {n}, please answer. sim:tokens=12"
    if stream:
        text += f" sim:chunks={args.chunks} sim:delay_ms={args.delay_ms}"
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 32,
        "stream": stream,
    }


async def one(session, url: str, key: str, token_id: str, n: int, args, tally: Tally) -> None:
    stream = n % 2 == 1
    hang_up = stream and args.hangup_every and (n // 2) % args.hangup_every == 0
    tally.in_flight += 1
    try:
        async with session.post(
            url, json=body(n, stream, args), headers={"authorization": f"Bearer {key}"}
        ) as response:
            if hang_up and response.status == 200:
                await response.content.readany()
                response.close()  # the client goes away mid-stream
                tally.hung_up += 1
                return
            await response.read()
            tally.statuses[response.status] += 1
            if response.status == 200:
                tally.ok_by_token[token_id] += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.errors[type(exc).__name__] += 1
    finally:
        tally.in_flight -= 1


async def drive(args, base: str, tokens: list[dict], pid: int) -> tuple[Tally, list[Sample]]:
    tally, samples = Tally(), []
    url = f"{base}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks: set[asyncio.Task] = set()
        start = time.monotonic()
        next_sample = start
        n = 0
        while (now := time.monotonic()) - start < args.duration:
            if now >= next_sample:
                samples.append(
                    Sample(
                        now - start, tree_rss_kib(pid), open_fds(pid), tally.done, tally.in_flight
                    )
                )
                s = samples[-1]
                print(
                    f"t={s.t:6.1f}s rss={s.rss_kib / 1024:7.1f} MiB fds={s.fds:4d} "
                    f"done={s.done:6d} in_flight={s.in_flight:3d} statuses={dict(tally.statuses)} "
                    f"errors={dict(tally.errors)}",
                    file=sys.stderr,
                    flush=True,
                )
                next_sample += args.sample_s
            due = start + n / args.rate
            if now < due:
                await asyncio.sleep(min(due - now, max(0.0, next_sample - now)))
                continue
            token = tokens[n % len(tokens)]
            if tally.in_flight >= MAX_IN_FLIGHT:
                tally.skipped += 1
            else:
                task = asyncio.create_task(
                    one(session, url, token["token"], token["id"], n, args, tally)
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            n += 1
        if tasks:
            await asyncio.gather(*tasks)
    return tally, samples


def verdict(name: str, values: list[int], slack: int = 0) -> tuple[bool, str]:
    """Flat: the mean of the last third of the samples is at most 10% (plus slack) above the
    mean of the first third; requests in flight make single samples noisy, a leak grows."""
    third = max(1, len(values) // 3)
    first = Decimal(sum(values[:third])) / third
    last = Decimal(sum(values[-third:])) / third
    bound = first * (1 + FLAT) + slack
    flat = last <= bound
    return flat, (
        f"{name}: start {values[0]}, end {values[-1]}, max {max(values)}; mean of the first "
        f"third {first:.0f}, of the last third {last:.0f} -> {'flat' if flat else 'NOT flat'} "
        f"(bound {bound:.0f})"
    )


def wait_settled(admin: Admin, tokens: list[dict], timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        budgets = [admin.ok("GET", f"/v1/tokens/{t['id']}/budget") for t in tokens]
        if all(Decimal(b["reserved"]) == 0 for b in budgets) or time.monotonic() > deadline:
            return budgets
        time.sleep(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="metering-soak-") as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        sim, sim_port = start_sim(tmp, stack, "sim-key")
        _, database_url = stack.enter_context(postgres_database(args.pg))
        config = tmp / "metering.toml"
        config.write_text(catalog_toml(sim_port))
        admin_key = "soak-admin-" + uuid.uuid4().hex
        env = {
            **os.environ,
            "METERING_DATABASE_URL": database_url,
            "METERING_ADMIN_KEY": admin_key,
            "METERING_CONFIG": str(config),
            SIM_KEY_ENV: "sim-key",
        }
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server = Process(
            "metering",
            [*metering_command(), "serve", "--port", str(port), "--log-level", "warning"],
            env,
            tmp,
            tmp,
        )
        stack.callback(server.stop)
        server.wait_http(f"{base}/healthz")
        admin = Admin(base, admin_key)
        tokens = [admin.principal("1000")["token"] for _ in range(args.tokens)]
        fds_idle = open_fds(server.pid)
        print(
            f"metering serve pid {server.pid}, sim pid {sim.pid}; {args.rate:g} req/s for "
            f"{args.duration:g} s, sampling every {args.sample_s:g} s, judged after "
            f"{args.warmup_s:g} s",
            file=sys.stderr,
        )

        tally, samples = asyncio.run(drive(args, base, tokens, server.pid))
        budgets = wait_settled(admin, tokens)
        time.sleep(2 * args.sample_s)  # idle connections close, the server comes to rest
        fds_rest = open_fds(server.pid)

        measured = [s for s in samples if s.t >= args.warmup_s] or samples[-1:]
        rss_ok, rss_line = verdict("RSS KiB", [s.rss_kib for s in measured])
        fds_ok, fds_line = verdict("open fds", [s.fds for s in measured], FD_SLACK)
        events = sum(len(admin.events(t["id"])) for t in tokens)
        answered = sum(tally.ok_by_token.values()) + tally.hung_up
        reserved = sum(Decimal(b["reserved"]) for b in budgets)
        elapsed = args.duration
        server_errors = sum(n for status, n in tally.statuses.items() if status >= 500)
        print()
        print(f"load: {tally.done} requests in {elapsed:.0f} s ({tally.done / max(elapsed, 1):.1f}/s)"
              f", statuses {dict(tally.statuses)}, hung up {tally.hung_up}, "
              f"client errors {dict(tally.errors)}, not sent (too many in flight) {tally.skipped}")  # fmt: skip
        print(rss_line)
        print(fds_line)
        # Not judged: at rest the server keeps its pooled database and upstream connections,
        # which it had not opened before the load (tests/resilience/test_descriptors.py
        # compares with a warmed-up server instead).
        print(f"open fds idle before the load {fds_idle}, at rest after it {fds_rest}")
        print(f"ledger: {events} events for {answered} answered or hung-up requests; "
              f"reserved after settling {reserved}")  # fmt: skip
        ok = (
            rss_ok
            and fds_ok
            and server_errors == 0
            and not tally.errors
            and reserved == 0
            and events == answered
        )
        print("PASS" if ok else "FAIL")
        if not ok:
            print(server.log_tail(), file=sys.stderr)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

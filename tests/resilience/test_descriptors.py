"""After a burst of requests, clients hanging up mid-stream among them, `metering serve` holds
no more open file descriptors than before it: no socket, upstream connection or database
connection is leaked. The server runs in its own process so its descriptors are its own."""

import asyncio
import os
import uuid

import httpx
import pytest

from metering import migrate
from tests.budgets.conftest import (  # noqa: F401 (catalog_file, fresh_pg, serve: fixtures)
    catalog_file,
    fresh_pg,
    holds_of,
    serve,
    sim_records,
    wait_for,
)

CONCURRENCY = 20
BURST = 200
SLACK = 3  # descriptors a busy process may hold for a moment (a log write, a timer)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _traffic(url: str, key: str, tag: str, count: int) -> list[dict]:
    """count requests, CONCURRENCY at a time: a quarter answered whole, a quarter streamed to
    the end, half streamed and dropped by the client after the first bytes."""
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=60
    ) as client:

        async def one(n: int) -> dict:
            kind = ("whole", "stream", "hang-up", "hang-up")[n % 4]
            directives = "sim:chunks=20 sim:delay_ms=20" if kind == "hang-up" else ""
            body = {
                "model": "gpt-sim",
                "messages": [{"role": "user", "content": f"fd {tag}-{n} {directives}"}],
                "max_tokens": 20,
                "stream": kind != "whole",
            }
            async with (
                gate,
                client.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                if kind == "hang-up":
                    async for _ in response.aiter_raw():
                        break  # leaving the block closes the connection mid-stream
                else:
                    await response.aread()
            return {"status": response.status_code, "kind": kind}

        return await asyncio.gather(*(one(n) for n in range(count)))


@pytest.mark.postgres
def test_descriptors_return_to_baseline_after_a_burst_postgres(fresh_pg, serve, sim):  # noqa: F811
    migrate.upgrade(fresh_pg)
    server = serve(fresh_pg)
    api = server.api()
    _, _, token = api.principal()
    key, tag = token["token"], f"fd{uuid.uuid4().hex[:10]}"
    pid = server.process.pid

    # Warm up at the same concurrency: pools (database, upstream) reach their working size.
    warm = asyncio.run(_traffic(server.url, key, tag, 2 * CONCURRENCY))
    assert {r["status"] for r in warm} == {200}
    wait_for(lambda: not holds_of(fresh_pg, token["id"]), message="warm-up settled")
    baseline = open_fds(pid)

    burst = asyncio.run(_traffic(server.url, key, tag, BURST))
    assert {r["status"] for r in burst} == {200}
    wait_for(lambda: not holds_of(fresh_pg, token["id"]), timeout=30, message="every hold settled")
    # Every request, hung up or not, is one event; then the descriptors come back.
    received = sim_records(sim, tag)
    assert len(received) == 2 * CONCURRENCY + BURST
    assert len(api.events(token_id=token["id"])) == len(received)
    wait_for(
        lambda: open_fds(pid) <= baseline + SLACK,
        timeout=60,
        interval=0.5,
        message=f"descriptors back to {baseline} (+{SLACK}); now {open_fds(pid)}",
    )

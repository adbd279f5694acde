"""The floor: a bare passthrough on the proxy's own stack, with nothing of the metering in it.

    python -m bench.floor --port 8001 --upstream http://127.0.0.1:8000/openai/v1 --key sim-key
    python -m bench.floor ... --commits postgresql://127.0.0.1/some_db   # the floor with commits
    python -m bench.floor ... --commits postgresql://... --grouped       # ... written in groups

FastAPI under uvicorn with the configuration `metering serve` uses (metering.server's
server_config: the same HTTP protocol, keep-alive and limits), one pooled httpx client on the
httpx-aiohttp transport as the proxy's upstream clients are built, the collector settings of
`metering serve`, and one route,
POST /v1/chat/completions, that sends the body it received upstream unchanged and relays the
answer: the whole body, or the stream chunk by chunk as it arrives. No authentication, no
database, no parsing of the request or the answer. What the proxy costs beyond this row is the
metering's own.

With --commits, the same passthrough writes what the ledger's promises require of any design
(a request that reached an upstream is charged even if this process is killed; its event is
committed before the client sees the end of the answer), and nothing else: a row committed to
PostgreSQL before the request goes upstream (a hold: one INSERT, one round trip) and one
committed before the client gets the end of the answer (the event: one statement that deletes
the hold and inserts the event, one round trip), each on a connection from an asyncpg pool,
with asyncpg's prepared statements and PostgreSQL's default durability (the commit waits for
its WAL flush). A stream is relayed chunk by chunk as it arrives, but for the chunk that ends
it (`data: [DONE]`), relayed after the event's commit. No authentication, no budgets, no
parsing, no group commit: what ours adds beyond this row is its own code; what this row adds
beyond the floor is the two commits, PostgreSQL's and the kernel's time, which no design that
keeps those promises avoids.

With --grouped too, the holds and events are written in groups, as ours writes them: the first
one starts a statement at once on a connection kept for it; those that arrive while it runs
form the next one, holds and events together in one statement (metering.budgets.groups, the
group writer ours uses). One request per statement when they come one at a time, fewer
statements and flushes than requests when they come together.
"""

import argparse
import asyncio
import contextlib
import gc
import uuid

import aiohttp
import asyncpg
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from httpx_aiohttp import HttpxAiohttpClient
from httpx_aiohttp.transport import AiohttpTransport
from starlette.background import BackgroundTask

from metering.budgets.groups import GroupWriter, write_and_answer
from metering.cli import GC_THRESHOLD
from metering.server import server_config
from metering.settings import Settings

MAX_CONNECTIONS = 1000  # the proxy's default upstream_max_connections
RELAYED = ("content-type", "x-request-id")
POOL_SIZE = 20  # the proxy's default db_pool_size

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS floor_holds (id text PRIMARY KEY, "
    "created_at timestamptz NOT NULL DEFAULT now())",
    "CREATE TABLE IF NOT EXISTS floor_events (id text PRIMARY KEY, "
    "held_at timestamptz NOT NULL, body_bytes integer NOT NULL, "
    "created_at timestamptz NOT NULL DEFAULT now())",
)
HOLD = "INSERT INTO floor_holds (id) VALUES ($1)"
DONE = b"data: [DONE]"
# One group of holds ($1) and events ($2, their sizes $3) in one statement.
GROUP = (
    "WITH h AS (INSERT INTO floor_holds (id) SELECT unnest($1::text[])), "
    "d AS (DELETE FROM floor_holds WHERE id = ANY($2::text[]) RETURNING id, created_at) "
    "INSERT INTO floor_events (id, held_at, body_bytes) SELECT d.id, d.created_at, s.size "
    "FROM d JOIN unnest($2::text[], $3::int[]) AS s(id, size) ON s.id = d.id"
)
SETTLE = (
    "WITH h AS (DELETE FROM floor_holds WHERE id = $1 RETURNING created_at) "
    "INSERT INTO floor_events (id, held_at, body_bytes) SELECT $1, created_at, $2 FROM h"
)


def upstream_client(max_connections: int = MAX_CONNECTIONS) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=5.0)
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    transport = AiohttpTransport(limits=limits, trust_env=False, client=session)
    return HttpxAiohttpClient(transport=transport, trust_env=False, follow_redirects=False)


class Ledger:
    """A hold and an event per request, each its own statement on a pooled connection."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def hold(self, request_id: str) -> None:
        await self.pool.execute(HOLD, request_id)

    async def settle(self, request_id: str, size: int) -> None:
        await self.pool.execute(SETTLE, request_id, size)

    async def close(self) -> None:
        await self.pool.close()


class GroupedLedger(Ledger):
    """The same rows, written in groups on one connection kept for them: the holds and the
    events that arrive while a statement runs go together in the next one."""

    def __init__(self, pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
        super().__init__(pool)
        self.conn = conn
        self.groups = GroupWriter(self._write, lambda: RuntimeError("ledger closed"))

    async def hold(self, request_id: str) -> None:
        await self.groups.submit((request_id, None))

    async def settle(self, request_id: str, size: int) -> None:
        await self.groups.submit((request_id, size))

    async def _write(self, batch: list[tuple[tuple[str, int | None], asyncio.Future]]) -> None:
        await write_and_answer(batch, self._statement)

    async def _statement(self, items: list[tuple[str, int | None]]) -> None:
        holds = [rid for rid, size in items if size is None]
        settled = [(rid, size) for rid, size in items if size is not None]
        await self.conn.execute(
            GROUP, holds, [rid for rid, _ in settled], [size for _, size in settled]
        )

    async def close(self) -> None:
        await self.pool.release(self.conn)
        await super().close()


async def open_ledger(dsn: str, grouped: bool = False) -> Ledger:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=POOL_SIZE)
    async with pool.acquire() as conn:
        for statement in SCHEMA:
            await conn.execute(statement)
    if grouped:
        return GroupedLedger(pool, await pool.acquire())
    return Ledger(pool)


def create_app(
    upstream: str, key: str, commits: str | None = None, grouped: bool = False
) -> FastAPI:
    url = upstream.rstrip("/") + "/chat/completions"
    auth = f"Bearer {key}"
    client: httpx.AsyncClient | None = None
    ledger: Ledger | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        nonlocal client, ledger
        client = upstream_client()
        if commits:
            ledger = await open_ledger(commits, grouped)
        try:
            yield
        finally:
            await client.aclose()
            if ledger is not None:
                await ledger.close()

    async def settled_before_done(answer: httpx.Response, request_id: str):
        """The stream's chunks as they arrive; the one that ends it (`[DONE]`, also when split
        over two reads) after the event's commit, or the event at the end if none does."""
        tail, size, settled = b"", 0, False
        try:
            async for chunk in answer.aiter_raw():
                size += len(chunk)
                if not settled and DONE in tail + chunk:
                    await ledger.settle(request_id, size)
                    settled = True
                tail = chunk[-len(DONE) :]
                yield chunk
            if not settled:
                await ledger.settle(request_id, size)
        finally:
            await answer.aclose()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        request_id = None
        if ledger is not None:
            request_id = uuid.uuid4().hex
            await ledger.hold(request_id)
        outgoing = client.build_request(
            "POST",
            url,
            content=body,
            headers={"authorization": auth, "content-type": "application/json"},
        )
        answer = await client.send(outgoing, stream=True)
        headers = {name: answer.headers[name] for name in RELAYED if name in answer.headers}
        if request_id is not None:
            headers["x-request-id"] = request_id
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            if request_id is not None:
                return StreamingResponse(
                    settled_before_done(answer, request_id),
                    status_code=answer.status_code,
                    headers=headers,
                )
            return StreamingResponse(
                answer.aiter_raw(),
                status_code=answer.status_code,
                headers=headers,
                background=BackgroundTask(answer.aclose),
            )
        content = await answer.aread()
        await answer.aclose()
        if request_id is not None:
            await ledger.settle(request_id, len(content))
        return Response(content, status_code=answer.status_code, headers=headers)

    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the upstream's base URL (…/v1)")
    p.add_argument("--key", required=True, help="the upstream's bearer key")
    p.add_argument(
        "--commits",
        metavar="DSN",
        help="the floor with the two commits: a PostgreSQL database for its holds and events",
    )
    p.add_argument(
        "--grouped",
        action="store_true",
        help="with --commits: write the holds and events in groups, as ours does",
    )
    args = p.parse_args(argv)
    if args.grouped and not args.commits:
        p.error("--grouped needs --commits")
    app = create_app(args.upstream, args.key, args.commits, args.grouped)
    # The collector settings `metering serve` runs with (metering.cli.serving_app).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    config = server_config(app, Settings(), host=args.host, port=args.port, log_level="warning")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()

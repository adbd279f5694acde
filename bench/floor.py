"""The floor: a bare passthrough on the proxy's own stack, with nothing of the metering in it.

    python -m bench.floor --port 8001 --upstream http://127.0.0.1:8000/openai/v1 --key sim-key
    python -m bench.floor ... --commits postgresql://127.0.0.1/some_db   # the floor with commits

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
"""

import argparse
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


async def open_ledger(dsn: str) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=POOL_SIZE)
    async with pool.acquire() as conn:
        for statement in SCHEMA:
            await conn.execute(statement)
    return pool


def create_app(upstream: str, key: str, commits: str | None = None) -> FastAPI:
    url = upstream.rstrip("/") + "/chat/completions"
    auth = f"Bearer {key}"
    client: httpx.AsyncClient | None = None
    ledger: asyncpg.Pool | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        nonlocal client, ledger
        client = upstream_client()
        if commits:
            ledger = await open_ledger(commits)
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
                    await ledger.execute(SETTLE, request_id, size)
                    settled = True
                tail = chunk[-len(DONE) :]
                yield chunk
            if not settled:
                await ledger.execute(SETTLE, request_id, size)
        finally:
            await answer.aclose()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        request_id = None
        if ledger is not None:
            request_id = uuid.uuid4().hex
            await ledger.execute(HOLD, request_id)
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
            await ledger.execute(SETTLE, request_id, len(content))
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
    args = p.parse_args(argv)
    app = create_app(args.upstream, args.key, args.commits)
    # The collector settings `metering serve` runs with (metering.cli.serving_app).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    config = server_config(app, Settings(), host=args.host, port=args.port, log_level="warning")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()

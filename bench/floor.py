"""The floor: a bare passthrough on the proxy's own stack, with nothing of the metering in it.

    python -m bench.floor --port 8001 --upstream http://127.0.0.1:8000/openai/v1 --key sim-key

FastAPI under uvicorn with the configuration `metering serve` uses (metering.server's
server_config: the same HTTP protocol, keep-alive and limits), one pooled httpx client on the
httpx-aiohttp transport as the proxy's upstream clients are built, the collector settings of
`metering serve`, and one route,
POST /v1/chat/completions, that sends the body it received upstream unchanged and relays the
answer: the whole body, or the stream chunk by chunk as it arrives. No authentication, no
database, no parsing of the request or the answer. What the proxy costs beyond this row is the
metering's own.
"""

import argparse
import contextlib
import gc

import aiohttp
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


def upstream_client(max_connections: int = MAX_CONNECTIONS) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=5.0)
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    transport = AiohttpTransport(limits=limits, trust_env=False, client=session)
    return HttpxAiohttpClient(transport=transport, trust_env=False, follow_redirects=False)


def create_app(upstream: str, key: str) -> FastAPI:
    url = upstream.rstrip("/") + "/chat/completions"
    auth = f"Bearer {key}"
    client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        nonlocal client
        client = upstream_client()
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        outgoing = client.build_request(
            "POST",
            url,
            content=body,
            headers={"authorization": auth, "content-type": "application/json"},
        )
        answer = await client.send(outgoing, stream=True)
        headers = {name: answer.headers[name] for name in RELAYED if name in answer.headers}
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                answer.aiter_raw(),
                status_code=answer.status_code,
                headers=headers,
                background=BackgroundTask(answer.aclose),
            )
        content = await answer.aread()
        await answer.aclose()
        return Response(content, status_code=answer.status_code, headers=headers)

    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the upstream's base URL (…/v1)")
    p.add_argument("--key", required=True, help="the upstream's bearer key")
    args = p.parse_args(argv)
    app = create_app(args.upstream, args.key)
    # The collector settings `metering serve` runs with (metering.cli.serving_app).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    config = server_config(app, Settings(), host=args.host, port=args.port, log_level="warning")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()

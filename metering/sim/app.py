"""The simulated upstream: one Starlette app speaking every provider dialect we meter.

Each dialect follows its provider's own document, quirks included (docs/dialects.md), so
the proxy is tested against what the providers really send and refuse. The answer to a
request is decided by its prompt and `sim:` directives (see text.py), never by chance. A base URL under
`/fault/{name}/` (`SimServer.base_url(dialect, fault=name)`) fails every request on it as
`sim:fault={name}` would: a provider that is down while another is healthy.
"""

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from metering.sim.providers import (
    PROVIDERS,
    STREAM_ERROR,
    Reply,
    SimNim,
    SimProvider,
    Step,
)
from metering.sim.responses import responses
from metering.sim.text import (
    Answer,
    Directives,
    last_user_text,
    parse_directives,
    plan_answer,
    split_chunks,
)
from metering.sim.tokenizer import count_tokens

LOG_SIZE = 10_000
HANG_S = 3600.0
FAULT_STATUS = {"http500": 500, "http429": 429, "http400": 400, "nim422": 422}
CUTTING_FAULTS = ("disconnect", "stream_error")  # end a stream after fault_after chunks
STREAM_FAULTS = ("malformed", *CUTTING_FAULTS)
FAULTS = (*FAULT_STATUS, "timeout", *STREAM_FAULTS)


@dataclass
class SimSettings:
    """Defaults for every request; a request's own `sim:` directives override them."""

    chunks: int | None = None
    delay_s: float = 0.0
    nim_pending_polls: int = 0


class SimulatedDisconnect(Exception):
    """Raised after the response started, so uvicorn drops the connection."""


# --- the log --------------------------------------------------------------------------------


class SimLog:
    """The last requests, shared between the server thread and the test's thread."""

    def __init__(self) -> None:
        self._records: deque[dict] = deque(maxlen=LOG_SIZE)
        self._lock = threading.Lock()

    def add(self, record: dict) -> None:
        with self._lock:
            self._records.append(record)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [dict(record) for record in self._records]

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


def _new_record(reply_id: str, dialect: str, body: object, request: Request) -> dict:
    headers = {k.lower(): v for k, v in request.headers.items() if k.lower() != "authorization"}
    return {
        "id": reply_id,
        "dialect": dialect,
        "received": body,
        "path": request.url.path,
        "headers": headers,
        "stream": isinstance(body, dict) and body.get("stream") is True,
        "status": None,
        "usage": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "cached_tokens": None,
        "reasoning_tokens": None,
        "content": None,
        "reasoning": None,
        "delivered_chunks": 0,
        "delivered_completion_tokens": 0,
        "completed": False,
        "fault": None,
        # When the request arrived and (for a stream) when its last byte was sent: monotonic
        # seconds, to see how many requests were at the upstream at once.
        "opened_at": time.monotonic(),
        "closed_at": None,
    }


def _record_answer(record: dict, answer: Answer) -> None:
    record.update(
        prompt_tokens=answer.prompt_tokens,
        completion_tokens=answer.completion_tokens,
        cached_tokens=answer.cached_tokens,
        reasoning_tokens=answer.reasoning_tokens,
        content=answer.content,
        reasoning=answer.reasoning,
    )


# --- streaming ------------------------------------------------------------------------------


@dataclass
class Exchange:
    """Everything one chat request's answer depends on."""

    provider: SimProvider
    reply: Reply
    answer: Answer
    directives: Directives
    settings: SimSettings
    record: dict
    # `sim:usage=<JSON>`: the usage object to report, verbatim (any number, however wrong).
    usage_raw: str | None = None
    # `sim:invalid_utf8=1`: a non-streamed answer's content starts with bytes that are not UTF-8.
    invalid_utf8: bool = False

    @property
    def chunks(self) -> int | None:
        return self.directives.chunks or self.settings.chunks

    @property
    def delay_s(self) -> float:
        if self.directives.delay_ms is not None:
            return self.directives.delay_ms / 1000
        return self.settings.delay_s

    def steps(self) -> list[Step]:
        reasoning = split_chunks(self.answer.reasoning, self.chunks)
        content = split_chunks(self.answer.content, self.chunks)
        if self.answer.tool_call is not None:
            return tool_call_steps(self.answer.tool_call, self.chunks)
        return self.provider.steps(reasoning, content, self.answer.finish_reason)

    def usage_of(self, steps: list[Step]) -> dict:
        """Usage of the steps sent: all of them, or those before a mid-stream error."""
        completion = sum(count_tokens(step.text) for step in steps)
        reasoning = sum(count_tokens(step.text) for step in steps if step.kind == "reasoning")
        return self.provider.usage(self.answer, completion, reasoning)


class Framer:
    """SSE framing; CRLF line ends and keep-alive comments exercise the client's parser."""

    def __init__(self, directives: Directives) -> None:
        self.line_end = "\r\n" if directives.crlf else "\n"
        self.comments = directives.comments

    def event(self, data: str) -> str:
        comment = f": keep-alive{self.line_end * 2}" if self.comments else ""
        return f"{comment}data: {data}{self.line_end * 2}"

    def chunk(self, payload: dict) -> str:
        return self.event(json.dumps(payload))


def _fault_cut(steps: list[Step], fault_after: int) -> int:
    """Where a mid-stream fault strikes: before the (fault_after+1)-th content chunk."""
    content_at = [index for index, step in enumerate(steps) if step.kind == "content"]
    if fault_after < len(content_at):
        return content_at[fault_after]
    return content_at[-1] + 1 if content_at else len(steps)


async def _stream(exchange: Exchange) -> AsyncIterator[str]:
    """The SSE body; the record follows each chunk as the server takes it."""
    record = exchange.record
    fault = exchange.directives.fault
    framer = Framer(exchange.directives)
    sent = exchange.steps()
    if fault in CUTTING_FAULTS:
        sent = sent[: _fault_cut(sent, exchange.directives.fault_after)]
    try:
        async for event in _events(exchange, sent, framer):
            yield event
    finally:
        record["closed_at"] = time.monotonic()


async def _events(exchange: Exchange, sent: list[Step], framer: Framer) -> AsyncIterator[str]:
    provider, reply, record = exchange.provider, exchange.reply, exchange.record
    fault = exchange.directives.fault
    for index, step in enumerate(sent):
        if index:
            await asyncio.sleep(exchange.delay_s)
        choice = {"index": 0, "delta": step.delta, "finish_reason": step.finish_reason}
        yield framer.chunk(provider.chunk(reply, [choice]))
        record["delivered_chunks"] += step.kind == "content"
        record["delivered_completion_tokens"] += count_tokens(step.text)
        if index == 0 and fault == "malformed":
            yield framer.event("{not json")
    if fault == "disconnect":
        raise SimulatedDisconnect
    billed = fault != "stream_error" or provider.bills_partial_streams
    if billed and provider.streams_usage(reply):
        usage = exchange.usage_of(sent)
        chunk = {**provider.chunk(reply, []), "usage": usage}
        if exchange.usage_raw is None:
            yield framer.chunk(chunk)
        else:
            yield framer.event(_with_raw_usage(chunk, exchange.usage_raw).decode())
        record["usage"] = usage
    if fault == "stream_error":
        yield framer.chunk({"error": STREAM_ERROR})
    yield framer.event("[DONE]")
    record["completed"] = fault != "stream_error"


# --- answering ------------------------------------------------------------------------------


def _value(schema: object) -> object:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(
        kind if isinstance(kind, str) else "", "sim"
    )


def planned_call(body: dict, directives: Directives, provider: SimProvider) -> tuple | None:
    """A function call, where the dialect takes tools: the one `sim:tool=NAME` names, or the
    first tool when tool_choice requires one (a named choice: that one); never in answer to a
    tool's output."""
    tools = body.get("tools")
    if not tools or "tools" not in provider.rules.params or body.get("tool_choice") == "none":
        return None
    if body["messages"][-1].get("role") == "tool":
        return None
    choice = body.get("tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
    elif directives.tool is not None and directives.tool in names:
        name = directives.tool
    elif choice == "required":
        name = names[0]
    else:
        return None
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    properties = (function.get("parameters") or {}).get("properties") or {}
    arguments = json.dumps({key: _value(spec) for key, spec in properties.items()})
    return ("call_" + uuid.uuid4().hex[:24], name, arguments)


def tool_call_steps(call: tuple[str, str, str], chunks: int | None) -> list[Step]:
    """A function call streamed as OpenAI streams one: its id and name first, then its
    arguments in pieces, then finish_reason tool_calls."""
    call_id, name, arguments = call
    first = {
        "index": 0,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    steps = [
        Step({"role": "assistant", "content": None}),
        Step({"tool_calls": [first]}, kind="content", text=name),
    ]
    for piece in split_chunks(arguments, chunks):
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        steps.append(Step(delta, kind="content", text=piece))
    steps.append(Step({}, "tool_calls"))
    return steps


@dataclass
class Pending:
    """A NIM answer held back until it has been polled for."""

    polls_left: int
    payload: dict
    record: dict


class DroppedResponse(JSONResponse):
    """Half the body under the full content-length, then the connection drops."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        half = self.body[: len(self.body) // 2]
        await send({"type": "http.response.body", "body": half, "more_body": True})
        raise SimulatedDisconnect


def _max_tokens(body: dict) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _has_bearer(request: Request) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip())


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:
        return None


async def _client_left_within(request: Request, seconds: float) -> bool:
    """Stalls like a hung upstream, but stops as soon as the client has gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.05)
    return False


def _deliver(record: dict, payload: dict) -> None:
    record.update(
        status=200,
        usage=payload["usage"],
        delivered_chunks=1,
        delivered_completion_tokens=record["completion_tokens"],
        completed=True,
    )


def _nim_headers(request_id: str, status: str) -> dict[str, str]:
    return {"NVCF-REQID": request_id, "NVCF-STATUS": status}


def _failed(exchange: Exchange, status: int) -> JSONResponse:
    response = exchange.provider.error(status, f"simulated fault {exchange.directives.fault}")
    if status == 429:
        response.headers["retry-after"] = "1"
    exchange.record["status"] = status
    return response


def _broken_body(exchange: Exchange) -> Response:
    """A non-streamed answer cut by a mid-answer fault."""
    fault, record = exchange.directives.fault, exchange.record
    if fault == "malformed":
        record["status"] = 200
        return Response('{"id": "x", "choices": [', media_type="application/json")
    if fault == "disconnect":
        record["status"] = 200
        return DroppedResponse(exchange.provider.completion(exchange.reply, exchange.answer))
    # Without a stream to break, a failure during generation surfaces as a 500.
    return _failed(exchange, 500)


def _usage_override(text: str) -> str | None:
    """The raw JSON after `sim:usage=`, or None. Numbers stay as written (no conversion)."""
    at = text.find("sim:usage=")
    if at < 0:
        return None
    start = at + len("sim:usage=")
    try:
        _, end = json.JSONDecoder(parse_int=str, parse_float=str).raw_decode(text, start)
    except ValueError:
        return None
    return text[start:end]


def _with_raw_usage(payload: dict, usage_raw: str, invalid_utf8: bool = False) -> bytes:
    body = json.dumps({**payload, "usage": "\x00usage"}).encode()
    body = body.replace(b'"\\u0000usage"', usage_raw.encode())
    if invalid_utf8:
        body = body.replace(b'"content": "', b'"content": "\xff\xfe', 1)
    return body


def _complete(request: Request, exchange: Exchange) -> Response:
    payload = exchange.provider.completion(exchange.reply, exchange.answer)
    if exchange.usage_raw is not None or exchange.invalid_utf8:
        _deliver(exchange.record, payload)
        usage_raw = exchange.usage_raw or json.dumps(payload.get("usage"))
        body = _with_raw_usage(payload, usage_raw, exchange.invalid_utf8)
        return Response(body, media_type="application/json")
    if not isinstance(exchange.provider, SimNim):
        _deliver(exchange.record, payload)
        return JSONResponse(payload)
    request_id = str(uuid.uuid4())
    polls = exchange.directives.pending
    polls = exchange.settings.nim_pending_polls if polls is None else polls
    if polls > 0:
        # The 202 counts as the first of the `polls` pending answers.
        request.app.state.pending[request_id] = Pending(polls - 1, payload, exchange.record)
        exchange.record["status"] = 202
        headers = _nim_headers(request_id, "pending-evaluation")
        return JSONResponse({}, status_code=202, headers=headers)
    _deliver(exchange.record, payload)
    return JSONResponse(payload, headers=_nim_headers(request_id, "fulfilled"))


async def _respond(request: Request, exchange: Exchange) -> Response:
    if exchange.directives.wait_ms:
        await asyncio.sleep(exchange.directives.wait_ms / 1000)
    fault = exchange.directives.fault
    if fault in FAULT_STATUS:
        return _failed(exchange, FAULT_STATUS[fault])
    if fault == "timeout" and await _client_left_within(request, HANG_S):
        return Response(status_code=204)
    if exchange.record["stream"]:
        exchange.record["status"] = 200
        headers = {"cache-control": "no-cache"}
        return StreamingResponse(_stream(exchange), media_type="text/event-stream", headers=headers)
    if fault in STREAM_FAULTS:
        return _broken_body(exchange)
    return _complete(request, exchange)


# --- routes ---------------------------------------------------------------------------------

_OPENAI = PROVIDERS["openai"]


async def chat(request: Request) -> Response:
    name = request.path_params["dialect"]
    if name not in PROVIDERS:
        return _OPENAI.error(404, f"no dialect {name!r}")
    if not _has_bearer(request):
        return _OPENAI.error(401, "missing bearer token")
    provider = PROVIDERS[name]
    body = await _read_json(request)
    record = _new_record(provider.new_id(), name, body, request)
    request.app.state.log.add(record)
    problem = provider.validate(body) if isinstance(body, dict) else "body must be a JSON object"
    if problem:
        record["status"] = provider.invalid_status
        return provider.error(provider.invalid_status, problem)
    directives = parse_directives(last_user_text(body["messages"]))
    if "fault" in request.path_params:
        # /fault/{name}/...: every request on this base URL fails the same way.
        directives = replace(directives, fault=request.path_params["fault"])
    if directives.fault is not None and directives.fault not in FAULTS:
        record["status"] = 400
        return provider.error(400, f"unknown sim fault {directives.fault!r}")
    answer = plan_answer(
        body["messages"],
        _max_tokens(body),
        directives,
        reasons=provider.reasons,
        caches=provider.caches,
    )
    call = planned_call(body, directives, provider)
    if call is not None:
        answer = replace(
            answer, content="", reasoning="", finish_reason="tool_calls", tool_call=call
        )
    _record_answer(record, answer)
    record["fault"] = directives.fault
    reply = Reply(
        id=record["id"],
        model=provider.response_model(body.get("model") or ""),
        created=int(time.time()),
        include_usage=_include_usage(body),
        started=time.monotonic(),
    )
    settings = request.app.state.settings
    text = last_user_text(body["messages"])
    exchange = Exchange(provider, reply, answer, directives, settings, record)
    exchange.usage_raw = _usage_override(text)
    exchange.invalid_utf8 = "sim:invalid_utf8=1" in text
    return await _respond(request, exchange)


async def models(request: Request) -> Response:
    name = request.path_params["dialect"]
    if name not in PROVIDERS:
        return _OPENAI.error(404, f"no dialect {name!r}")
    if not _has_bearer(request):
        return _OPENAI.error(401, "missing bearer token")
    data = [
        {"id": model, "object": "model", "created": 1767225600, "owned_by": name}
        for model in PROVIDERS[name].models
    ]
    return JSONResponse({"object": "list", "data": data})


async def nim_status(request: Request) -> Response:
    if not _has_bearer(request):
        return _OPENAI.error(401, "missing bearer token")
    request_id = request.path_params["request_id"]
    pending = request.app.state.pending.get(request_id)
    if pending is None:
        return PROVIDERS["nim"].error(404, f"no pending request {request_id}")
    if pending.polls_left > 0:
        pending.polls_left -= 1
        return JSONResponse(
            {}, status_code=202, headers=_nim_headers(request_id, "pending-evaluation")
        )
    del request.app.state.pending[request_id]
    _deliver(pending.record, pending.payload)
    return JSONResponse(pending.payload, headers=_nim_headers(request_id, "fulfilled"))


async def sim_log(request: Request) -> Response:
    if request.method == "DELETE":
        request.app.state.log.clear()
        return Response(status_code=204)
    return JSONResponse(request.app.state.log.snapshot())


class _HideSimulatedDisconnects(logging.Filter):
    """uvicorn logs the exception that drops a connection; here the drop is the point."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        return not isinstance(error, SimulatedDisconnect)


def _hide_simulated_disconnects() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _HideSimulatedDisconnects) for f in logger.filters):
        logger.addFilter(_HideSimulatedDisconnects())


def create_sim_app(settings: SimSettings | None = None) -> Starlette:
    _hide_simulated_disconnects()
    app = Starlette(
        routes=[
            Route("/_sim/log", sim_log, methods=["GET", "DELETE"]),
            Route("/nim/v2/nvcf/pexec/status/{request_id}", nim_status, methods=["GET"]),
            Route("/{dialect}/v1/chat/completions", chat, methods=["POST"]),
            Route("/{dialect}/v1/responses", responses, methods=["POST"]),
            Route("/{dialect}/v1/models", models, methods=["GET"]),
            # A provider that always fails: as if every request said sim:fault={fault}.
            Route(
                "/fault/{fault}/nim/v2/nvcf/pexec/status/{request_id}", nim_status, methods=["GET"]
            ),
            Route("/fault/{fault}/{dialect}/v1/chat/completions", chat, methods=["POST"]),
            Route("/fault/{fault}/{dialect}/v1/models", models, methods=["GET"]),
        ]
    )
    app.state.settings = settings or SimSettings()
    app.state.log = SimLog()
    app.state.pending = {}
    return app


# --- the server -----------------------------------------------------------------------------


class SimServer:
    """Runs the sim app with uvicorn in a background thread on a loopback port."""

    def __init__(
        self, settings: SimSettings | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.app = create_sim_app(settings)
        self.host = host
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port: int = self._socket.getsockname()[1]
        # log_config=None: leave the host process's logging as it is.
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def start(self) -> "SimServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the simulated upstream did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> "SimServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def base_url(self, dialect: str, fault: str | None = None) -> str:
        """The dialect's base URL; with `fault`, one where every request fails that way."""
        prefix = f"/fault/{fault}" if fault else ""
        return f"http://{self.host}:{self.port}{prefix}/{dialect}/v1"

    def log(self) -> list[dict]:
        return self.app.state.log.snapshot()

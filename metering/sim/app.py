"""The simulated upstream: one Starlette app speaking every provider dialect we meter.

Each dialect follows its provider's document (the seeds), quirks included, so the
proxy is tested against what the providers really send. The answer to a request is
decided by its prompt and `sim:` directives (see text.py), never by chance. A base URL under
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

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from metering.sim.text import (
    Answer,
    Directives,
    last_user_text,
    parse_directives,
    plan_answer,
    split_chunks,
)
from metering.sim.tokenizer import count_tokens

DIALECTS = ("openai", "exascale", "genesis", "tokenchange", "nim")
LOG_SIZE = 10_000
HANG_S = 3600.0
NIM_FUNCTION_ID = "da9660c1-f121-46f7-ae2a-9ae22b727284"
FAULT_STATUS = {"http500": 500, "http429": 429, "http400": 400, "nim422": 422}
CUTTING_FAULTS = ("disconnect", "stream_error")  # end a stream after fault_after chunks
STREAM_FAULTS = ("malformed", *CUTTING_FAULTS)
FAULTS = (*FAULT_STATUS, "timeout", *STREAM_FAULTS)
STREAM_ERROR = {"message": "upstream stream interrupted", "type": "server_error"}


@dataclass
class SimSettings:
    """Defaults for every request; a request's own `sim:` directives override them."""

    chunks: int | None = None
    delay_s: float = 0.0
    nim_pending_polls: int = 0


class SimulatedDisconnect(Exception):
    """Raised after the response started, so uvicorn drops the connection."""


# --- dialects -------------------------------------------------------------------------------


@dataclass
class Reply:
    """One answer on its way out: what the dialects need to shape its bodies."""

    id: str
    model: str
    created: int
    include_usage: bool
    started: float
    ttft_ms: int | None = None


@dataclass(frozen=True)
class Step:
    """One stream chunk's choice: its delta, and the generated text it carries."""

    delta: dict
    finish_reason: str | None = None
    kind: str | None = None  # "reasoning", "content" or None
    text: str = ""


class Dialect:
    """The plain OpenAI-compatible shape; each provider below states how it differs."""

    models: tuple[str, ...] = ()
    roles = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
    reasons = True  # sim:reasoning yields reasoning_content
    caches = False  # sim:cached shows as prompt_tokens_details.cached_tokens
    requires_model = True
    invalid_status = 400
    bills_partial_streams = False
    error_kinds = {
        400: ("invalid_request_error", "invalid_request"),
        401: ("invalid_request_error", "invalid_api_key"),
        404: ("invalid_request_error", "not_found"),
        422: ("invalid_request_error", "unprocessable_entity"),
        429: ("rate_limit_error", "rate_limit_exceeded"),
        500: ("server_error", "internal_error"),
    }

    def new_id(self) -> str:
        return "chatcmpl-" + uuid.uuid4().hex[:24]

    def response_model(self, requested: str) -> str:
        return requested

    def validate(self, body: dict) -> str | None:
        return _check_common(body, self.roles, self.requires_model)

    def error(self, status: int, message: str) -> JSONResponse:
        kind, code = self.error_kinds[status]
        error = {"message": message, "type": kind, "param": None, "code": code}
        return JSONResponse({"error": error}, status_code=status)

    def streams_usage(self, reply: Reply) -> bool:
        return reply.include_usage

    def usage(self, answer: Answer, completion_tokens: int, reasoning_tokens: int) -> dict:
        prompt_tokens = answer.prompt_tokens
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def message(self, answer: Answer) -> dict:
        message = {"role": "assistant", "content": answer.content}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        return message

    def completion(self, reply: Reply, answer: Answer) -> dict:
        choice = {
            "index": 0,
            "message": self.message(answer),
            "finish_reason": answer.finish_reason,
        }
        return {
            "id": reply.id,
            "object": "chat.completion",
            "created": reply.created,
            "model": reply.model,
            "choices": [choice],
            "usage": self.usage(answer, answer.completion_tokens, answer.reasoning_tokens),
        }

    def steps(self, reasoning: list[str], content: list[str], finish: str) -> list[Step]:
        return [
            Step({"role": "assistant", "content": ""}),
            *(Step({"reasoning_content": text}, kind="reasoning", text=text) for text in reasoning),
            *(Step({"content": text}, kind="content", text=text) for text in content),
            Step({}, finish),
        ]

    def chunk(self, reply: Reply, choices: list[dict]) -> dict:
        return {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }


class OpenAIDialect(Dialect):
    """OpenAI itself: fingerprints, logprobs and the full usage details."""

    models = ("MiniMaxAI/MiniMax-M2.5",)
    caches = True

    def usage(self, answer: Answer, completion_tokens: int, reasoning_tokens: int) -> dict:
        return {
            **super().usage(answer, completion_tokens, reasoning_tokens),
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    def message(self, answer: Answer) -> dict:
        return {**super().message(answer), "refusal": None}

    def completion(self, reply: Reply, answer: Answer) -> dict:
        completion = {**super().completion(reply, answer), "system_fingerprint": "fp_sim"}
        completion["choices"][0]["logprobs"] = None
        return completion

    def chunk(self, reply: Reply, choices: list[dict]) -> dict:
        chunk = {
            **super().chunk(reply, [{**choice, "logprobs": None} for choice in choices]),
            "system_fingerprint": "fp_sim",
        }
        # Once usage is asked for, OpenAI sends "usage": null on every other chunk.
        return {**chunk, "usage": None} if reply.include_usage else chunk


class ExascaleDialect(Dialect):
    """MiniMax on Exascale: named messages, reasoning details, sla_metrics, usage always."""

    models = ("MiniMaxAI/MiniMax-M2.1",)
    model_name = "MiniMax AI"

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def response_model(self, requested: str) -> str:
        # The document's sample answers "MiniMaxAI/MiniMax-M2.1" with "minimax/minimax-m2.1".
        return requested.lower().replace("minimaxai/", "minimax/")

    def streams_usage(self, reply: Reply) -> bool:
        return True

    def usage(self, answer: Answer, completion_tokens: int, reasoning_tokens: int) -> dict:
        # text_tokens is 0 in the document's sample although its answer has text.
        details = {
            "text_tokens": 0,
            "reasoning_tokens": reasoning_tokens,
            "audio_tokens": 0,
            "image_tokens": 0,
            "video_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        }
        return {
            **super().usage(answer, completion_tokens, reasoning_tokens),
            "completion_tokens_details": details,
            "prompt_tokens_details": None,
        }

    def message(self, answer: Answer) -> dict:
        message = {**super().message(answer), "name": self.model_name}
        if answer.reasoning:
            message["reasoning_details"] = [_reasoning_detail(answer.reasoning)]
        return message

    def completion(self, reply: Reply, answer: Answer) -> dict:
        return {**super().completion(reply, answer), "system_fingerprint": ""}

    def steps(self, reasoning: list[str], content: list[str], finish: str) -> list[Step]:
        # As in the document: every delta repeats the role, only the first reasoning delta
        # has reasoning_details, and the last reasoning chunk already has a finish_reason.
        steps = []
        for index, text in enumerate(reasoning):
            delta = {"role": "assistant", "reasoning_content": text}
            if index == 0:
                delta["reasoning_details"] = [_reasoning_detail(text)]
            last = index == len(reasoning) - 1
            steps.append(Step(delta, finish if last else None, "reasoning", text))
        for index, text in enumerate(content):
            last = index == len(content) - 1
            delta = {"content": text, "role": "assistant"}
            steps.append(Step(delta, finish if last else None, "content", text))
        return steps

    def chunk(self, reply: Reply, choices: list[dict]) -> dict:
        if reply.ttft_ms is None:
            reply.ttft_ms = round((time.monotonic() - reply.started) * 1000)
        return {
            **super().chunk(reply, choices),
            "system_fingerprint": "",
            "sla_metrics": {"ttft_ms": reply.ttft_ms, "ts_us": time.time_ns() // 1000},
        }


class GenesisDialect(Dialect):
    """Genesis: text blocks checked, usage without details, streams without id or usage."""

    models = ("MiniMax-M2.5",)
    roles = frozenset({"system", "user", "assistant"})
    reasons = False

    def validate(self, body: dict) -> str | None:
        return super().validate(body) or _check_text_blocks(body["messages"])

    def error(self, status: int, message: str) -> JSONResponse:
        code = {429: "rate_limit", 500: "server_error"}.get(status, "invalid_request")
        return JSONResponse(
            {"error": {"message": message, "type": code, "code": code}}, status_code=status
        )

    def streams_usage(self, reply: Reply) -> bool:
        return False

    def completion(self, reply: Reply, answer: Answer) -> dict:
        completion = super().completion(reply, answer)
        del completion["created"]
        return completion

    def steps(self, reasoning: list[str], content: list[str], finish: str) -> list[Step]:
        return [
            *(Step({"content": text}, kind="content", text=text) for text in content),
            Step({}, finish),
        ]

    def chunk(self, reply: Reply, choices: list[dict]) -> dict:
        return {"object": "chat.completion.chunk", "choices": choices}


class TokenChangeDialect(Dialect):
    """TokenChange: streams only; usage on request, with cached tokens."""

    models = ("minimax/minimax-m2.5",)
    caches = True
    bills_partial_streams = True  # "Output delivered before the error is billed."

    def validate(self, body: dict) -> str | None:
        problem = super().validate(body)
        if problem is None and body.get("stream") is not True:
            return "stream must be true"
        return problem

    def usage(self, answer: Answer, completion_tokens: int, reasoning_tokens: int) -> dict:
        usage = {
            **super().usage(answer, completion_tokens, reasoning_tokens),
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
        }
        # Fields of the serving endpoint pass through; reasoning endpoints add this one.
        if reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def steps(self, reasoning: list[str], content: list[str], finish: str) -> list[Step]:
        # The role rides on the first delta and finish_reason on the last, as documented.
        steps = super().steps(reasoning, content, finish)[1:-1]
        steps[0] = replace(steps[0], delta={"role": "assistant", **steps[0].delta})
        steps[-1] = replace(steps[-1], finish_reason=finish)
        return steps


class NimDialect(Dialect):
    """NVIDIA NIM on NVCF: schema-checked requests, problem details, 202 and polling."""

    models = ("minimaxai/minimax-m2.5",)
    roles = frozenset({"system", "user", "assistant"})
    reasons = False
    requires_model = False
    invalid_status = 422
    problems = {
        400: ("bad-request", "Bad Request"),
        401: ("unauthorized", "Unauthorized"),
        404: ("not-found", "Not Found"),
        422: ("unprocessable-entity", "Unprocessable Entity"),
        429: ("too-many-requests", "Too Many Requests"),
        500: ("internal-server-error", "Internal Server Error"),
    }

    def new_id(self) -> str:
        return str(uuid.uuid4())

    def response_model(self, requested: str) -> str:
        return requested or self.models[0]

    def validate(self, body: dict) -> str | None:
        return super().validate(body) or _check_nim(body)

    def error(self, status: int, message: str) -> JSONResponse:
        slug, title = self.problems[status]
        problem = {
            "type": f"urn:nvcf-worker-service:problem-details:{slug}",
            "title": title,
            "status": status,
            "detail": message,
            "instance": f"/v2/nvcf/pexec/functions/{NIM_FUNCTION_ID}",
            "requestId": str(uuid.uuid4()),
        }
        return JSONResponse(problem, status_code=status)


SHAPES: dict[str, Dialect] = {
    "openai": OpenAIDialect(),
    "exascale": ExascaleDialect(),
    "genesis": GenesisDialect(),
    "tokenchange": TokenChangeDialect(),
    "nim": NimDialect(),
}


def _reasoning_detail(text: str) -> dict:
    return {
        "type": "reasoning.text",
        "text": text,
        "id": "reasoning-text-1",
        "format": "openai-responses-v1",
        "index": 0,
    }


# --- request checks -------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_common(body: dict, roles: frozenset[str], requires_model: bool) -> str | None:
    if requires_model and not isinstance(body.get("model"), str):
        return "missing required parameter: model"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for message in messages:
        if not isinstance(message, dict):
            return "each message must be an object"
        if message.get("role") not in roles:
            return f"unsupported role: {message.get('role')!r}"
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None and not _is_count(body[name]):
            return f"{name} must be a positive integer"
    return None


def _check_text_blocks(messages: list[dict]) -> str | None:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for block in content:
                if not isinstance(block, dict) or block.get("type") != "text":
                    return "content blocks must have type text"
                if not isinstance(block.get("text"), str) or not block["text"]:
                    return "text blocks must have nonempty text"
        elif content is not None and not isinstance(content, str):
            return "content must be a string or a list of text blocks"
    return None


_NIM_RANGES = {
    # name: (minimum, maximum, minimum excluded)
    "temperature": (0, 1, False),
    "top_p": (0, 1, True),
    "frequency_penalty": (-2, 2, False),
    "presence_penalty": (-2, 2, False),
}


def _check_nim(body: dict) -> str | None:
    for name, (low, high, low_excluded) in _NIM_RANGES.items():
        if name not in body:
            continue
        value = body[name]
        if not _is_number(value) or value > high or value < low or (low_excluded and value == low):
            return f"{name} must be a number in {'(' if low_excluded else '['}{low}, {high}]"
    if (body.get("max_tokens") or 0) > 16384:
        return "max_tokens must be an integer in [1, 16384]"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "stream must be a boolean"
    messages = body["messages"]
    if any(message["role"] == "system" for message in messages[1:]):
        return "a system message must be the very first message"
    for message in messages:
        if "content" not in message or not isinstance(message["content"], str | None):
            return "message content must be a string or null"
    return None


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

    dialect: Dialect
    reply: Reply
    answer: Answer
    directives: Directives
    settings: SimSettings
    record: dict

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
        return self.dialect.steps(reasoning, content, self.answer.finish_reason)

    def usage_of(self, steps: list[Step]) -> dict:
        """Usage of the steps sent: all of them, or those before a mid-stream error."""
        completion = sum(count_tokens(step.text) for step in steps)
        reasoning = sum(count_tokens(step.text) for step in steps if step.kind == "reasoning")
        return self.dialect.usage(self.answer, completion, reasoning)


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
    dialect, reply, record = exchange.dialect, exchange.reply, exchange.record
    fault = exchange.directives.fault
    framer = Framer(exchange.directives)
    sent = exchange.steps()
    if fault in CUTTING_FAULTS:
        sent = sent[: _fault_cut(sent, exchange.directives.fault_after)]
    for index, step in enumerate(sent):
        if index:
            await asyncio.sleep(exchange.delay_s)
        choice = {"index": 0, "delta": step.delta, "finish_reason": step.finish_reason}
        yield framer.chunk(dialect.chunk(reply, [choice]))
        record["delivered_chunks"] += step.kind == "content"
        record["delivered_completion_tokens"] += count_tokens(step.text)
        if index == 0 and fault == "malformed":
            yield framer.event("{not json")
    if fault == "disconnect":
        raise SimulatedDisconnect
    billed = fault != "stream_error" or dialect.bills_partial_streams
    if billed and dialect.streams_usage(reply):
        usage = exchange.usage_of(sent)
        yield framer.chunk({**dialect.chunk(reply, []), "usage": usage})
        record["usage"] = usage
    if fault == "stream_error":
        yield framer.chunk({"error": STREAM_ERROR})
    yield framer.event("[DONE]")
    record["completed"] = fault != "stream_error"


# --- answering ------------------------------------------------------------------------------


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


async def _read_json(request: Request) -> object:
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
    response = exchange.dialect.error(status, f"simulated fault {exchange.directives.fault}")
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
        return DroppedResponse(exchange.dialect.completion(exchange.reply, exchange.answer))
    # Without a stream to break, a failure during generation surfaces as a 500.
    return _failed(exchange, 500)


def _complete(request: Request, exchange: Exchange) -> Response:
    payload = exchange.dialect.completion(exchange.reply, exchange.answer)
    if not isinstance(exchange.dialect, NimDialect):
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

_OPENAI = SHAPES["openai"]


async def chat(request: Request) -> Response:
    name = request.path_params["dialect"]
    if name not in SHAPES:
        return _OPENAI.error(404, f"no dialect {name!r}")
    if not _has_bearer(request):
        return _OPENAI.error(401, "missing bearer token")
    dialect = SHAPES[name]
    body = await _read_json(request)
    record = _new_record(dialect.new_id(), name, body, request)
    request.app.state.log.add(record)
    problem = dialect.validate(body) if isinstance(body, dict) else "body must be a JSON object"
    if problem:
        record["status"] = dialect.invalid_status
        return dialect.error(dialect.invalid_status, problem)
    directives = parse_directives(last_user_text(body["messages"]))
    if "fault" in request.path_params:
        # /fault/{name}/...: every request on this base URL fails the same way.
        directives = replace(directives, fault=request.path_params["fault"])
    if directives.fault is not None and directives.fault not in FAULTS:
        record["status"] = 400
        return dialect.error(400, f"unknown sim fault {directives.fault!r}")
    answer = plan_answer(
        body["messages"],
        _max_tokens(body),
        directives,
        reasons=dialect.reasons,
        caches=dialect.caches,
    )
    _record_answer(record, answer)
    record["fault"] = directives.fault
    reply = Reply(
        id=record["id"],
        model=dialect.response_model(body.get("model") or ""),
        created=int(time.time()),
        include_usage=_include_usage(body),
        started=time.monotonic(),
    )
    settings = request.app.state.settings
    return await _respond(request, Exchange(dialect, reply, answer, directives, settings, record))


async def models(request: Request) -> Response:
    name = request.path_params["dialect"]
    if name not in SHAPES:
        return _OPENAI.error(404, f"no dialect {name!r}")
    if not _has_bearer(request):
        return _OPENAI.error(401, "missing bearer token")
    data = [
        {"id": model, "object": "model", "created": 1767225600, "owned_by": name}
        for model in SHAPES[name].models
    ]
    return JSONResponse({"object": "list", "data": data})


async def nim_status(request: Request) -> Response:
    if not _has_bearer(request):
        return _OPENAI.error(401, "missing bearer token")
    request_id = request.path_params["request_id"]
    pending = request.app.state.pending.get(request_id)
    if pending is None:
        return SHAPES["nim"].error(404, f"no pending request {request_id}")
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

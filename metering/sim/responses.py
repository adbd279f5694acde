"""The simulator's Responses API (`POST /openai/v1/responses`): what a provider that serves the
Responses API itself answers, for the proxy's native pass-through (a provider with
`responses = true`). As strict as OpenAI's for what it takes: unknown parameters, chat-shaped
tools and hosted tools are refused with a 400."""

import asyncio
import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from metering.sim.text import parse_directives, plan_answer, split_chunks
from metering.sim.tokenizer import count_tokens, message_text

PARAMS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "stream",
        "store",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "metadata",
        "user",
        "safety_identifier",
        "include",
        "prompt_cache_key",
        "truncation",
        "service_tier",
        "previous_response_id",
        "stream_options",
    }
)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    return JSONResponse(body, status_code=status)


def problem(body: Any) -> tuple[str, str | None] | None:
    if not isinstance(body, dict):
        return "body must be a JSON object", None
    for key in body:
        if key not in PARAMS:
            return f"Unknown parameter: '{key}'.", key
    if not isinstance(body.get("model"), str):
        return "Missing required parameter: 'model'.", "model"
    items = body.get("input")
    if not isinstance(items, str | list):
        return "Missing required parameter: 'input'.", "input"
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            return f"Invalid type for 'input[{i}]'.", f"input[{i}]"
        kind = item.get("type", "message")
        if kind not in ("message", "function_call", "function_call_output", "reasoning"):
            return f"Invalid value: '{kind}'.", f"input[{i}].type"
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"Invalid value for 'tools[{i}].type'.", f"tools[{i}].type"
        if "function" in tool or not isinstance(tool.get("name"), str):
            return f"Missing required parameter: 'tools[{i}].name'.", f"tools[{i}].name"
    return None


def messages_of(body: dict) -> list[dict]:
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = (
        [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    )
    for item in items:
        if item.get("type", "message") == "message":
            messages.append(
                {"role": item.get("role"), "content": message_text(_text(item.get("content")))}
            )
        elif item.get("type") == "function_call_output":
            messages.append({"role": "tool", "content": str(item.get("output"))})
    return messages


def _text(content: Any) -> Any:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def _usage(prompt: int, cached: int, output: int, reasoning: int) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    }


def _response(rid: str, body: dict, status: str, output: list, usage: dict | None) -> dict:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "usage": usage,
        "store": body.get("store", True),
    }


async def responses(request: Request) -> Response:
    """POST /{dialect}/v1/responses: the openai dialect only."""
    from metering.sim.app import _has_bearer, _new_record

    if request.path_params["dialect"] != "openai":
        return error(404, "this dialect has no Responses API")
    if not _has_bearer(request):
        return error(401, "missing bearer token")
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    rid = "resp_" + uuid.uuid4().hex
    record = _new_record(rid, "openai-responses", body, request)
    request.app.state.log.add(record)
    found = problem(body)
    if found is not None:
        record["status"] = 400
        return error(400, *found)
    messages = messages_of(body)
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "") or ""
    directives = parse_directives(last)
    answer = plan_answer(
        messages, body.get("max_output_tokens"), directives, reasons=True, caches=True
    )
    status = "incomplete" if answer.finish_reason == "length" else "completed"
    reasoning_tokens = count_tokens(answer.reasoning)
    record.update(
        prompt_tokens=answer.prompt_tokens,
        completion_tokens=answer.completion_tokens,
        cached_tokens=answer.cached_tokens,
        reasoning_tokens=reasoning_tokens,
        content=answer.content,
        status=200,
    )
    message = {
        "id": "msg_" + uuid.uuid4().hex,
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": answer.content, "annotations": []}],
    }
    usage = _usage(
        answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens, reasoning_tokens
    )
    if body.get("stream") is not True:
        record["usage"], record["completed"] = usage, True
        record["delivered_completion_tokens"] = answer.completion_tokens
        return JSONResponse(_response(rid, body, status, [message], usage))
    pieces = split_chunks(answer.content, directives.chunks)
    delay = (directives.delay_ms or 0) / 1000

    async def events():
        seq = 0

        def event(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        start = _response(rid, body, "in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        added = {**message, "status": "in_progress", "content": []}
        yield event("response.output_item.added", output_index=0, item=added)
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"item_id": message["id"], "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **ids, part=part)
        sent: list[str] = []
        for i, piece in enumerate(pieces):
            if directives.fault == "stream_error" and i == directives.fault_after:
                done = count_tokens("".join(sent))
                record["delivered_completion_tokens"] = done
                failed = _response(
                    rid,
                    body,
                    "failed",
                    [],
                    _usage(answer.prompt_tokens, answer.cached_tokens, done, 0),
                )
                failed["error"] = {"code": "server_error", "message": "upstream stream interrupted"}
                record["usage"] = failed["usage"]
                yield event("response.failed", response=failed)
                return
            if i and delay:
                await asyncio.sleep(delay)
            sent.append(piece)
            record["delivered_chunks"] += 1
            yield event("response.output_text.delta", **ids, delta=piece, logprobs=[])
        record["delivered_completion_tokens"] = answer.completion_tokens
        yield event("response.output_text.done", **ids, text=answer.content, logprobs=[])
        yield event("response.content_part.done", **ids, part={**part, "text": answer.content})
        yield event("response.output_item.done", output_index=0, item=message)
        record["usage"], record["completed"] = usage, True
        yield event(f"response.{status}", response=_response(rid, body, status, [message], usage))

    return StreamingResponse(events(), media_type="text/event-stream")

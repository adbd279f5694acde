"""A non-streaming client of an upstream that only streams (TokenChange): the stream is read
whole by the relay loop and answered as one `chat.completion` assembled from its chunks."""

import json
import time
from typing import Any

from starlette.responses import Response

from metering.proxy.attempt import Attempt
from metering.proxy.stream import StreamRelay
from metering.proxy.transport import (
    UpstreamFailed,
    error_answer,
    limit_error,
    open_upstream,
    read_all,
)


async def answer_from_stream(attempt: Attempt) -> Response:
    """Read the whole stream, answer one chat.completion. An error event mid-stream bills what
    was delivered, then 502."""
    upstream = await open_upstream(attempt)
    if upstream.status_code >= 400:
        return error_answer(attempt, upstream, await read_all(attempt, upstream))
    assembler = CompletionAssembler()
    relay = StreamRelay(attempt, upstream, on_chunk=assembler.add)
    try:
        await relay.run()
    finally:
        await upstream.aclose()
    outcome = attempt.outcome = relay.outcome()
    outcome.ttft_ms = attempt.elapsed_ms()  # the client's first byte is the whole answer
    if relay.limit is not None:
        raise limit_error(attempt, relay.limit)
    if outcome.status != "ok":
        error = relay.observer.error or {}
        message = error.get("message") or "the upstream stream ended early"
        raise UpstreamFailed(f"provider {attempt.provider.name}: {message}")
    completion = assembler.completion()
    if attempt.provider.response_model == "requested":
        completion["model"] = attempt.chat.model
    body = json.dumps(completion, ensure_ascii=False).encode()
    return Response(body, 200, headers=attempt.headers, media_type="application/json")


class CompletionAssembler:
    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {
                k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk
            }
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict):
                self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0) if isinstance(choice.get("index"), int) else 0
        state = self.choices.setdefault(
            index, {"message": {"role": "assistant"}, "finish_reason": None, "tools": {}}
        )
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        message = state["message"]
        for key, value in delta.items():
            if key == "tool_calls" and isinstance(value, list):
                self._add_tool_calls(state["tools"], value)
            elif key == "role" and isinstance(value, str):
                message["role"] = value
            elif isinstance(value, str):
                message[key] = message.get(key, "") + value
            elif value is not None:
                message[key] = value
        if choice.get("finish_reason"):
            state["finish_reason"] = choice["finish_reason"]

    @staticmethod
    def _add_tool_calls(tools: dict[Any, dict[str, Any]], calls: list[Any]) -> None:
        for call in calls:
            if not isinstance(call, dict):
                continue
            slot = tools.setdefault(call.get("index", len(tools)), {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if call.get(key):
                    slot[key] = call[key]
            function = call.get("function")
            if not isinstance(function, dict):
                function = {}
            if function.get("name"):
                slot["function"]["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                slot["function"]["arguments"] += function["arguments"]

    def completion(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            message = dict(state["message"])
            message.setdefault("content", None)
            if state["tools"]:
                message["tool_calls"] = [state["tools"][k] for k in sorted(state["tools"])]
            choices.append(
                {"index": index, "message": message, "finish_reason": state["finish_reason"]}
            )
        body = {
            "id": self.head.get("id"),
            "object": "chat.completion",
            "created": self.head.get("created", int(time.time())),
            "model": self.head.get("model"),
            "choices": choices,
        }
        if "system_fingerprint" in self.head:
            body["system_fingerprint"] = self.head["system_fingerprint"]
        if self.usage is not None:
            body["usage"] = self.usage
        return body

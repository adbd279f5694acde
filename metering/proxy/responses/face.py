"""The Responses API's side of a bridged request: a chat completion (one body, or its stream's
chunks) answered as a Response object, or as Responses events.

Ids are ours (`resp_`, and `rs_`, `msg_`, `fc_` for the items), never the upstream's
`chatcmpl-`: a client replays them. A function call keeps the upstream's call id as its
`call_id`, which the client sends back with the call's output. `usage` is the ledger event's,
in Responses terms, so the client reads what was charged."""

import json
import os
import time
from typing import Any

import orjson

from metering.ledger.event import Event
from metering.proxy.reported import parse_json_object
from metering.proxy.responses.request import Bridged


def item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def usage_of(event: Event | None) -> dict[str, Any] | None:
    """The ledger event's counts as a Response's `usage`."""
    if event is None:
        return None
    usage: dict[str, Any] = {
        "input_tokens": event.prompt_tokens,
        "input_tokens_details": {"cached_tokens": event.cached_tokens},
        "output_tokens": event.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": event.reasoning_tokens or 0},
        "total_tokens": event.total_tokens,
    }
    if event.usage_source != "reported":
        usage["usage_source"] = event.usage_source
    return usage


def reasoning_text(message: dict[str, Any]) -> str:
    """The reasoning a chat message or delta carries, under any of the names dialects use."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str):
            return value
    details = message.get("reasoning_details")
    if isinstance(details, list):
        return "".join(
            d["text"] for d in details if isinstance(d, dict) and isinstance(d.get("text"), str)
        )
    return ""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


class Face:
    """One bridged request's answer in Responses terms."""

    def __init__(self, bridged: Bridged, response_id: str) -> None:
        self.bridged = bridged
        self.id = response_id
        self.created_at = int(time.time())
        self.model = bridged.model  # the upstream's, once its answer names it
        self.output: list[dict[str, Any]] = []  # the output items, as the client got them
        self.status = "in_progress"
        self.stored: dict[str, Any] | None = None  # the Response object, as stored

    def response(
        self,
        status: str,
        usage: dict[str, Any] | None,
        *,
        finish: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The Response object, with every field the SDK's model requires."""
        b = self.bridged
        echo = b.echo
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": INCOMPLETE.get(finish or "", "max_output_tokens")}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": echo.get("max_output_tokens"),
            "model": self.model,
            "output": list(self.output) if status != "in_progress" else [],
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "previous_response_id": b.previous_response_id,
            "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
            "store": b.store,
            "temperature": echo.get("temperature"),
            "text": echo.get("text", {"format": {"type": "text"}}),
            "tool_choice": echo["tool_choice"],
            "tools": echo["tools"],
            "top_p": echo.get("top_p"),
            "truncation": "disabled",
            "usage": usage,
            "user": echo.get("user"),
            "metadata": echo.get("metadata") or {},
        }

    # -- one body --------------------------------------------------------------------------

    def from_completion(self, completion: dict[str, Any], event: Event | None) -> dict[str, Any]:
        """A chat.completion (its first choice) as a Response object."""
        if isinstance(completion.get("model"), str):
            self.model = completion["model"]
        choices = completion.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        if not isinstance(choice, dict):
            choice = {}
        message = choice.get("message")
        if not isinstance(message, dict):
            message = {}
        reasoning = reasoning_text(message)
        if reasoning:
            self.output.append(_reasoning_item(item_id("rs"), reasoning))
        text = _text(message.get("content"))
        if text or not message.get("tool_calls"):
            self.output.append(_message_item(item_id("msg"), text, "completed"))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            self.output.append(
                _call_item(
                    item_id("fc"),
                    str(call.get("id") or item_id("call")),
                    str(function.get("name") or ""),
                    str(function.get("arguments") or ""),
                    "completed",
                )
            )
        finish = choice.get("finish_reason")
        status = "incomplete" if finish in INCOMPLETE else "completed"
        self.status = status
        self.stored = self.response(status, usage_of(event), finish=finish)
        return self.stored


def _reasoning_item(rs_id: str, text: str) -> dict[str, Any]:
    return {
        "id": rs_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message_item(msg_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def _call_item(fc_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": fc_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _json(value: Any) -> bytes:
    """JSON of what is written to the client; a lone surrogate (which an upstream's escapes can
    spell, and orjson refuses) is written escaped, as the standard library writes it."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


_TEXT_DELTA = (
    b"event: response.output_text.delta\ndata: "
    b'{"type":"response.output_text.delta","sequence_number":%d,"item_id":"%s",'
    b'"output_index":%d,"content_index":0,"delta":%s,"logprobs":[]}\n\n'
)
_REASONING_DELTA = (
    b"event: response.reasoning_text.delta\ndata: "
    b'{"type":"response.reasoning_text.delta","sequence_number":%d,"item_id":"%s",'
    b'"output_index":%d,"content_index":0,"delta":%s}\n\n'
)


class EventWriter:
    """A chat stream's chunks as Responses events: `event:` lines naming each data's type,
    `sequence_number` from 0 up. Items open as their first delta comes and close in order."""

    def __init__(self, face: Face) -> None:
        self.face = face
        self.seq = 0
        self.out: list[bytes] = []
        # The item being written: ("reasoning" | "message", its id, its text so far).
        self.open: list[Any] | None = None
        # Function calls by the upstream's tool-call index: [output_index, item].
        self.calls: dict[int, list[Any]] = {}
        self.finish: str | None = None

    def emit(self, kind: str, **data: Any) -> None:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        self.out.append(b"event: %s\ndata: %s\n\n" % (kind.encode(), _json(payload)))

    def take(self) -> bytes:
        out, self.out = b"".join(self.out), []
        return out

    def start(self) -> bytes:
        response = self.face.response("in_progress", None)
        self.emit("response.created", response=response)
        self.emit("response.in_progress", response=response)
        return self.take()

    # -- chunks ------------------------------------------------------------------------------

    def data(self, data: str) -> None:
        """One stream event's data, as the upstream sent it (bounded by the event size limit)."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = parse_json_object(data)  # the lenient reading, for what orjson refuses
        if isinstance(obj, dict):  # else not a JSON object: the observer judges it
            self.chunk(obj)

    def chunk(self, obj: dict[str, Any]) -> None:
        if isinstance(obj.get("model"), str) and obj["model"]:
            self.face.model = obj["model"]
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) not in (0, None):
                continue  # the Responses API has one output: the first choice
            delta = choice.get("delta")
            if isinstance(delta, dict):
                reasoning = reasoning_text(delta)
                if reasoning:
                    self._text("reasoning", reasoning)
                content = delta.get("content")
                if isinstance(content, str) and content:
                    self._text("message", content)
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    for call in calls:
                        if isinstance(call, dict):
                            self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def _index(self) -> int:
        return len(self.face.output)

    def _text(self, kind: str, text: str) -> None:
        if self.open is not None and self.open[0] != kind:
            self._close_text()
        if self.open is None:
            self._close_calls()
            index = self._index()
            if kind == "reasoning":
                rid = item_id("rs")
                item = {"id": rid, "type": "reasoning", "summary": [], "content": []}
                self.emit("response.output_item.added", output_index=index, item=item)
            else:
                rid = item_id("msg")
                item = _message_item(rid, "", "in_progress")
                self.emit("response.output_item.added", output_index=index, item=item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.emit(
                    "response.content_part.added",
                    item_id=rid,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            self.open = [kind, rid, [], index]
        kind_, rid, texts, index = self.open
        texts.append(text)
        # The one event of every chunk, written from its template (the keys in emit's order).
        template = _REASONING_DELTA if kind_ == "reasoning" else _TEXT_DELTA
        self.out.append(template % (self.seq, rid.encode(), index, _json(text)))
        self.seq += 1

    def _close_text(self) -> None:
        if self.open is None:
            return
        kind, rid, texts, index = self.open
        self.open = None
        text = "".join(texts)
        if kind == "reasoning":
            self.emit(
                "response.reasoning_text.done",
                item_id=rid,
                output_index=index,
                content_index=0,
                text=text,
            )
            item = _reasoning_item(rid, text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self.emit(
                "response.output_text.done",
                item_id=rid,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            self.emit(
                "response.content_part.done",
                item_id=rid,
                output_index=index,
                content_index=0,
                part=part,
            )
            item = _message_item(rid, text, "completed")
        self.emit("response.output_item.done", output_index=index, item=item)
        self.face.output.append(item)

    def _call(self, call: dict[str, Any]) -> None:
        position = call.get("index", 0)
        if not isinstance(position, int):
            position = 0
        function: dict[str, Any] = (
            call["function"] if isinstance(call.get("function"), dict) else {}
        )
        slot = self.calls.get(position)
        if slot is None:
            self._close_text()
            index = self._index() + len(self.calls)
            item = _call_item(
                item_id("fc"),
                str(call.get("id") or item_id("call")),
                str(function.get("name") or ""),
                "",
                "in_progress",
            )
            slot = self.calls[position] = [index, item]
            self.emit("response.output_item.added", output_index=index, item=dict(item))
        index, item = slot
        if function.get("name") and not item["name"]:
            item["name"] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item["arguments"] += arguments
            self.emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=arguments,
            )

    def _close_calls(self) -> None:
        for position in sorted(self.calls):
            index, item = self.calls[position]
            item["status"] = "completed"
            self.emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            self.emit("response.output_item.done", output_index=index, item=item)
            self.face.output.append(item)
        self.calls = {}

    # -- the end -----------------------------------------------------------------------------

    def completed(self, event: Event | None) -> bytes:
        """The open items closed, then `response.completed` (or `response.incomplete`, as
        OpenAI ends a response cut by max_output_tokens) with the ledger's usage."""
        self._close_text()
        self._close_calls()
        face = self.face
        status = "incomplete" if self.finish in INCOMPLETE else "completed"
        face.status = status
        face.stored = face.response(status, usage_of(event), finish=self.finish)
        self.emit(f"response.{status}", response=face.stored)
        return self.take()

    def failed(self, code: str, message: str, event: Event | None) -> bytes:
        """`response.failed` carrying the error, with what was delivered and its usage."""
        self._close_text()
        self._close_calls()
        face = self.face
        face.status = "failed"
        error = {"code": code, "message": message}
        response = face.response("failed", usage_of(event), error=error)
        self.emit("response.failed", response=response)
        return self.take()

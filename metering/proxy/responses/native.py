"""A Responses API request to a provider that serves the Responses API itself (`responses = true`
in the catalog): its body forwarded as the client sent it (the route's model, the held max
output tokens, our own fields withheld), its answer relayed byte for byte, the usage read from
the body or the stream's `response.completed`. Held, settled and refused as every request."""

from typing import Any

import httpx
from starlette.responses import Response

from metering.ledger.charge import Usage
from metering.ledger.outcome import Outcome
from metering.proxy.attempt import Attempt
from metering.proxy.estimate import estimate_text_tokens
from metering.proxy.reported import parse_json_object, usage_from_json
from metering.proxy.stream import MeteredStream, StreamRelay
from metering.proxy.transport import UpstreamFailed, error_answer, passed_headers, read_all
from metering.settings import ModelRoute

FINISHED = ("response.completed", "response.incomplete")
FAILED = ("response.failed", "error")


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses `usage` in chat completion terms, to be checked as any usage is."""
    if not isinstance(usage, dict):
        return None
    inputs = usage.get("input_tokens_details")
    outputs = usage.get("output_tokens_details")
    return {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "total_tokens": usage.get("total_tokens"),
        "prompt_tokens_details": {
            "cached_tokens": inputs.get("cached_tokens") if isinstance(inputs, dict) else None
        },
        "completion_tokens_details": {
            "reasoning_tokens": outputs.get("reasoning_tokens")
            if isinstance(outputs, dict)
            else None
        },
    }


def upstream_body(
    body: dict[str, Any],
    history: list[dict[str, Any]],
    route: ModelRoute,
    max_tokens: int | None,
    withheld: frozenset[str],
) -> dict[str, Any]:
    """The client's body as the provider gets it: the route's model and the held limit, the
    stored conversation (its ids and reasoning items left out: they are ours) before the
    input, nothing stored upstream, our own fields (tags, end user where not taken) left out."""
    out = {k: v for k, v in body.items() if k not in withheld}
    out["model"] = route.upstream_model
    if max_tokens is not None:
        out["max_output_tokens"] = max_tokens
    out.pop("previous_response_id", None)
    out["store"] = False
    if history:
        items = body["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        earlier = [
            {k: v for k, v in item.items() if k not in ("id", "status")}
            for item in history
            if item.get("type") != "reasoning"
        ]
        out["input"] = [*earlier, *items]
    return out


def _text_tokens(obj: dict[str, Any]) -> str:
    texts = []
    for item in obj.get("output") or []:
        if not isinstance(item, dict):
            continue
        for part in item.get("content") or []:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        if isinstance(item.get("arguments"), str):
            texts.append(item["arguments"])
    return "".join(texts)


async def relay_response(attempt: Attempt, upstream: httpx.Response) -> Response:
    """A Response object relayed as it came, its usage read on the side."""
    raw = await read_all(attempt, upstream)
    if upstream.status_code >= 400:
        return error_answer(attempt, upstream, raw)
    obj = parse_json_object(raw)
    outcome = attempt.outcome = Outcome(
        http_status=upstream.status_code, ttft_ms=attempt.elapsed_ms()
    )
    if obj is None:
        outcome.status, outcome.error = "malformed", raw[:2000].decode("utf-8", "replace")
        raise UpstreamFailed(f"provider {attempt.provider.name} sent a malformed answer")
    outcome.usage = usage_from_json(chat_usage(obj.get("usage")))
    outcome.finish_reason = obj.get("status") if isinstance(obj.get("status"), str) else None
    outcome.upstream_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    outcome.delivered_text = _text_tokens(obj)
    bridge = attempt.chat.bridge
    bridge.face.stored = obj
    await bridge.saved()  # stored before the client has it; its event settles as it returns
    return Response(raw, upstream.status_code, headers=passed_headers(attempt, upstream))


class ResponsesObserver:
    """StreamObserver's reading of a Responses stream: the usage of its last event, its id,
    its error; `finished` once `response.completed` (or `.incomplete`, `.failed`) came."""

    __slots__ = (
        "usage",
        "finish_reason",
        "upstream_id",
        "created",
        "model",
        "error",
        "finished",
        "_text",
        "_size",
        "last",
    )

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.upstream_id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.error: dict[str, Any] | None = None
        self.finished = False
        self.last: dict[str, Any] | None = None  # the last lifecycle event's response
        self._text: list[str] = []
        self._size = 0

    def observe(self, data: str | None) -> dict[str, Any] | None:
        obj = parse_json_object(data) if data else None
        if obj is None:
            return None
        kind = obj.get("type")
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            delta = obj.get("delta")
            if isinstance(delta, str) and self._size < 10_000_000:
                self._text.append(delta)
                self._size += len(delta)
        response = obj.get("response")
        if isinstance(response, dict):
            self.last = response
            if self.upstream_id is None and isinstance(response.get("id"), str):
                self.upstream_id = response["id"]
            usage = usage_from_json(chat_usage(response.get("usage")))
            if usage is not None:
                self.usage = usage
            if isinstance(response.get("status"), str):
                self.finish_reason = response["status"]
        if kind in FINISHED:
            self.finished = True
        elif kind in FAILED:
            error = obj.get("error") or (response or {}).get("error")
            self.error = error if isinstance(error, dict) else {"message": str(kind)}
            self.finished = True
        return obj

    def delivered_tokens(self) -> int:
        return estimate_text_tokens("".join(self._text))


class NativeStream(MeteredStream):
    """A Responses stream relayed byte for byte; it ends at its last lifecycle event."""

    def __init__(self, attempt: Attempt, upstream: httpx.Response) -> None:
        super().__init__(attempt, upstream)
        self.relay = StreamRelay(attempt, upstream)
        self.relay.observer = ResponsesObserver()  # type: ignore[assignment]

    async def tail(self, relay: StreamRelay, outcome: Outcome) -> bytes:
        """The stream's last event, once its response is stored (if it finished)."""
        observer = relay.observer
        bridge = self.attempt.chat.bridge
        finished = outcome.status == "ok" and observer.error is None
        if isinstance(observer, ResponsesObserver) and observer.last is not None and finished:
            bridge.face.stored = observer.last
            await bridge.saved()
        return relay.done or b""

"""The simulated upstream's dialects: how each provider shapes its answers, chunks and errors,
as its document (the seeds) shows, and the checks each applies to a request."""

import time
import uuid
from dataclasses import dataclass, replace

from starlette.responses import JSONResponse

from metering.sim.text import Answer

NIM_FUNCTION_ID = "da9660c1-f121-46f7-ae2a-9ae22b727284"
STREAM_ERROR = {"message": "upstream stream interrupted", "type": "server_error"}


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

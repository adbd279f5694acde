"""The simulated providers: how each one shapes its answers, chunks and errors, as its own
document shows (docs/dialects.md), and the checks each applies to a request. One SimProvider
per dialect the catalog knows (metering.settings.DIALECTS), keyed by that name in PROVIDERS."""

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import JSONResponse

from metering.sim import checks
from metering.sim.checks import RequestRules
from metering.sim.text import Answer

NIM_FUNCTION_ID = "da9660c1-f121-46f7-ae2a-9ae22b727284"
STREAM_ERROR = {"message": "upstream stream interrupted", "type": "server_error"}


# --- providers ------------------------------------------------------------------------------


@dataclass
class Reply:
    """One answer on its way out: what the providers need to shape its bodies."""

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


class SimProvider:
    """The plain OpenAI-compatible shape; each provider below states how it differs."""

    models: tuple[str, ...] = ()
    rules: RequestRules = checks.OPENAI
    reasons = True  # sim:reasoning yields reasoning_content
    caches = False  # sim:cached shows as prompt_tokens_details.cached_tokens
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
        return self.rules.check(body)

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
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_call is not None:
            call_id, name, arguments = answer.tool_call
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ]
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


class SimOpenAI(SimProvider):
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


class SimExascale(SimProvider):
    """MiniMax on Exascale: named messages, reasoning details, sla_metrics, usage always."""

    models = ("MiniMaxAI/MiniMax-M2.1",)
    rules = checks.EXASCALE
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
            delta: dict[str, Any] = {"role": "assistant", "reasoning_content": text}
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


class SimGenesis(SimProvider):
    """Genesis: text blocks checked, usage without details, streams without id or usage."""

    models = ("MiniMax-M2.5",)
    rules = checks.GENESIS
    reasons = False

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


class SimTokenChange(SimProvider):
    """TokenChange: streams only; usage on request, with cached tokens."""

    models = ("minimax/minimax-m2.5",)
    rules = checks.TOKENCHANGE
    caches = True
    bills_partial_streams = True  # "Output delivered before the error is billed."

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


class SimNim(SimProvider):
    """NVIDIA NIM on NVCF: schema-checked requests, problem details, 202 and polling."""

    models = ("minimaxai/minimax-m2.5",)
    rules = checks.NIM
    reasons = False
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


PROVIDERS: dict[str, SimProvider] = {
    "openai": SimOpenAI(),
    "exascale": SimExascale(),
    "genesis": SimGenesis(),
    "tokenchange": SimTokenChange(),
    "nim": SimNim(),
}


def _reasoning_detail(text: str) -> dict:
    return {
        "type": "reasoning.text",
        "text": text,
        "id": "reasoning-text-1",
        "format": "openai-responses-v1",
        "index": 0,
    }

"""The checks each simulated provider applies to a request, as strict as its document.

A check returns None when the request passes, else the message the provider answers with.
Each provider's `RequestRules` say which parameters it knows, their types and ranges,
which roles and message fields it takes, and whether anything else is refused.
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

Check = Callable[[str, object], str | None]


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def number(low: float | None = None, high: float | None = None, low_open: bool = False) -> Check:
    def check(name: str, value: object) -> str | None:
        if not _is_number(value):
            return f"{name} must be a number"
        too_low = low is not None and (value < low or (low_open and value == low))
        if too_low or (high is not None and value > high):
            left = "(" if low_open else "["
            return f"{name} must be a number in {left}{low}, {high}]"
        return None

    return check


def integer(low: int | None = None, high: int | None = None) -> Check:
    def check(name: str, value: object) -> str | None:
        if not _is_int(value):
            return f"{name} must be an integer"
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                return f"{name} must be an integer of at least {low}"
            return f"{name} must be an integer in [{low}, {high}]"
        return None

    return check


def boolean(name: str, value: object) -> str | None:
    return None if isinstance(value, bool) else f"{name} must be a boolean"


def string(name: str, value: object) -> str | None:
    return None if isinstance(value, str) else f"{name} must be a string"


def stop(name: str, value: object) -> str | None:
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return None
    return f"{name} must be a string, a list of strings or null"


def stream_options(name: str, value: object) -> str | None:
    if not isinstance(value, dict):
        return f"{name} must be an object"
    if "include_usage" in value and not isinstance(value["include_usage"], bool):
        return f"{name}.include_usage must be a boolean"
    return None


def anything(name: str, value: object) -> str | None:
    return None


@dataclass(frozen=True)
class RequestRules:
    """What one provider accepts in a chat completion request."""

    params: dict[str, Check]
    roles: frozenset[str]
    requires_model: bool = True
    # Parameters not in `params` are refused (a schema with additionalProperties: false).
    closed: bool = False
    # The fields a message may carry; None: any.
    message_fields: frozenset[str] | None = None
    # Every message must carry `content` (null allowed where `content` allows it).
    requires_content: bool = False
    # "any": string, null or a list of typed parts; "text": string, null or non-empty text
    # blocks (other part types allowed); "string": string or null.
    content: str = "any"
    # Parameters that must be present with this very value.
    required: dict[str, object] = field(default_factory=dict)
    # stream_options is refused unless stream is true (OpenAI).
    stream_options_need_stream: bool = False

    def check(self, body: dict) -> str | None:
        if self.requires_model and not isinstance(body.get("model"), str):
            return "missing required parameter: model"
        for name, value in self.required.items():
            if body.get(name) != value or type(body.get(name)) is not type(value):
                return f"{name} must be {json.dumps(value)}"
        for name, value in body.items():
            if name in ("model", "messages"):
                continue
            check = self.params.get(name)
            if check is None:
                if self.closed:
                    return f"{name}: extra inputs are not permitted"
                continue
            problem = check(name, value)
            if problem:
                return problem
        options_alone = "stream_options" in body and body.get("stream") is not True
        if self.stream_options_need_stream and options_alone:
            return "stream_options is only allowed when stream is true"
        if "model" in body and not isinstance(body["model"], str):
            return "model must be a string"
        return self.check_messages(body.get("messages"))

    def check_messages(self, messages: object) -> str | None:
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list"
        calls: set[str] = set()  # the tool calls made so far, which a tool message answers
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                return f"messages[{index}] must be an object"
            role = message.get("role")
            for call in message.get("tool_calls") or [] if role == "assistant" else []:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    calls.add(call["id"])
            if role == "tool" and "tool" in self.roles and message.get("tool_call_id") not in calls:
                return (
                    f"messages[{index}]: a message with role 'tool' must be a response to a "
                    "preceding message with 'tool_calls'"
                )
            if role not in self.roles:
                return f"messages[{index}].role: unsupported role {role!r}"
            if self.message_fields is not None:
                extra = sorted(set(message) - self.message_fields)
                if extra:
                    return f"messages[{index}].{extra[0]}: extra inputs are not permitted"
            if self.requires_content and "content" not in message:
                return f"messages[{index}].content is required"
            problem = self.check_content(index, message.get("content"))
            if problem:
                return problem
        return None

    def check_content(self, index: int, content: object) -> str | None:
        if content is None or isinstance(content, str):
            return None
        where = f"messages[{index}].content"
        if self.content == "string" or not isinstance(content, list):
            allowed = "a string or null" if self.content == "string" else "a string or a list"
            return f"{where} must be {allowed}"
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                return f"{where}[{part_index}] must be an object with a type"
            if self.content == "text" and part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str) or not text:
                    return f"{where}[{part_index}].text must be nonempty text"
        return None


def tools(name: str, value: Any) -> str | None:
    """OpenAI's chat tools: each `{"type": "function", "function": {"name", ...}}`. A
    Responses-shaped tool (`name` at the top, no `function`) or a hosted one is refused."""
    if not isinstance(value, list):
        return f"{name} must be an array"
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"{name}[{i}].type: only function tools are supported"
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"Missing required parameter: '{name}[{i}].function'."
        extra = set(tool) - {"type", "function"}
        if extra:
            return f"Unrecognized parameter: '{name}[{i}].{sorted(extra)[0]}'."
    return None


def tool_choice(name: str, value: Any) -> str | None:
    if value in ("auto", "none", "required"):
        return None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return None
    return f"{name} must be auto, none, required or a named function"


SAMPLING = {
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
}
COUNT = integer(1)

# The OpenAI chat completions API reference: unknown parameters are refused with a 400.
OPENAI = RequestRules(
    params={
        **SAMPLING,
        "max_tokens": COUNT,
        "max_completion_tokens": COUNT,
        "n": integer(1, 128),
        "stream": boolean,
        "stream_options": stream_options,
        "stop": stop,
        "seed": integer(),
        "user": string,
        "logprobs": boolean,
        "top_logprobs": integer(0, 20),
        "logit_bias": anything,
        "response_format": anything,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": boolean,
        "functions": anything,
        "function_call": anything,
        "metadata": anything,
        "store": boolean,
        "service_tier": anything,
        "reasoning_effort": anything,
        "modalities": anything,
        "audio": anything,
        "prediction": anything,
        "prompt_cache_key": string,
        "safety_identifier": string,
        "verbosity": anything,
        "web_search_options": anything,
    },
    roles=frozenset({"system", "developer", "user", "assistant", "tool", "function"}),
    closed=True,
    stream_options_need_stream=True,
)

# Exascale's body parameters table: its ranges; every message has a role and a content.
# `stream` is listed as required, yet the document's own examples (curl, the SDK) omit it.
EXASCALE = RequestRules(
    params={
        "temperature": number(0, 2),
        "top_p": number(0, 1),
        "top_k": integer(-1, 200),
        "presence_penalty": number(-2, 2),
        "repetition_penalty": number(0.01, 2),
        "max_tokens": COUNT,
        "stream": boolean,
        "stream_options": stream_options,
    },
    roles=frozenset({"system", "developer", "user", "assistant", "tool"}),
    requires_content=True,
)

# Genesis' parameters table: roles system, user and assistant; text blocks with nonempty text.
GENESIS = RequestRules(
    params={
        "max_tokens": COUNT,
        "temperature": number(),
        "top_p": number(),
        "stream": boolean,
    },
    roles=frozenset({"system", "user", "assistant"}),
    content="text",
)

# TokenChange: streams only; max_tokens at least 1, temperature 0..2; other OpenAI fields pass.
TOKENCHANGE = RequestRules(
    params={
        "max_tokens": COUNT,
        "temperature": number(0, 2),
        "stream": boolean,
        "stream_options": stream_options,
    },
    roles=frozenset({"system", "developer", "user", "assistant", "tool"}),
    required={"stream": True},
)

# NVIDIA NIM's OpenAPI schema: ChatRequest and Message both with additionalProperties: false,
# roles user and assistant, content a string or null and required, and these ranges.
NIM = RequestRules(
    params={
        "temperature": number(0, 1),
        "top_p": number(0, 1, low_open=True),
        "frequency_penalty": number(-2, 2),
        "presence_penalty": number(-2, 2),
        "max_tokens": integer(1, 16384),
        "stream": boolean,
        "stop": stop,
    },
    roles=frozenset({"user", "assistant"}),
    requires_model=False,
    closed=True,
    message_fields=frozenset({"role", "content"}),
    requires_content=True,
    content="string",
)

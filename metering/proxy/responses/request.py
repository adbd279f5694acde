"""A Responses API request (`POST /v1/responses`) in chat completion terms: the one place where
its fields become a chat body, and where what the bridge cannot carry is refused.

What comes in: `model`, `input` (a string or items: messages, `function_call`,
`function_call_output`, and `reasoning` items a client replays, which no chat dialect takes and
are left out), `instructions` (a first system message), function `tools`, `tool_choice`,
`parallel_tool_calls`, `temperature`, `top_p`, `max_output_tokens` (the request's max tokens),
`text.format` (`response_format`), `reasoning.effort` (`reasoning_effort`, to a dialect that
takes it), `metadata`, `user`, `safety_identifier`, `stream`, `store`, `previous_response_id`.
Accepted with no effect upstream: `include`, `prompt_cache_key`, `truncation: "disabled"`,
`reasoning.summary`, `service_tier`, `stream_options`. Anything else (hosted tools, `background`,
`conversation`, `prompt`, `input_file`, an unknown field) is a 400 naming it, before anything is
held."""

from dataclasses import dataclass, field
from typing import Any

from metering.errors import InvalidRequest
from metering.proxy.request import MAX_TOKENS

MAX_ITEMS = 100_000
MAX_TOOLS = 512
PART_KINDS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
ROLES = frozenset({"user", "assistant", "system", "developer"})
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
# Fields read here, each with what it becomes; the rest are refused by name.
READ = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "max_output_tokens",
        "text",
        "reasoning",
        "metadata",
        "user",
        "safety_identifier",
        "stream",
        "store",
        "previous_response_id",
        "include",
        "prompt_cache_key",
        "truncation",
        "service_tier",
        "stream_options",
        "background",
    }
)
# Refused with a reason of their own.
NOT_CARRIED = {
    "conversation": "conversations are not kept here: send the whole input, or "
    "previous_response_id",
    "prompt": "stored prompt templates are not available through this gateway",
    "max_tool_calls": "built-in tools are not available through this gateway",
}


@dataclass(slots=True)
class Bridged:
    """What the client asked in Responses terms, kept for the answer (echoed fields) and the
    store: its chat body is built beside it."""

    model: str
    instructions: str | None
    input_items: list[dict[str, Any]]
    store: bool
    previous_response_id: str | None
    echo: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # as the client sent it

    def upstream_extras(self, upstream: dict[str, Any], takes_effort: bool) -> None:
        """What goes up only where the dialect takes it: `reasoning.effort`."""
        if self.reasoning_effort is not None and takes_effort:
            upstream["reasoning_effort"] = self.reasoning_effort

    def continue_from(self, chat: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Put a stored conversation's items (oldest first) before this request's input, after
        its instructions (the earlier responses' instructions are not carried, as OpenAI's)."""
        at = 1 if self.instructions else 0
        chat["messages"][at:at] = messages_of(history, None)


def _bad(message: str, param: str) -> InvalidRequest:
    """A 400 naming the field at fault in its message, and its top-level field as `param`
    (the rules /openapi.json lists for each: metering.proxy.endpoints)."""
    return InvalidRequest(message, param=param.split(".", 1)[0])


def _text_of(
    parts: Any, where: str, images: list[dict[str, Any]] | None
) -> str | list[dict[str, Any]]:
    """A content's text (a string, or the text parts joined) and, where `images` is given, its
    image parts as chat image parts."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(f"{where} must be a string or a list of content parts", where)
    texts: list[str] = []
    chat_parts: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        here = f"{where}.{j}"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{here} must be an object with a type", here)
        kind = part["type"]
        if kind in PART_KINDS:
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise _bad(f"{here}.text must be a string", f"{here}.text")
            texts.append(text)
            chat_parts.append({"type": "text", "text": text})
        elif kind == "input_image" and images is not None:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(
                    f"{here}.image_url must be a URL or a data URL (file_id is not available "
                    "through this gateway)",
                    f"{here}.image_url",
                )
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                if part["detail"] not in ("auto", "low", "high"):
                    raise _bad(f"{here}.detail must be auto, low or high", f"{here}.detail")
                image["detail"] = part["detail"]
            chat_parts.append({"type": "image_url", "image_url": image})
            images.append(image)
        else:
            raise _bad(f"{here}: content of type {kind} cannot be bridged to a chat model", here)
    if any(p["type"] != "text" for p in chat_parts):
        return chat_parts
    return "".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
    images: list[dict[str, Any]] | None = [] if role == "user" else None
    content = _text_of(item.get("content"), f"{where}.content", images)
    return {"role": role, "content": content}


def _arguments(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{where} must be a string of JSON", where)
    return value


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id or len(call_id) > 256:
        raise _bad(f"{where}.call_id must be a string of 1 to 256 characters", f"{where}.call_id")
    return call_id


def messages_of(items: list[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of Responses items (and instructions first)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise _bad(f"{where}.name must be a function's name", f"{where}.name")
            call = {
                "id": _call_id(item, where),
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": _arguments(item.get("arguments"), f"{where}.arguments"),
                },
            }
            last = messages[-1] if messages else None
            # Calls one after another (or after the assistant's text) are one assistant turn.
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif (
                last is not None
                and last["role"] == "assistant"
                and isinstance(last.get("content"), str)
            ):
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text_of(output, f"{where}.output", None)
            messages.append(
                {"role": "tool", "tool_call_id": _call_id(item, where), "content": text}
            )
        elif kind == "reasoning":
            continue  # a replayed reasoning item: no chat dialect takes one back
        elif kind == "input_file" or kind == "item_reference":
            raise _bad(f"{where}: an item of type {kind} cannot be bridged to a chat model", where)
        else:
            raise _bad(f"{where}: an item of type {kind} cannot be bridged to a chat model", where)
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("tools must be an array", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools may hold at most {MAX_TOOLS} entries", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind != "function":
            raise _bad(
                f"{where}: tools of type {kind} (hosted tools) are not available through this "
                "gateway; only function tools are",
                f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name must be a function's name", f"{where}.name")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise _bad(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise _bad("text must be an object", "text")
    for key in text:
        if key not in ("format", "verbosity"):
            raise _bad(f"text.{key} cannot be bridged to a chat model", f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise _bad("text.format.name must be a string", "text.format.name")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema must be an object", "text.format.schema")
        inner = {"name": name, "schema": schema}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                inner[key] = fmt[key]
        return {"type": "json_schema", "json_schema": inner}
    raise _bad("text.format.type must be text, json_object or json_schema", "text.format.type")


def _reasoning(reasoning: Any) -> str | None:
    if not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object", "reasoning")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            raise _bad(f"reasoning.{key} cannot be bridged", f"reasoning.{key}")
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise _bad(f"reasoning.effort must be one of {', '.join(sorted(EFFORTS))}", "reasoning")
    return effort


def translate(body: dict[str, Any]) -> tuple[dict[str, Any], Bridged]:
    """The chat body of a Responses request, and what the answer and the store need of it;
    `previous` items (a stored conversation) go before the input. Refuses, naming the field,
    what the bridge cannot carry."""
    for key, value in body.items():
        if key in NOT_CARRIED and value is not None:
            raise _bad(f"{key}: {NOT_CARRIED[key]}", key)
        if key not in READ:
            raise _bad(f"{key} is not a parameter the Responses bridge takes", key)
    if body.get("background") not in (None, False):
        raise _bad(
            "background responses are not available through this gateway: stream instead",
            "background",
        )
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _bad('truncation must be "disabled": the gateway never drops input', "truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        if not raw_input:
            raise _bad("input must hold at least one item", "input")
        if len(raw_input) > MAX_ITEMS:
            raise _bad(f"input may hold at most {MAX_ITEMS} items", "input")
        items = raw_input
    else:
        raise _bad("input is required: a string or a list of items", "input")
    store = body.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise _bad("store must be a boolean", "store")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("previous_response_id must be a response's id", "previous_response_id")
    for key in ("include",):
        if body.get(key) is not None and not isinstance(body[key], list):
            raise _bad(f"{key} must be an array", key)
    if body.get("prompt_cache_key") is not None and not isinstance(body["prompt_cache_key"], str):
        raise _bad("prompt_cache_key must be a string", "prompt_cache_key")
    messages = messages_of(items, instructions)  # checks every item before anything is held
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_TOKENS:
            raise _bad(
                f"max_output_tokens must be an integer from 1 to {MAX_TOKENS}", "max_output_tokens"
            )
        chat["max_tokens"] = limit
    for key in ("temperature", "top_p", "metadata", "user", "safety_identifier", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if chat.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    echo: dict[str, Any] = {
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
    }
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    elif body.get("tools") is not None:
        _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
        if chat.get("tools"):
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("text") is not None:
        response_format = _format(body["text"])
        if response_format is not None:
            chat["response_format"] = response_format
        echo["text"] = body["text"]
    effort = _reasoning(body["reasoning"]) if body.get("reasoning") is not None else None
    if body.get("reasoning") is not None:
        echo["reasoning"] = body["reasoning"]
    for key in ("temperature", "top_p", "metadata", "max_output_tokens", "user"):
        if body.get(key) is not None:
            echo[key] = body[key]
    model = body.get("model")
    bridged = Bridged(
        model=model if isinstance(model, str) else "",
        instructions=instructions,
        input_items=items,
        store=store,
        previous_response_id=previous,
        echo=echo,
        reasoning_effort=effort,
        body=body,
    )
    return chat, bridged

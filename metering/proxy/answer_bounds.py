"""The bounds on what one upstream answer may cost this process (settings max_sse_event_bytes,
max_response_bytes, max_response_s), and the text of an answer cut short at one of them."""

import json
import re
from dataclasses import dataclass

import anyio

from metering.errors import MeteringError
from metering.settings import Settings

# Above this size the text of a cut body is read off the event loop.
THREAD_ABOVE_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class AnswerBound:
    """One bound on an upstream answer and what passing it makes of the request."""

    status: str  # the ledger event's status
    code: str  # the client's error code
    http_status: int  # what a non-streaming client gets
    setting: str  # the setting that sets the bound
    what: str

    def bound(self, settings: Settings) -> float:
        bound: float = getattr(settings, self.setting)
        return bound

    def message(self, provider: str, bound: float) -> str:
        return f"provider {provider}: {self.what.format(bound=bound)}"

    def error(self, provider: str, bound: float) -> MeteringError:
        return MeteringError(self.message(provider, bound), status=self.http_status, code=self.code)


EVENT_TOO_LARGE = AnswerBound(
    "event_too_large",
    "upstream_event_too_large",
    502,
    "max_sse_event_bytes",
    "the answer has an event or line longer than {bound} bytes (METERING_MAX_SSE_EVENT_BYTES)",
)
RESPONSE_TOO_LARGE = AnswerBound(
    "response_too_large",
    "upstream_response_too_large",
    502,
    "max_response_bytes",
    "the answer is longer than {bound} bytes (METERING_MAX_RESPONSE_BYTES)",
)
RESPONSE_TOO_LONG = AnswerBound(
    "response_too_long",
    "upstream_response_too_long",
    504,
    "max_response_s",
    "the answer took longer than {bound} seconds (METERING_MAX_RESPONSE_S)",
)


# A generated-text field of a chat completion and its string value, which may be cut short.
_TEXT_FIELD = re.compile(
    r'"(content|reasoning_content|reasoning|refusal|arguments)"\s*:\s*"((?:[^"\\]|\\.)*)'
)
_CUT_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?$")


def _unescape(value: str) -> str:
    try:
        return str(json.loads(f'"{value}"'))
    except ValueError:
        try:
            return str(json.loads(f'"{_CUT_ESCAPE.sub("", value)}"'))
        except ValueError:
            return value


def partial_text(body: bytes) -> str:
    """The generated text in the first bytes of a JSON chat completion whose end never came:
    every content, reasoning, refusal and tool-call argument string, the last one up to the cut.
    Reasoning given under both names is counted once."""
    found: dict[str, list[str]] = {}
    for match in _TEXT_FIELD.finditer(body.decode("utf-8", "replace")):
        found.setdefault(match[1], []).append(_unescape(match[2]))
    if "reasoning_content" in found:
        found.pop("reasoning", None)
    return "".join(part for parts in found.values() for part in parts)


async def text_of_cut_body(body: bytes) -> str:
    if len(body) > THREAD_ABOVE_BYTES:
        return await anyio.to_thread.run_sync(partial_text, body)
    return partial_text(body)

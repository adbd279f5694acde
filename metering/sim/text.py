"""The simulated answer: directives, deterministic prose and its token counts."""

import dataclasses
import hashlib
import math
import random
import re
from dataclasses import dataclass
from typing import Any

from metering.sim.tokenizer import count_prompt_tokens, count_tokens, message_text, tokenize

DEFAULT_TOKENS = 24
DEFAULT_FAULT_AFTER = 2
PIECES_PER_CHUNK = 3

_VOCABULARY = """
the of and to in is it that for as with on be at by this are from or an was but not can
all will one has more when there so if its new use may also such each two over model token
stream cache budget window ledger answer request reply value number system result between
without through about before because usually against provider account report limit price
credit measure record simple careful steady quickly during another general question example
several thought reason balance morning evening river garden market village history picture
letter travel pattern surface signal energy network certain likely perhaps always often
"""
WORDS = tuple(_VOCABULARY.split())
SHORT_WORDS = tuple(word for word in WORDS if count_tokens(" " + word) == 1)

_DIRECTIVE = re.compile(r"(?<!\S)sim:([a-z_]+)=(\S+)")


@dataclass(frozen=True)
class Directives:
    """What the last user message asks of the simulated upstream (`sim:KEY=VALUE`)."""

    tokens: int = DEFAULT_TOKENS
    reasoning: int = 0
    cached: int = 0
    chunks: int | None = None
    delay_ms: int | None = None
    wait_ms: int = 0  # before the answer starts (headers and all): a slow first byte
    pending: int | None = None
    fault: str | None = None
    tool: str | None = None  # call this function (of the request's tools)
    fault_after: int = DEFAULT_FAULT_AFTER
    crlf: bool = False
    comments: bool = False


def parse_directives(text: str) -> Directives:
    fields = {field.name: field for field in dataclasses.fields(Directives)}
    values: dict[str, Any] = {}
    for key, raw in _DIRECTIVE.findall(text):
        if key in ("fault", "tool"):
            values[key] = raw
        elif key in fields and raw.isdigit():
            values[key] = bool(int(raw)) if fields[key].type is bool else int(raw)
    return Directives(**values)


def last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message.get("content"))
    return ""


def prose(seed: str, n_tokens: int) -> str:
    """English-like sentences of exactly n_tokens tokens, the same for the same seed."""
    rng = random.Random(seed)
    text, left = "", n_tokens
    sentence_words, sentence_length = 0, rng.randint(5, 14)
    while left > 0:
        if sentence_words and (left == 1 or sentence_words >= sentence_length):
            text, left = text + ".", left - 1
            sentence_words, sentence_length = 0, rng.randint(5, 14)
            continue
        word = rng.choice(WORDS)
        # Keep one token for the period that closes the text.
        if count_tokens(" " + word) > max(left - 1, 1):
            word = rng.choice(SHORT_WORDS)
        if sentence_words == 0:
            word = word.capitalize()
        text += (" " if text else "") + word
        left -= count_tokens(" " + word)
        sentence_words += 1
        if 2 < sentence_words < sentence_length - 2 and left > 2 and rng.random() < 0.1:
            text, left = text + ",", left - 1
    return text


def split_chunks(text: str, chunks: int | None) -> list[str]:
    """Cut text at token boundaries, so the pieces re-tokenize to the same count."""
    pieces = tokenize(text)
    if not pieces:
        return []
    count = min(chunks or math.ceil(len(pieces) / PIECES_PER_CHUNK), len(pieces))
    size, extra = divmod(len(pieces), count)
    out, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        out.append("".join(pieces[start:end]))
        start = end
    return out


@dataclass(frozen=True)
class Answer:
    prompt_tokens: int
    cached_tokens: int
    reasoning: str
    content: str
    finish_reason: str
    # A function call instead of text: (call id, name, arguments as JSON).
    tool_call: tuple[str, str, str] | None = None

    @property
    def reasoning_tokens(self) -> int:
        return count_tokens(self.reasoning)

    @property
    def completion_tokens(self) -> int:
        call = self.tool_call
        called = count_tokens(call[1]) + count_tokens(call[2]) if call else 0
        return count_tokens(self.reasoning) + count_tokens(self.content) + called


def plan_answer(
    messages: list[dict],
    max_tokens: int | None,
    directives: Directives,
    *,
    reasons: bool,
    caches: bool,
) -> Answer:
    """The whole answer, decided before the first byte so stream and body agree."""
    prompt_tokens = count_prompt_tokens(messages)
    wanted = max(directives.tokens, 1)
    total = min(wanted, max_tokens) if max_tokens else wanted
    reasoning_tokens = min(directives.reasoning, total) if reasons else 0
    seed = hashlib.sha256(last_user_text(messages).encode()).hexdigest()
    return Answer(
        prompt_tokens=prompt_tokens,
        cached_tokens=min(directives.cached, prompt_tokens) if caches else 0,
        reasoning=prose(seed + ":reasoning", reasoning_tokens),
        content=prose(seed, total - reasoning_tokens),
        finish_reason="length" if total < wanted else "stop",
    )

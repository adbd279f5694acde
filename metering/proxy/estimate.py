"""Token estimates without a tokenizer download, and an upper bound for budget holds.

Estimates are used when an upstream reports no usage (stream cut, client gone,
provider that never reports it); the bound sizes the credit held before a
request is forwarded.

The estimate
------------
Text is split into runs, each priced the way byte-level BPE vocabularies
(GPT-2 through o200k, Llama 3, ...) tend to price them:

* A word (a run of letters) costs the average of two rules of thumb for English
  BPE: one token per four characters, counting the space that usually precedes
  the word (``(bytes + 1) / 4``), and 4/3 tokens per word. Characters-per-token
  alone undercounts short words, which are a whole token however short they
  are; tokens-per-word alone ignores that long and rare words split into
  pieces. UTF-8 bytes stand in for characters, so non-Latin scripts, which BPE
  merges less, cost more per character.
* Each run of digits costs one token per three digits (current vocabularies
  split numbers into groups of at most three).
* Each punctuation or symbol character costs one token; real vocabularies merge
  some pairs (``",``, ``://``), so this leans a little high for code and JSON.
* Whitespace other than the single space before a word costs one token per run
  (newlines, indentation).
* CJK ideographs, kana and Hangul cost one token each, close to what current
  vocabularies give for Chinese and Japanese text.

Calibrated against the simulated upstream's tokenizer (``metering.sim.tokenizer``)
it lands within 15% on English prose (see tests/proxy/test_estimate.py). Chat
requests add ``MESSAGE_OVERHEAD`` tokens per message and ``REPLY_PRIMING`` for
the assistant header, the values OpenAI documents for its chat format.

The upper bound
---------------
Byte-level BPE tokenizers (the simulated one too) emit at least one byte per
token, so a text never has more tokens than UTF-8 bytes. In a JSON request body
every text appears encoded, which is never shorter than its UTF-8 bytes (escapes
only lengthen it). A chat template adds a few tokens per message, fewer than the
JSON framing each message takes in the body (``{"role":"user","content":""}``
alone is 28 bytes). So for text requests the body's byte length, plus a margin
for the reply priming and any default system prompt a provider inserts, bounds
the prompt tokens. Media parts (images, audio, files) are priced by the model,
not by their bytes: a URL of a few dozen bytes can cost hundreds of tokens, so
each gets a fixed allowance. That allowance is generous for images; it is not a
proof for long audio or documents referenced by id.

Bounded work
------------
No estimate does more than linear work, and the regular expressions run over a bounded
amount of text: ``EXACT_TEXT_CHARS`` characters of generated text (per response) and
``EXACT_PROMPT_CHARS`` characters of a request's text fields. Beyond that the text is priced
at the rate the exactly-estimated part had, from its length alone, so the estimate of a
4 MiB prompt costs less than parsing its JSON. Generated text is counted as it arrives
(``TextTokens``): only the last unfinished run of letters, digits or blanks is kept between
parts, so a stream's text is never held in memory.
"""

import json
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "TextTokens",
    "estimate_text_tokens",
    "estimate_prompt_tokens",
    "prompt_tokens_upper_bound",
    "MESSAGE_OVERHEAD",
    "REPLY_PRIMING",
    "UPPER_BOUND_MARGIN",
    "MEDIA_PART_ESTIMATE",
    "MEDIA_PART_ALLOWANCE",
]

MESSAGE_OVERHEAD = 4  # role and separators a chat template adds per message
REPLY_PRIMING = 3  # the assistant header that starts the reply
UPPER_BOUND_MARGIN = 64  # reply priming and a provider's default system tokens
MEDIA_PART_ESTIMATE = 765  # a 1024x1024 image at high detail on gpt-4o
MEDIA_PART_ALLOWANCE = 4096  # above any single image's price on current models

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_WORD = re.compile(r"[^\W\d_]+")
_DIGITS = re.compile(r"\d+")
_SYMBOL = re.compile(r"[^\w\s]|_")
# Whitespace that is not a lone space (a lone space joins the following token).
_BLANK = re.compile(r"\s{2,}|[^\S ]")

# Content part types that are not media (the rest are priced as images).
_TEXT_PART_TYPES = (None, "text", "input_text", "output_text", "refusal")
# The text whose runs follow one another: reversed, its first run is the text's last.
_RUN = re.compile(r"[^\W\d_]+|\d+|\s+")
_MAX_CARRY = 256  # a run longer than this (a "word" of 256 letters) is split: a few tokens more
EXACT_TEXT_CHARS = 1 << 16  # generated text estimated exactly, per response
EXACT_PROMPT_CHARS = 1 << 15  # request text estimated exactly, per request
DEFAULT_TOKENS_PER_CHAR = 0.25  # for text priced by length before any was estimated exactly
_WORD_CHARS_PER_TOKEN = 4
_TOKENS_PER_WORD = 4 / 3
_DIGITS_PER_TOKEN = 3


def _counts(text: str) -> tuple[int, int, int, int, int]:
    """(word bytes, words, digits, symbols, blank runs) of a text whose CJK characters have
    been replaced by stand-ins (see _text_cost). Each is a sum over runs, so the counts of a
    text cut between two runs are the sums of its pieces' counts."""
    words = _WORD.findall(text)
    word_bytes = len("".join(words).encode("utf-8", "surrogatepass"))
    digits = sum(map(len, _DIGITS.findall(text)))
    return word_bytes, len(words), digits, len(_SYMBOL.findall(text)), len(_BLANK.findall(text))


def _cost(word_bytes: int, words: int, digits: int, symbols: int, blanks: int) -> float:
    word_tokens = ((word_bytes + words) / _WORD_CHARS_PER_TOKEN + words * _TOKENS_PER_WORD) / 2
    return word_tokens + digits / _DIGITS_PER_TOKEN + symbols + blanks


def _stand_ins(text: str) -> str:
    # Stand-ins that the symbol count prices at one token each, like a CJK character.
    return text if text.isascii() else _CJK.sub("\x00", text)


def _text_cost(text: str) -> float:
    """Unrounded estimate; sums of these are rounded once."""
    if not text:
        return 0.0
    return _cost(*_counts(_stand_ins(text)))


_HELD_CHARS = 16_384  # text a TextTokens holds before counting it


class TextTokens:
    """estimate_text_tokens of a text given in parts (a stream's deltas), in bounded memory.

    Each part is counted when it comes, but for its last run of letters, digits or blanks,
    which the next part may continue: that run is carried over (at most _MAX_CARRY
    characters). The first ``exact_chars`` characters are estimated exactly; the rest is priced
    by length at the rate the exact part had.
    """

    __slots__ = ("_counts", "_carry", "_left", "_exact_chars", "_extra_chars", "_pending", "_held")

    def __init__(self, exact_chars: int = EXACT_TEXT_CHARS) -> None:
        self._counts = [0, 0, 0, 0, 0]
        self._carry = ""
        self._left = exact_chars
        self._exact_chars = 0
        self._extra_chars = 0
        # Parts not counted yet: counted when the estimate is asked for (most answers report a
        # usage that is used, and their text is never counted) or once they hold _HELD_CHARS.
        self._pending: list[Any] = []  # text, or (source, parts) to take text from
        self._held = 0

    def add(self, text: str) -> None:
        if not text:
            return
        self._pending.append(text)
        self._held += len(text)
        if self._held > _HELD_CHARS:
            self._count_pending()

    def add_later(self, source: str, parts: Callable[[str], list[str]]) -> None:
        """Text still to be taken out of `source` by `parts(source)`, in its turn, if the count
        is ever asked for."""
        self._pending.append((source, parts))
        self._held += len(source)
        if self._held > _HELD_CHARS:
            self._count_pending()

    def _count_pending(self) -> None:
        pending, self._pending, self._held = self._pending, [], 0
        for item in pending:
            if isinstance(item, str):
                self._count(item)
            else:
                source, parts = item
                for text in parts(source):
                    if text:
                        self._count(text)

    def _count(self, text: str) -> None:
        if len(text) > self._left:
            self._extra_chars += len(text) - self._left
            text = text[: self._left]
            if not text:
                return
        self._left -= len(text)
        self._exact_chars += len(text)
        text = self._carry + _stand_ins(text)
        tail = text[-_MAX_CARRY:]
        run = _RUN.match(tail[::-1])
        keep = run.end() if run else 0
        if keep == len(tail) and len(text) >= _MAX_CARRY:
            keep = 0  # one run fills the whole window: count it now
        self._carry = text[len(text) - keep :]
        counted = text[: len(text) - keep]
        if counted:
            for i, n in enumerate(_counts(counted)):
                self._counts[i] += n

    def cost(self) -> float:
        self._count_pending()
        counts = self._counts
        if self._carry:
            counts = [a + b for a, b in zip(counts, _counts(self._carry), strict=True)]
        exact = _cost(*counts)
        if not self._extra_chars:
            return exact
        rate = exact / self._exact_chars if self._exact_chars else DEFAULT_TOKENS_PER_CHAR
        return exact + self._extra_chars * rate

    def total(self) -> int:
        cost = self.cost()
        return max(1, _round(cost)) if cost else 0


class _PromptCost:
    """Sums the cost of a request's text fields, the first EXACT_PROMPT_CHARS characters
    exactly and the rest by length at the rate the exact part had."""

    __slots__ = ("exact", "exact_chars", "extra_chars", "left")

    def __init__(self, exact_chars: int) -> None:
        self.exact, self.exact_chars, self.extra_chars, self.left = 0.0, 0, 0, exact_chars

    def add(self, text: str) -> None:
        if not text:
            return
        if len(text) > self.left:
            self.extra_chars += len(text) - self.left
            text = text[: self.left]
        self.left -= len(text)
        self.exact_chars += len(text)
        self.exact += _text_cost(text)

    def cost(self) -> float:
        rate = self.exact / self.exact_chars if self.exact_chars else DEFAULT_TOKENS_PER_CHAR
        return self.exact + self.extra_chars * rate


def _round(cost: float) -> int:
    return math.floor(cost + 0.5)


def estimate_text_tokens(text: str) -> int:
    """Estimated tokens of a text under a typical BPE vocabulary."""
    tokens = TextTokens()
    tokens.add(text)
    return tokens.total()


def _messages(body: Any) -> list[dict[str, Any]]:
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return []
    return [m for m in messages if isinstance(m, dict)]


def _parts(content: Any) -> list[Any]:
    return content if isinstance(content, list) else []


def _content_text(content: Any) -> str:
    """Text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    return "".join(
        text
        for part in _parts(content)
        if isinstance(text := part.get("text") if isinstance(part, dict) else part, str)
    )


def _media_parts(body: Any) -> int:
    """Content parts that are neither text nor text blocks (images, audio, files)."""
    return sum(
        1
        for message in _messages(body)
        for part in _parts(message.get("content"))
        if isinstance(part, dict)
        and not isinstance(part.get("text"), str)
        and part.get("type") not in _TEXT_PART_TYPES
    )


def _json_text(value: Any) -> str:
    if value is None:
        return ""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return ""


def estimate_prompt_tokens(body: dict[str, Any], exact_chars: int = EXACT_PROMPT_CHARS) -> int:
    """Estimated prompt tokens of a chat completion request body (bounded work: see the module
    docstring)."""
    text = _PromptCost(exact_chars)
    overhead = REPLY_PRIMING
    for message in _messages(body):
        overhead += MESSAGE_OVERHEAD
        text.add(_content_text(message.get("content")))
        name = message.get("name")
        if isinstance(name, str):
            text.add(name)
        # An assistant turn's tool calls are replayed to the model as text.
        text.add(_json_text(message.get("tool_calls")))
    if isinstance(body, dict):
        text.add(_json_text(body.get("tools")))
        text.add(_json_text(body.get("functions")))
    return _round(overhead + text.cost()) + _media_parts(body) * MEDIA_PART_ESTIMATE


def prompt_tokens_upper_bound(body_bytes_len: int, body: dict[str, Any]) -> int:
    """An upper bound on the prompt tokens of a request (see the module docstring).

    ``body_bytes_len`` is the length of the decoded (not compressed) request body.
    """
    media = _media_parts(body) * MEDIA_PART_ALLOWANCE
    return max(0, body_bytes_len) + UPPER_BOUND_MARGIN + media

"""The simulated upstream's tokenizer: a stand-in for a BPE vocabulary.

A token is a run of at most four word characters with its leading space, or one
other character. Like a byte-level BPE, every token covers at least one byte,
so a text never has more tokens than UTF-8 bytes.
"""

import re

_TOKEN = re.compile(r"\s?\w{1,4}|\s?[^\w\s]|\s+")

MESSAGE_OVERHEAD = 4  # role and separators, as chat templates add per message
REPLY_PRIMING = 3  # the assistant header that starts the reply


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def message_text(content: object) -> str:
    """Text of a message's content: a string, or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text", ""), str)
        )
    return ""


def count_prompt_tokens(messages: list[dict]) -> int:
    total = REPLY_PRIMING
    for message in messages:
        total += MESSAGE_OVERHEAD + count_tokens(message_text(message.get("content")))
        name = message.get("name")
        if isinstance(name, str):
            total += count_tokens(name)
    return total

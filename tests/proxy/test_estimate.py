import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering.proxy.estimate import (
    EXACT_PROMPT_CHARS,
    EXACT_TEXT_CHARS,
    MEDIA_PART_ALLOWANCE,
    MESSAGE_OVERHEAD,
    REPLY_PRIMING,
    TextTokens,
    estimate_prompt_tokens,
    estimate_text_tokens,
    prompt_tokens_upper_bound,
)
from metering.sim.tokenizer import count_prompt_tokens, count_tokens

# Common English words of 2-10 letters.
WORDS = """
the of and to in is it you that he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do how
their if will up other about out many then them these so some her would make like him into time
has look two more write go see number no way could people my than first water been call who oil
its now find long down day did get come made may part over new sound take only little work know
place year live me back give most very after thing our just name good sentence man think say
great where help through much before line right too mean old any same tell boy follow came want
show also around form three small set put end does another well large must big even such because
turn here why ask went men read need land different home us move try kind hand picture again
change off play spell air away animal house point page letter mother answer found study still
learn should world government important business children question
example problem between understand remember together something without although
thousand certainly
""".split()  # noqa: SIM905


def prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 15))]
        words[0] = words[0].capitalize()
        for i in range(len(words) - 1):
            if rng.random() < 0.1:
                words[i] += ","
        out.append(" ".join(words) + ".")
    return " ".join(out)


def within(estimate: int, actual: int, tolerance: float = 0.15) -> bool:
    return abs(estimate - actual) <= tolerance * actual


@pytest.mark.parametrize("seed", range(8))
def test_text_estimate_within_15_percent_on_prose(seed):
    rng = random.Random(seed)
    for sentences in (6, 10, 20, 60):
        text = prose(rng, sentences)
        actual = count_tokens(text)
        assert actual >= 50
        assert within(estimate_text_tokens(text), actual), (estimate_text_tokens(text), actual)


@pytest.mark.parametrize("seed", range(8))
def test_prompt_estimate_within_15_percent(seed):
    rng = random.Random(100 + seed)
    roles = ["system", "user", "assistant"]
    messages = [
        {"role": rng.choice(roles), "content": prose(rng, rng.randint(1, 6))}
        for _ in range(rng.randint(2, 8))
    ]
    messages[1]["content"] = [{"type": "text", "text": prose(rng, 3)}]
    messages[0]["name"] = "helper"
    body = {"model": "m", "messages": messages}
    actual = count_prompt_tokens(messages)
    assert within(estimate_prompt_tokens(body), actual), (estimate_prompt_tokens(body), actual)


def test_text_estimate_basics():
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("hi") == 1
    # GPT-4's tokenizer gives 4 (Hello|,| world|!), the simulated one 6.
    assert 4 <= estimate_text_tokens("Hello, world!") <= 6
    # CJK: about one token per character.
    assert estimate_text_tokens("你好世界，今天天气很好") == 11
    # Digits go in groups of three.
    assert estimate_text_tokens("123456789") == 3


def test_prompt_estimate_counts_tools_and_tool_calls():
    messages = [{"role": "user", "content": "What is the weather?"}]
    base = estimate_prompt_tokens({"messages": messages})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    assert estimate_prompt_tokens({"messages": messages, "tools": tools}) > base + 20
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    with_call = messages + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert estimate_prompt_tokens({"messages": with_call}) > base + 10


def test_prompt_estimate_tolerates_garbage():
    assert estimate_prompt_tokens({}) == 3
    assert estimate_prompt_tokens({"messages": "x"}) == 3
    assert estimate_prompt_tokens({"messages": [None, {"content": 5}], "tools": {1, 2}}) == 7
    assert estimate_prompt_tokens(None) == 3  # type: ignore[arg-type]


def test_media_parts_get_an_allowance():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    size = len(json.dumps(body).encode())
    assert prompt_tokens_upper_bound(size, body) >= size + MEDIA_PART_ALLOWANCE
    assert estimate_prompt_tokens(body) > 700
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    assert estimate_prompt_tokens({"messages": [refusal]}) < 20


# --- the upper bound ----------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
_content = st.one_of(
    _text,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, _text), max_size=3),
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _content},
    optional={"name": st.text(max_size=10)},
)


@settings(max_examples=300)
@given(messages=st.lists(_message, max_size=8), ascii_only=st.booleans())
def test_upper_bound_property(messages, ascii_only):
    body = {"model": "m", "messages": messages}
    size = len(json.dumps(body, ensure_ascii=ascii_only, separators=(",", ":")).encode())
    bound = prompt_tokens_upper_bound(size, body)
    assert bound >= count_prompt_tokens(messages)
    assert bound >= estimate_prompt_tokens(body)


@given(text=st.text(max_size=200))
def test_text_estimate_never_exceeds_utf8_bytes(text):
    assert estimate_text_tokens(text) <= len(text.encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from("ab Z09_,.!\n\t  é中あ한\x00"), max_size=800),
    st.lists(st.integers(min_value=1, max_value=40), max_size=60),
)
def test_text_counted_in_parts_equals_the_whole(text, cuts):
    """A stream's deltas counted one by one give the estimate of the whole delivered text."""
    tokens, at = TextTokens(), 0
    for cut in cuts:
        tokens.add(text[at : at + cut])
        at += cut
    tokens.add(text[at:])
    assert tokens.total() == estimate_text_tokens(text)


def test_long_text_is_priced_by_length_beyond_the_exact_part():
    """Work is bounded: past EXACT_TEXT_CHARS (EXACT_PROMPT_CHARS for a request) the text is
    priced at the rate of the part estimated exactly; for uniform text that is the same."""
    unit = "hello world, 42 "
    per_1000 = estimate_text_tokens(unit * 1000)  # exact: 16,000 characters
    reps = 4 * EXACT_TEXT_CHARS // len(unit)
    expected = per_1000 * reps // 1000
    assert abs(estimate_text_tokens(unit * reps) - expected) <= expected // 100
    reps = 2 * EXACT_PROMPT_CHARS // len(unit)
    body = {"messages": [{"role": "user", "content": unit * reps}]}
    expected = per_1000 * reps // 1000 + MESSAGE_OVERHEAD + REPLY_PRIMING
    assert abs(estimate_prompt_tokens(body) - expected) <= expected // 100
    # An endless stream: counted by length, nothing kept but the running sums.
    stream = TextTokens()
    for _ in range(1000):
        stream.add(unit * 4096)
    expected = per_1000 * 4096
    assert abs(stream.total() - expected) <= expected // 100

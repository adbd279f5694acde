import time

from hypothesis import given, settings
from hypothesis import strategies as st

from metering.proxy.sse import SSEEvent, SSEParser


def feed_all(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.flush()
    assert parser.pending == b""
    return events


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i : i + n] for i in range(0, len(data), n)]


def test_simple_events_and_done():
    raw = b'data: {"a":1}\n\ndata: [DONE]\n\n'
    events = feed_all([raw])
    assert [e.raw for e in events] == [b'data: {"a":1}\n\n', b"data: [DONE]\n\n"]
    assert [e.data for e in events] == ['{"a":1}', "[DONE]"]
    assert events[0].data != "[DONE]" and events[1].data == "[DONE]"


def test_byte_at_a_time_with_multibyte_utf8():
    raw = "data: héllo — 世界 🎉\n\ndata: x\n\n".encode()
    events = feed_all(split_every(raw, 1))
    assert [e.data for e in events] == ["héllo — 世界 🎉", "x"]
    assert b"".join(e.raw for e in events) == raw


def test_fields_comments_and_line_endings():
    raw = (
        b": keep-alive\r\n\r\n"
        b"event: ping\rdata:no-space\rdata:  two\r\r"
        b"id: 7\ndata\nretry: 10\nfoo\n\n"
    )
    events = feed_all([raw])
    assert [(e.data, e.event) for e in events] == [
        (None, None),
        ("no-space\n two", "ping"),
        ("", None),
    ]
    assert events[0].raw == b": keep-alive\r\n\r\n"


def test_pending_and_several_events_per_read():
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b\n\ndata: c") == [
        SSEEvent(b"data: a\n\n", "a", None),
        SSEEvent(b"data: b\n\n", "b", None),
    ]
    assert parser.pending == b"data: c"
    assert parser.feed(b"\n") == []
    assert parser.feed(b"\n") == [SSEEvent(b"data: c\n\n", "c", None)]
    assert parser.pending == b""


def test_crlf_split_between_reads():
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == [SSEEvent(b"data: a\r\n\r", "a", None)]
    # The LF completes the CRLF of the blank line: no spurious empty event.
    assert parser.feed(b"\n") == []
    assert parser.pending == b"\n"
    events = parser.feed(b"data: b\r\n\r\n")
    assert events == [SSEEvent(b"\ndata: b\r\n\r\n", "b", None)]


def test_cr_then_real_blank_line_is_an_empty_event():
    parser = SSEParser()
    assert [e.raw for e in parser.feed(b"data: a\r\r")] == [b"data: a\r\r"]
    # "\n" finishes the CRLF, the second "\n" is a blank line of its own.
    assert parser.feed(b"\n\n") == [SSEEvent(b"\n\n", None, None)]


def test_flush_returns_unterminated_event():
    parser = SSEParser()
    assert parser.feed(b"data: a\n\nevent: x\ndata: tail") == [SSEEvent(b"data: a\n\n", "a", None)]
    assert parser.flush() == [SSEEvent(b"event: x\ndata: tail", "tail", "x")]
    assert parser.flush() == []


def test_bom_is_ignored_for_fields_but_kept_in_raw():
    raw = b"\xef\xbb\xbfdata: a\n\n"
    events = feed_all([raw])
    assert events == [SSEEvent(raw, "a", None)]


def test_one_event_per_read_is_taken_whole_and_exactly():
    parser = SSEParser(max_event_bytes=64)
    reads = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n", b"data: x\n\ndata: y\n\n", b"data: z\n\n"]
    events = [event for read in reads for event in parser.feed(read)]
    assert [e.data for e in events] == ['{"a": 1}', "[DONE]", "x", "y", "z"]
    assert [e.raw for e in events[:2]] == reads[:2] and events[2].raw == b"data: x\n\n"
    assert events[0].raw is reads[0]  # not copied
    # Still bounded: a whole event over the limit stops the parser.
    big = SSEParser(max_event_bytes=16)
    assert big.feed(b"data: " + b"x" * 20 + b"\n\n") == [] and big.too_large
    # A read that opens with the LF of a CRLF dispatched at the end of the last one.
    crlf = SSEParser()
    assert [e.raw for e in crlf.feed(b"data: a\r\n\r")] == [b"data: a\r\n\r"]
    assert [e.raw for e in crlf.feed(b"\ndata: b\n\n")] == [b"\ndata: b\n\n"]


def test_large_event_in_small_reads_is_linear():
    payload = b"data: " + b"x" * 2_000_000 + b"\n\n"
    chunks = split_every(payload, 512)
    started = time.perf_counter()
    events = feed_all(chunks)
    assert time.perf_counter() - started < 2.0
    assert len(events) == 1 and len(events[0].data) == 2_000_000


# --- property test: random events, random line endings, random splits ---------

_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12
)
_line = st.one_of(
    st.tuples(st.just("data"), _text),
    st.tuples(st.just("event"), _text),
    st.tuples(st.just("comment"), _text),
    st.tuples(st.just("id"), _text),
    st.tuples(st.just("bare"), st.sampled_from(["data", "foo", "event"])),
)
_events = st.lists(st.lists(_line, min_size=1, max_size=5), max_size=6)


def serialize(draw_ending, events, terminated_last: bool):
    """Bytes of the stream, and per event its bytes and expected (data, event)."""
    parts: list[bytes] = []
    expected = []
    prev_ending = ""
    for index, lines in enumerate(events):
        out = []
        data: list[str] = []
        event = None
        for kind, value in lines:
            if kind == "data":
                # Without the optional space, a value's own leading space would be eaten.
                space = " " if value.startswith(" ") else draw_ending(["", " "])
                out.append(f"data:{space}{value}")
                data.append(value)
            elif kind == "event":
                out.append(f"event: {value}")
                event = value
            elif kind == "comment":
                out.append(f":{value}")
            elif kind == "id":
                out.append(f"id:{value}")
            else:
                out.append(value)
                if value == "data":
                    data.append("")
                elif value == "event":
                    event = ""
        text = ""
        last = index == len(events) - 1
        lines_out = out + ([""] if not last or terminated_last else [])
        for i, line in enumerate(lines_out):
            # A LF right after a lone CR would merge with it into one CRLF.
            choices = (
                ["\r", "\r\n"] if (line == "" and prev_ending == "\r") else ["\n", "\r\n", "\r"]
            )
            if last and not terminated_last and i == len(lines_out) - 1:
                choices = choices + [""]
            ending = draw_ending(choices)
            text += line + ending
            prev_ending = ending
        parts.append(text.encode())
        expected.append(("\n".join(data) if data else None, event))
    return parts, expected


@settings(max_examples=300, deadline=None)
@given(events=_events, terminated_last=st.booleans(), data=st.data())
def test_roundtrip_property(events, terminated_last, data):
    def draw_ending(choices):
        return data.draw(st.sampled_from(choices))

    parts, expected = serialize(draw_ending, events, terminated_last)
    stream = b"".join(parts)

    # Unsplit: every event is exactly its serialized bytes.
    whole = feed_all([stream])
    assert [e.raw for e in whole] == parts
    assert [(e.data, e.event) for e in whole] == expected

    # One event per read (most reads of a provider's stream): each event is its read.
    one_each = feed_all(parts)
    assert b"".join(e.raw for e in one_each) == stream
    if not any(p.endswith(b"\r") for p in parts):  # no CRLF left half-read between them
        assert [e.raw for e in one_each] == parts
        assert [(e.data, e.event) for e in one_each] == expected

    # Split at random points: same fields, and the bytes add up exactly.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    events_out = feed_all(chunks)
    assert b"".join(e.raw for e in events_out) == stream
    fields = [(e.data, e.event) for e in events_out]
    # A CRLF split after its CR leaves the LF to open the following "event" on its own
    # at the very end of the stream; it carries no fields.
    if fields and len(fields) == len(expected) + 1:
        assert events_out[-1].raw == b"\n" and fields[-1] == (None, None)
        fields = fields[:-1]
    assert fields == expected

"""The Responses events a chat stream's chunks become (metering.proxy.responses.face), for
chunks no well-behaved upstream sends: each event still valid JSON, numbered, in order."""

import json

from metering.proxy.responses.face import EventWriter, Face
from metering.proxy.responses.request import translate


def events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        event = json.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        out.append(event)
    return out


def test_odd_chunks_still_make_valid_numbered_events():
    _, bridged = translate({"model": "m", "input": "hi", "stream": True})
    writer = EventWriter(Face(bridged, "resp_x"))
    raw = writer.start()
    writer.data('{"choices":[{"index":0,"delta":{"content":"a lone \\ud800 surrogate"}}]}')
    writer.data("not json")
    writer.data("[1, 2]")
    writer.data('{"choices":[{"index":1,"delta":{"content":"a second choice: left out"}}]}')
    writer.data('{"choices":[{"index":0,"delta":{"content":" and \\"quotes\\""}}]}')
    raw += writer.take() + writer.completed(None)
    written = events(raw)
    assert [e["sequence_number"] for e in written] == list(range(len(written)))
    deltas = [e["delta"] for e in written if e["type"] == "response.output_text.delta"]
    assert deltas == ["a lone \ud800 surrogate", ' and "quotes"']
    assert written[-1]["response"]["output"][0]["content"][0]["text"] == "".join(deltas)

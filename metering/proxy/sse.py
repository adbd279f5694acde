"""Incremental server-sent-events parser that keeps each event's exact bytes.

The proxy forwards upstream events byte for byte but reads each one on the side
(and may withhold one), so every event carries ``raw``: its bytes up to and
including the blank line that ends it. Concatenating ``raw`` of everything
``feed`` and ``flush`` return reproduces the input exactly.

Framing follows the WHATWG spec: lines end with CRLF, LF or a lone CR, and an
empty line dispatches the event. Two consequences shape the code:

* A CR at the very end of a read may be the first half of a CRLF. When that CR
  completes a blank line we dispatch at once (holding an event back until the
  next read would add latency) and remember that a LF opening the next read is
  the tail of that line ending: it becomes the first byte of the next event's
  ``raw`` but is not read as a line.
* Only the bytes that arrived since the last search (plus two bytes of overlap,
  the longest line ending) are searched for a terminator, so an event that
  trickles in over many reads costs linear time, and its fields are decoded
  once, when it completes.
"""

import re
from dataclasses import dataclass

__all__ = ["SSEEvent", "SSEParser"]

# A blank line is a line ending right after another one. Atomic groups keep a
# CRLF from being re-read as CR then LF (which would look like a blank line).
_BLANK_LINE = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")
_LINE_END = re.compile(r"\r\n|\r|\n")
_CR = 0x0D
_LF = 0x0A


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # exact bytes of the event, including its terminating blank line
    data: str | None  # data lines joined with "\n"; None when there was no data line
    event: str | None  # the event type, when an ``event:`` field was present


def _fields(body: bytes, strip_bom: bool) -> tuple[str | None, str | None]:
    """(data, event) of one event's bytes, blank line included or not."""
    # Fast path for the common ``data: ...\n\n`` shape: one slice, one decode.
    if (
        body.startswith(b"data: ")
        and body.endswith(b"\n\n")
        and body.count(b"\n", 0, -2) == 0
        and b"\r" not in body
    ):
        return body[6:-2].decode("utf-8", "replace"), None
    text = body.decode("utf-8", "replace")
    if strip_bom and text.startswith("\ufeff"):
        text = text[1:]
    data: list[str] = []
    event = None
    for line in _LINE_END.split(text):
        if not line:
            break  # the blank line ends the event (or the text ended)
        if line[0] == ":":
            continue  # comment
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        # id, retry and unknown fields do not matter to the proxy.
    return ("\n".join(data) if data else None), event


class SSEParser:
    """Feed it reads of an SSE stream; get back completed events in order.

    With ``max_event_bytes``, an event (or a line, terminated or not) longer than that stops the
    parser: ``too_large`` is set, the events before it are returned, its bytes are dropped and
    every later read is ignored. So an upstream cannot make it buffer without bound.
    """

    __slots__ = ("_buf", "_scan_from", "_lead", "_lf_pending", "_first", "_max", "too_large")

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._max = max_event_bytes
        self.too_large = False
        self._buf = bytearray()
        self._scan_from = 0  # where the terminator search resumes
        self._lead = 0  # 1 when _buf opens with the LF of a CRLF already dispatched
        self._lf_pending = False  # the last dispatched event ended on a read-final CR
        self._first = True  # a BOM may open the stream

    @property
    def pending(self) -> bytes:
        """Bytes buffered that are not yet part of a complete event."""
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk or self.too_large:
            return []
        buf = self._buf
        if not buf and not self._lf_pending and type(chunk) is bytes and b"\r" not in chunk:
            return self._feed_lf(chunk)
        if self._lf_pending:
            self._lf_pending = False
            if not buf and chunk[0] == _LF:
                self._lead = 1
                self._scan_from = 1
        # Two bytes of overlap: a line ending that straddles the reads starts there.
        scan = max(self._scan_from, len(buf) - 2)
        buf += chunk
        events: list[SSEEvent] = []
        start = 0
        size = len(buf)
        while True:
            body = start + self._lead
            scan = max(scan, body)
            if body < size and buf[body] in (_CR, _LF):
                # The event opens with a blank line: it is empty but still bytes to forward.
                end = body + (2 if buf[body : body + 2] == b"\r\n" else 1)
            else:
                m = _BLANK_LINE.search(buf, scan)
                if m is None:
                    break
                end = m.end()
            if self._max is not None and end - start > self._max:
                return self._stop(events)
            events.append(self._event(bytes(buf[start:end]), self._lead))
            self._lead = 0
            start = scan = end
            if end == size and buf[end - 1] == _CR:
                self._lf_pending = True  # the next read may open with this CR's LF
        if self._max is not None and size - start > self._max:
            return self._stop(events)
        if start:
            del buf[:start]
        self._scan_from = max(0, scan - start)
        return events

    def _feed_lf(self, chunk: bytes) -> list[SSEEvent]:
        """feed() of a read that starts with nothing buffered and holds no CR, the shape of
        nearly every read of a provider's stream: its lines end with LF alone, so an event
        ends at the first LF LF (or is a lone LF), found with bytes.find and cut out of the read
        itself (a read that is one whole event is that event's `raw`, not a copy). What is
        left unterminated is buffered for the general path, as it would have been."""
        events: list[SSEEvent] = []
        size = len(chunk)
        start = 0
        limit = self._max
        while start < size:
            if chunk[start] == _LF:
                end = start + 1  # the event opens with a blank line: empty, still forwarded
            else:
                found = chunk.find(b"\n\n", start)
                if found < 0:
                    break
                end = found + 2
            if limit is not None and end - start > limit:
                return self._stop(events)
            events.append(self._event(chunk[start:end], 0))
            start = end
        if start < size:
            if limit is not None and size - start > limit:
                return self._stop(events)
            self._buf += chunk[start:]
            self._scan_from = 0
        return events

    def _stop(self, events: list[SSEEvent]) -> list[SSEEvent]:
        self.too_large = True
        self._buf = bytearray()
        self._scan_from = self._lead = 0
        return events

    def flush(self) -> list[SSEEvent]:
        """End of stream: the unterminated remainder, if any, as a final event.

        A browser would discard such an event; the proxy still forwards its
        bytes and may want its data (e.g. a usage chunk cut before its blank line).
        """
        if not self._buf or self.too_large:
            return []
        event = self._event(bytes(self._buf), self._lead)
        self._buf.clear()
        self._scan_from = self._lead = 0
        return [event]

    def _event(self, raw: bytes, lead: int) -> SSEEvent:
        data, event = _fields(raw[lead:] if lead else raw, self._first)
        self._first = False
        return SSEEvent(raw, data, event)

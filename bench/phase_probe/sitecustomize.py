"""Loaded by `python -m bench.phases` into the server it starts (this folder first on its
PYTHONPATH), and only there: times each phase of a request in the server itself.

SIGUSR1 writes what was gathered since the last signal to $METERING_PHASES_OUT and starts over.
"""

import asyncio
import gc
import json
import os
import signal
import time

OUT = os.environ.get("METERING_PHASES_OUT")

if OUT:
    from metering.budgets import groups
    from metering.proxy import upstreams

    samples: dict[str, list[float]] = {}

    def note(kind: str, value: float) -> None:
        kept = samples.setdefault(kind, [])
        if len(kept) < 1_000_000:
            kept.append(value)

    def kind_of(item) -> str:
        # SettleQueue.hold submits (_HOLD, row, apart); a settle (event, reservation); the
        # hold writer of SQLite a row (dict).
        if isinstance(item, dict) or (isinstance(item, tuple) and len(item) == 3):
            return "hold wait"
        return "settle wait"

    submit = groups.GroupWriter.submit

    async def timed_submit(self, item):
        kind = kind_of(item)
        if kind == "hold wait":
            mark("hold submitted")
        started = time.perf_counter()
        try:
            return await submit(self, item)
        finally:
            note(kind, time.perf_counter() - started)
            if kind == "hold wait":
                mark("hold answered")
            _lag.start()

    groups.GroupWriter.submit = timed_submit

    init = groups.GroupWriter.__init__

    def timed_init(self, write_group, interrupted):
        async def timed_write(batch):
            note("group size", len(batch))
            started = time.perf_counter()
            try:
                return await write_group(batch)
            finally:
                note("group statement", time.perf_counter() - started)

        init(self, timed_write, interrupted)

    groups.GroupWriter.__init__ = timed_init

    import asyncpg.connection

    def timed_query(method):
        async def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return await method(self, *args, **kwargs)
            finally:
                note("database round trip", time.perf_counter() - started)

        return timed

    # Every statement sent through asyncpg itself (the group writers' statements), from its
    # send to its answer, as the writer sees it: the rest of "group statement" is the writer's
    # own work (parameters, futures answered).
    for name in ("execute", "fetchrow", "fetchval"):
        setattr(
            asyncpg.connection.Connection,
            name,
            timed_query(getattr(asyncpg.connection.Connection, name)),
        )

    send = upstreams.Upstreams.send

    async def timed_send(self, provider, request):
        mark("upstream call")
        started = time.perf_counter()
        try:
            return await send(self, provider, request)
        finally:
            note("upstream answer (headers)", time.perf_counter() - started)
            mark("upstream headers")

    upstreams.Upstreams.send = timed_send

    # The request's own path, between those waits: from its arrival at the server to its hold's
    # submission, from the hold's answer to the upstream call, and from the upstream's headers
    # to the first byte of the answer's body sent to the client (a stream's first chunk).
    from contextvars import ContextVar

    from metering.proxy import dispatch

    _marks: ContextVar[dict | None] = ContextVar("phase_marks", default=None)

    def mark(name: str) -> None:
        marks = _marks.get()
        if marks is not None and name not in marks:
            marks[name] = time.perf_counter()

    def span(kind: str, start: str, end: str) -> None:
        marks = _marks.get()
        if marks is not None and start in marks and end in marks:
            note(kind, marks[end] - marks[start])

    direct_call = dispatch.DirectChat.__call__

    def noted_end() -> None:
        mark("end")
        span("arrival to hold submitted", "arrival", "hold submitted")
        span("hold answered to upstream call", "hold answered", "upstream call")
        span("headers to first body byte", "upstream headers", "first body byte")
        span("arrival to end", "arrival", "end")

    async def timed_direct(self, scope, receive, send):
        if scope.get("path") != dispatch.CHAT_PATH:
            return await direct_call(self, scope, receive, send)
        token = _marks.set({"arrival": time.perf_counter()})

        async def timed_send_message(message):
            if message["type"] == "http.response.body":
                if message.get("body"):
                    mark("first body byte")
                if not message.get("more_body", False):
                    # Noted before the client can see the end: its request is in the window.
                    noted_end()
            await send(message)

        try:
            return await direct_call(self, scope, receive, timed_send_message)
        finally:
            _marks.reset(token)

    dispatch.DirectChat.__call__ = timed_direct

    class _Lag:
        """Each millisecond (a timer), a callback made ready: how long it waits for the loop to
        run it is how long any callback that became ready waits for the work ahead of it."""

        def __init__(self) -> None:
            self.loop = None

        def start(self) -> None:
            if self.loop is None:
                self.loop = asyncio.get_running_loop()
                self.loop.call_later(0.001, self._tick)

        def _tick(self) -> None:
            self.loop.call_soon(self._ran, time.perf_counter())
            self.loop.call_later(0.001, self._tick)

        def _ran(self, ready_at: float) -> None:
            note("loop lag", time.perf_counter() - ready_at)

    _lag = _Lag()

    _gc_started = [0.0]

    def _gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            _gc_started[0] = time.perf_counter()
        else:
            note(f"gc, generation {info['generation']}", time.perf_counter() - _gc_started[0])

    gc.callbacks.append(_gc_timer)

    def dump(*_) -> None:
        out = {}
        for kind, values in samples.items():
            values.sort()
            n = len(values)
            scale = 1 if kind == "group size" else 1000
            out[kind] = {
                "n": n,
                "mean": sum(values) / n * scale,
                "p50": values[n // 2] * scale,
                "p90": values[int(n * 0.9)] * scale,
                "p99": values[int(n * 0.99)] * scale,
                "max": values[-1] * scale,
            }
        samples.clear()
        with open(OUT, "w") as f:
            json.dump(out, f)

    signal.signal(signal.SIGUSR1, dump)

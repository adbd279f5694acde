"""The load generator: N requests at concurrency C over one aiohttp session, kept cheap so the
bench process is not what limits the figures (pre-encoded bodies, no JSON parsing of answers)."""

import asyncio
import math
import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

DONE = b"data: [DONE]"


@dataclass
class Target:
    """One kind of request: where it goes, with which credential and body."""

    url: str
    headers: dict[str, str]
    body: bytes
    stream: bool
    method: str = "POST"
    # Credentials spread over the workers: worker i sends with spread[i % len(spread)] (one
    # token per worker, say) instead of `headers`.
    spread: list[dict[str, str]] | None = None
    # How a complete stream ends: chat's [DONE], or a Responses stream's last event.
    ends: bytes = b"data: [DONE]"


@dataclass
class LoadResult:
    requests: int
    concurrency: int
    elapsed_s: float
    latencies_s: list[float]
    statuses: Counter
    ttfb_s: list[float] = field(default_factory=list)  # to the first byte of a 2xx stream's body
    request_ids: list[str] = field(default_factory=list)  # x-request-id of each 2xx answer
    errors: list[str] = field(default_factory=list)
    client_cpu_s: float = 0.0

    def add(self, other: "LoadResult") -> "LoadResult":
        """Fold another batch of the same scenario into this one."""
        self.requests += other.requests
        self.elapsed_s += other.elapsed_s
        self.latencies_s += other.latencies_s
        self.ttfb_s += other.ttfb_s
        self.statuses.update(other.statuses)
        self.request_ids += other.request_ids
        self.errors = (self.errors + other.errors)[:5]
        self.client_cpu_s += other.client_cpu_s
        return self

    @property
    def ok(self) -> int:
        return len(self.latencies_s)

    @property
    def failed(self) -> int:
        return self.requests - self.ok

    @property
    def rps(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s else 0.0

    def percentile_ms(self, q: float, values: list[float] | None = None) -> float:
        """Nearest-rank percentile of the successful requests' latencies (or of `values`), in
        ms."""
        values = self.latencies_s if values is None else values
        if not values:
            return math.nan
        ordered = sorted(values)
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        return ordered[rank - 1] * 1000

    def ttfb_percentile_ms(self, q: float) -> float:
        return self.percentile_ms(q, self.ttfb_s)


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _one(
    session: aiohttp.ClientSession, target: Target, headers: dict, result: LoadResult
) -> None:
    started = time.perf_counter()
    first = None
    try:
        async with session.request(
            target.method, target.url, data=target.body or None, headers=headers
        ) as response:
            if target.stream:
                body = await response.content.readany()
                first = time.perf_counter()
                body += await response.content.read()
            else:
                body = await response.read()
            status = response.status
            request_id = response.headers.get("x-request-id")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        result.statuses["exception"] += 1
        if len(result.errors) < 5:
            result.errors.append(repr(exc))
        return
    elapsed = time.perf_counter() - started
    result.statuses[status] += 1
    complete = not target.stream or (
        body.rstrip().endswith(DONE) if target.ends == DONE else target.ends in body[-4096:]
    )
    if 200 <= status < 300 and complete:
        result.latencies_s.append(elapsed)
        if first is not None:
            result.ttfb_s.append(first - started)
        if request_id:
            result.request_ids.append(request_id)
    elif len(result.errors) < 5:
        what = "incomplete stream" if 200 <= status < 300 else f"HTTP {status}"
        result.errors.append(f"{what}: {body[:300]!r}")


async def _drive(session: aiohttp.ClientSession, target: Target, n: int, c: int) -> LoadResult:
    result = LoadResult(n, c, 0.0, [], Counter())
    sent = 0

    async def worker(index: int) -> None:
        nonlocal sent
        headers = target.spread[index % len(target.spread)] if target.spread else target.headers
        while sent < n:
            sent += 1
            await _one(session, target, headers, result)

    cpu0 = _cpu_self()
    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(min(c, n))))
    result.elapsed_s = time.perf_counter() - started
    result.client_cpu_s = _cpu_self() - cpu0
    return result


class Stalled(RuntimeError):
    """A batch did not finish in time: the server under test is stuck or crawling."""


async def run_load(
    target: Target,
    requests: int,
    concurrency: int,
    warmup: int,
    on_measure=None,
    deadline_s: float | None = None,
) -> tuple[LoadResult, LoadResult | None]:
    """Warm up (opens the keep-alive connections, fills caches), then measure.

    `on_measure(phase)` is called with "start" and "end" right around the measured part, so
    the caller can sample process counters outside the warm-up. Returns (measured, warmup)."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        try:
            async with asyncio.timeout(deadline_s):
                warm = await _drive(session, target, warmup, concurrency) if warmup else None
                if on_measure:
                    on_measure("start")
                measured = await _drive(session, target, requests, concurrency)
        except TimeoutError:
            raise Stalled(
                f"{warmup} + {requests} requests at C={concurrency} to {target.url} did not "
                f"finish in {deadline_s:.0f} s"
            ) from None
        if on_measure:
            on_measure("end")
    return measured, warm


def run(
    target: Target,
    requests: int,
    concurrency: int,
    warmup: int,
    on_measure=None,
    deadline_s: float | None = None,
):
    """Synchronous entry point, on uvloop when it is there (a cheaper client)."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    return runner(run_load(target, requests, concurrency, warmup, on_measure, deadline_s))

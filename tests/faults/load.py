"""Concurrent clients of the official openai SDK against several replicas, each request marked
so the upstream's log and the ledger tell which ones reached it and were charged."""

import asyncio
import threading
import time
from dataclasses import dataclass, field

import openai

RETRY_PAUSE_S = 0.1  # a client's pause after a 503, before its next request


@dataclass
class Result:
    marker: str
    url: str  # the replica it was sent to
    started: float  # time.monotonic() when sent
    ended: float
    status: int
    request_id: str | None
    code: str | None = None
    retry_after: str | None = None


@dataclass
class Load:
    """`workers` clients, each sending one request after another to replica (its number modulo
    the replicas' count) until stop(); half the requests streamed, so some are under way when
    a fault comes. keys[i] is the token of worker i."""

    urls: list[str]
    keys: list[str]
    tag: str
    results: list[Result] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _count: int = 0

    async def _one(self, client: openai.AsyncOpenAI, url: str, n: int) -> Result:
        marker = f"{self.tag}-{n}"
        stream = n % 2 == 0
        directives = "sim:tokens=6" + (" sim:chunks=6 sim:delay_ms=30" if stream else "")
        started = time.monotonic()
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="gpt-sim",
                messages=[{"role": "user", "content": f"fault {marker} {directives}"}],
                max_tokens=6,
                stream=stream,
            )
            body = raw.parse()
            if stream:
                async for _ in body:  # type: ignore[union-attr]
                    pass
            return Result(
                marker, url, started, time.monotonic(), raw.status_code,
                raw.headers.get("x-request-id"),
            )  # fmt: skip
        except openai.APIStatusError as exc:
            error = exc.body if isinstance(exc.body, dict) else {}
            return Result(
                marker, url, started, time.monotonic(), exc.status_code,
                exc.response.headers.get("x-request-id"), error.get("code"),
                exc.response.headers.get("retry-after"),
            )  # fmt: skip
        except openai.APIConnectionError as exc:
            return Result(marker, url, started, time.monotonic(), 0, None, repr(exc))
        except Exception as exc:  # a stream broken after its 200, or anything else unexpected
            return Result(marker, url, started, time.monotonic(), -1, None, repr(exc)[:300])

    async def _worker(self, client: openai.AsyncOpenAI, url: str) -> None:
        while not self._stop.is_set():
            self._count += 1
            result = await self._one(client, url, self._count)
            with self.lock:
                self.results.append(result)
            if result.status == 503:
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _main(self) -> None:
        clients = {
            (url, key): openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120
            )
            for url in self.urls
            for key in set(self.keys)
        }
        urls = [self.urls[i % len(self.urls)] for i in range(len(self.keys))]
        workers = [
            self._worker(clients[(url, key)], url) for url, key in zip(urls, self.keys, strict=True)
        ]
        await asyncio.gather(*workers)
        for client in clients.values():
            await client.close()

    def start(self) -> "Load":
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(180)
            assert not self._thread.is_alive(), "the clients did not finish"

    def snapshot(self) -> list[Result]:
        with self.lock:
            return list(self.results)

    def ok_since(self, since: float) -> int:
        """2xx answers to requests sent at or after `since` (time.monotonic())."""
        assert self._thread is not None and self._thread.is_alive(), "the clients stopped"
        return sum(200 <= r.status < 300 and r.started >= since for r in self.snapshot())


def one(url: str, key: str, marker: str) -> Result:
    """One request, not streamed, by the official SDK (no retries): its outcome."""
    started = time.monotonic()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-sim",
            messages=[{"role": "user", "content": f"fault {marker} sim:tokens=6"}],
            max_tokens=6,
        )
        raw.parse()
        return Result(
            marker, url, started, time.monotonic(), raw.status_code,
            raw.headers.get("x-request-id"),
        )  # fmt: skip
    except openai.APIStatusError as exc:
        error = exc.body if isinstance(exc.body, dict) else {}
        return Result(
            marker, url, started, time.monotonic(), exc.status_code,
            exc.response.headers.get("x-request-id"), error.get("code"),
        )  # fmt: skip
    finally:
        client.close()

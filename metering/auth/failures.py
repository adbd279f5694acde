"""Failed bearer credentials, counted per client address, in this process's memory.

An address that presented `limit` failed credentials within the current minute gets 429
`rate_limited` with `retry-after` (the seconds left in that minute) for every credential it
presents until the minute ends, the right ones too: a guess that happens to be right is refused
like the others. Only failures are counted, so a client whose credentials work costs one
dictionary lookup on an empty dictionary. The count is per process: with N replicas (or
workers) an address may fail up to N times the limit before every one of them refuses it.
"""

import math
import time
from collections.abc import Callable

from metering.errors import MeteringError, retry_after

WINDOW_S = 60.0


class CredentialsThrottled(MeteringError):
    status, code = 429, "rate_limited"


class FailedCredentials:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = per_minute
        self.clock = clock
        self.window_start = clock()
        self.counts: dict[str, int] = {}

    def check(self, address: str) -> None:
        """Raise CredentialsThrottled if this address has used up its failures."""
        if not self.counts:
            return
        now = self._roll()
        if self.counts.get(address, 0) >= self.limit:
            retry = max(1, math.ceil(self.window_start + WINDOW_S - now))
            raise CredentialsThrottled(
                f"too many failed credentials from this address: retry in {retry} s",
                headers=retry_after(self.window_start + WINDOW_S - now),
            )

    def failed(self, address: str) -> None:
        self._roll()
        self.counts[address] = self.counts.get(address, 0) + 1

    def _roll(self) -> float:
        # A new minute forgets the last one whole: memory is bounded by one minute's addresses.
        now = self.clock()
        if now - self.window_start >= WINDOW_S:
            self.window_start = now
            self.counts = {}
        return now

"""Which providers a request may go to, cheapest first, and which are resting after failures.

A model offered by several providers is tried in order of the request's expected
cost: estimated prompt tokens x input price + expected output x output price,
where expected output is the client's max_tokens, else EXPECTED_OUTPUT tokens.
`model@provider` pins one provider. `max_input_usd_per_mtok` and
`max_output_usd_per_mtok` in the body cap the prices a request accepts.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_FLOOR
from typing import Any

from sqlalchemy import String

from metering.errors import InvalidRequest, ModelNotFound
from metering.models import Hold
from metering.money import MAX_USD, MICRO
from metering.numbers import NumberError, parse_decimal
from metering.settings import Catalog, ModelRoute

EXPECTED_OUTPUT = 256
CAP_FIELDS = ("max_input_usd_per_mtok", "max_output_usd_per_mtok")
# `<upstream model>/ep/<endpoint>` is stored with the hold and the ledger event.
_UPSTREAM_MODEL = Hold.__table__.c.upstream_model.type
assert isinstance(_UPSTREAM_MODEL, String) and _UPSTREAM_MODEL.length is not None
UPSTREAM_MODEL_CHARS = _UPSTREAM_MODEL.length


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    provider: str | None  # pinned with model@provider
    endpoint: str | None  # TokenChange's <model>/ep/<endpoint>


def parse_model(model: str) -> Target:
    name, _, provider = model.partition("@")
    name, _, endpoint = name.partition("/ep/")
    return Target(name=name, provider=provider or None, endpoint=endpoint or None)


def price_cap(body: dict[str, Any], key: str) -> int | None:
    """A price cap from the body, in micro-USD per 1M tokens: 0 to MAX_USD, checked as text
    before any arithmetic (a short "1e500000" would otherwise cost seconds of CPU)."""
    value = body.get(key)
    if value is None:
        return None
    try:
        cap = parse_decimal(value, key, low=0, high=MAX_USD, floats=True)
    except NumberError as exc:
        raise InvalidRequest(str(exc), param=key) from None
    return int((cap * MICRO).to_integral_value(rounding=ROUND_FLOOR))


def pinnable(routes: list[ModelRoute], target: Target) -> list[ModelRoute]:
    """The routes whose `<upstream model>/ep/<endpoint>` fits where it is stored."""
    if target.endpoint is None:
        return routes
    fits = [
        r
        for r in routes
        if len(r.upstream_model) + 4 + len(target.endpoint) <= UPSTREAM_MODEL_CHARS
    ]
    if not fits:
        longest = UPSTREAM_MODEL_CHARS - 4 - min(len(r.upstream_model) for r in routes)
        raise InvalidRequest(
            f"the endpoint after /ep/ is {len(target.endpoint)} characters; "
            f"{target.name!r} allows at most {max(longest, 0)}",
            param="model",
        )
    return fits


def expected_cost(route: ModelRoute, prompt_tokens: int, output_tokens: int) -> int:
    return prompt_tokens * route.input_micro + output_tokens * route.output_micro


def candidates(
    catalog: Catalog,
    target: Target,
    body: dict[str, Any],
    prompt_tokens: int | Callable[[], int],
    max_tokens: int | None,
) -> list[ModelRoute]:
    routes = catalog.routes(target.name)
    if not routes:
        raise ModelNotFound(f"model {target.name!r} is not served here", param="model")
    if target.provider is not None:
        routes = [r for r in routes if r.provider == target.provider]
        if not routes:
            raise ModelNotFound(
                f"provider {target.provider!r} does not serve model {target.name!r}", param="model"
            )
    routes = pinnable(routes, target)
    max_in, max_out = price_cap(body, CAP_FIELDS[0]), price_cap(body, CAP_FIELDS[1])
    affordable = [
        r
        for r in routes
        if (max_in is None or r.input_micro <= max_in)
        and (max_out is None or r.output_micro <= max_out)
    ]
    if not affordable:
        raise InvalidRequest(
            f"no provider of {target.name!r} meets the price caps in this request",
            param=CAP_FIELDS[0] if max_in is not None else CAP_FIELDS[1],
        )
    if len(affordable) == 1:
        return affordable
    if callable(prompt_tokens):  # estimated only when there is a choice to make
        prompt_tokens = prompt_tokens()
    output = max_tokens if max_tokens is not None else EXPECTED_OUTPUT
    return sorted(affordable, key=lambda r: (expected_cost(r, prompt_tokens, output), r.provider))


class Breakers:
    """Per-provider circuit breakers: after `threshold` failures in a row a provider rests for
    `cooldown_s`, then one request may try it again (half-open)."""

    def __init__(
        self,
        threshold: int = 3,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold, self.cooldown_s, self.clock = threshold, cooldown_s, clock
        self.failures: dict[str, int] = {}
        self.open_until: dict[str, float] = {}

    def available(self, provider: str) -> bool:
        until = self.open_until.get(provider)
        if until is None:
            return True
        if self.clock() >= until:
            # Half-open: let this one through; a failure re-opens at once.
            self.open_until[provider] = self.clock() + self.cooldown_s
            self.failures[provider] = self.threshold - 1
            return True
        return False

    def succeeded(self, provider: str) -> None:
        self.failures.pop(provider, None)
        self.open_until.pop(provider, None)

    def failed(self, provider: str) -> None:
        count = self.failures.get(provider, 0) + 1
        self.failures[provider] = count
        if count >= self.threshold:
            self.open_until[provider] = self.clock() + self.cooldown_s

    def order(self, routes: list[ModelRoute]) -> list[ModelRoute]:
        """Providers resting after failures are skipped, unless nothing else is left."""
        ready = [r for r in routes if self.available(r.provider)]
        return ready or routes

"""Limits beyond credit at the door of a request: the model allow-lists (403) and the rate and
parallel limits (429, with OpenAI's x-ratelimit-* headers and retry-after, so the official SDKs'
own retries work). The counting itself is metering.budgets.rates'."""

from dataclasses import replace

from metering import metrics
from metering.auth.principal import Principal
from metering.budgets import rates
from metering.budgets.rates import RateClaim, RateLimited
from metering.budgets.refusals import Refused
from metering.budgets.reserve import HoldSpec, Reservation, reserve
from metering.db import utcnow, write_in_doubt
from metering.errors import MeteringError, retry_after
from metering.limits import Limits
from metering.proxy.runtime import ProxyServices
from metering.proxy.tracing import RequestTrace


class RateLimitExceeded(MeteringError):
    status, code = 429, "rate_limit_exceeded"
    refused: Refused | None = None  # what refused it, for the refusals table


class ModelNotAllowed(MeteringError):
    status, code = 403, "model_not_allowed"
    refused: Refused | None = None


# The name of each kind in metrics and headers.
KIND_NAMES = {"rpm": "requests", "tpm": "tokens", "parallel": "parallel"}


def check_model(principal: Principal, model: str) -> None:
    """403 when a scope's allow-list leaves the model out."""
    limits = principal.limits
    if limits is None:
        return
    scope = limits.refusing(model)
    if scope is None:
        return
    metrics.limit_rejected(scope.scope, "model")
    allowed = ", ".join(scope.models or ()) or "(none)"
    error = ModelNotAllowed(
        f"model {model} is not allowed for {scope.scope} {scope.subject_id}: its allowed_models "
        f"are {allowed}",
        param="model",
        headers={"x-limit-scope": scope.scope},
    )
    error.refused = Refused("model", scope.scope, scope.subject_id)
    raise error


def visible_models(principal: Principal, names: list[str]) -> list[str]:
    limits = principal.limits
    if limits is None:
        return names
    return [name for name in names if limits.refusing(name) is None]


def rate_limited(exc: RateLimited) -> RateLimitExceeded:
    refusal = exc.refusal
    now = utcnow()
    metrics.limit_rejected(refusal.scope, KIND_NAMES[refusal.kind])
    headers = {"x-limit-scope": refusal.scope}
    wait = refusal.retry_after_s(now)
    if wait is not None:
        # A minute's end to the millisecond; a parallel slot, at a guess, in a second.
        left = 1.0 if refusal.resets_at is None else (refusal.resets_at - now).total_seconds()
        headers.update(retry_after(max(left, 0.0)))
    if refusal.kind != "parallel":
        suffix = KIND_NAMES[refusal.kind]
        headers[f"x-ratelimit-limit-{suffix}"] = str(refusal.limit)
        headers[f"x-ratelimit-remaining-{suffix}"] = str(max(refusal.limit - refusal.used, 0))
        if refusal.resets_at is not None:
            left = (refusal.resets_at - now).total_seconds()
            headers[f"x-ratelimit-reset-{suffix}"] = rates.duration(max(left, 0))
    error = RateLimitExceeded(rates.explain(refusal, now), headers=headers)
    if wait is None:  # a limit of 0, or a request larger than the limit: no wait helps
        error.should_retry = False
    error.refused = Refused(refusal.kind, refusal.scope, refusal.subject_id)
    return error


class Admission:
    """One request at the door, and the one owner of the rate claim its admission takes, from
    the moment it is taken until a committed hold carries it.

    hold() counts the request against its rate and parallel limits (one statement; the 429
    when one would be passed), then reserves its hold (metering.budgets.reserve), the claim
    written on it. Whatever ends the request before that hold is committed (a budget's refusal,
    an unknown run, the database failing, a cancellation) has the claim given back here before
    the exception goes on: nothing else gives back a claim no hold carries. Once a hold carries
    it, whoever ends the hold gives it back (settle, release, the expired-hold sweep).

    `spec`: the hold's spec, as reserved once hold() has returned (carrying the claim, and the
    output allowance a tpm_limit leaves)."""

    __slots__ = ("services", "limits", "spec", "trace")

    def __init__(
        self,
        services: ProxyServices,
        limits: Limits | None,
        spec: HoldSpec,
        trace: RequestTrace | None = None,
    ) -> None:
        self.services = services
        self.limits = limits
        self.spec = spec
        self.trace = trace  # the request's spans, when tracing is on

    async def hold(self, prompt_bound: int, choices: int) -> Reservation:
        """Admit, then reserve: the reservation, with the claim handed over to its hold."""
        if self.trace is not None:
            return await self._traced_hold(self.trace, prompt_bound, choices)
        return await self._hold(prompt_bound, choices)

    async def _traced_hold(
        self, trace: RequestTrace, prompt_bound: int, choices: int
    ) -> Reservation:
        """hold(), its two steps in spans of their own: `admission` (the rate and parallel
        limits) and `hold` (the budget reservation)."""
        with trace.step("admission") as span:
            rated = self.limits is not None and self.limits.rated
            span.set_attribute("metering.limits.rated", rated)
            claim = await self._admit(prompt_bound, choices) if rated else None
        with trace.step("hold") as span:
            reservation = await self._reserve(claim)
            trace.allowed(span)
            return reservation

    async def _hold(self, prompt_bound: int, choices: int) -> Reservation:
        limits = self.limits
        if limits is None or not limits.rated:
            return await self._reserve(None)
        return await self._reserve(await self._admit(prompt_bound, choices))

    async def _admit(self, prompt_bound: int, choices: int) -> RateClaim:
        """Count the request against its rate and parallel limits (429 past one): the claim,
        written on the spec with the output allowance a tpm_limit leaves."""
        limits, spec = self.limits, self.spec
        assert limits is not None
        allowance = spec.model_max_output
        tpm = limits.tightest_tpm()
        if tpm is not None and spec.max_tokens is None:
            # No max_tokens from the client: the output allowance is what the tpm_limit leaves.
            fits = (tpm - prompt_bound) // max(choices, 1)
            if 1 <= fits < allowance:
                allowance = fits
        wanted = spec.max_tokens if spec.max_tokens is not None else allowance
        try:
            claim = await self.services.budgets.admissions.admit(
                limits, prompt_bound + wanted * choices
            )
        except RateLimited as exc:
            raise rate_limited(exc) from None
        self.spec = replace(spec, model_max_output=allowance, rates=claim)
        return claim

    async def _reserve(self, claim: RateClaim | None) -> Reservation:
        """The hold, reserved; the rate claim (if one was taken) given back when it fails."""
        budgets = self.services.budgets
        ttl_s = self.services.settings.hold_ttl_s
        if claim is None:
            try:
                return await reserve(budgets, self.spec, ttl_s, budgets.leases)
            except BaseException as exc:
                self._doubt(exc, rates_too=False)
                raise
        try:
            return await reserve(budgets, self.spec, ttl_s, budgets.leases)
        except BaseException as exc:
            # No hold carries the claim: given back, whatever ended the request.
            assert self.limits is not None
            given_back = await rates.release_claim(self.services.db, claim, self.limits)
            self._doubt(exc, rates_too=not given_back)
            raise

    def _doubt(self, exc: BaseException, rates_too: bool) -> None:
        """The hold's write failed in a way after which it may have committed (the connection
        lost mid-commit): the request is answered without it (503), and the hold released once
        the database answers (metering.proxy.live); `rates_too`: with its rate claim."""
        if write_in_doubt(exc):
            self.services.live_holds.doubt(self.spec.hold_id, rates_too)

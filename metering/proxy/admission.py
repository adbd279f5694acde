"""Limits beyond credit at the door of a request: the model allow-lists (403) and the rate and
parallel limits (429, with OpenAI's x-ratelimit-* headers and retry-after, so the official SDKs'
own retries work). The counting itself is metering.budgets.rates'."""

from dataclasses import replace

from metering import metrics
from metering.auth.principal import Principal
from metering.budgets import rates
from metering.budgets.rates import RateLimited
from metering.budgets.refusals import Refused
from metering.budgets.reserve import HoldSpec, Reservation, reserve
from metering.db import refused_by_server, utcnow
from metering.errors import MeteringError
from metering.limits import Limits
from metering.proxy.runtime import ProxyServices


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
        headers["retry-after"] = str(wait)
    if refusal.kind != "parallel":
        suffix = KIND_NAMES[refusal.kind]
        headers[f"x-ratelimit-limit-{suffix}"] = str(refusal.limit)
        headers[f"x-ratelimit-remaining-{suffix}"] = str(max(refusal.limit - refusal.used, 0))
        if refusal.resets_at is not None:
            left = (refusal.resets_at - now).total_seconds()
            headers[f"x-ratelimit-reset-{suffix}"] = rates.duration(max(left, 0))
    error = RateLimitExceeded(rates.explain(refusal, now), headers=headers)
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

    __slots__ = ("services", "limits", "spec")

    def __init__(self, services: ProxyServices, limits: Limits | None, spec: HoldSpec) -> None:
        self.services = services
        self.limits = limits
        self.spec = spec

    async def hold(self, prompt_bound: int, choices: int) -> Reservation:
        """Admit, then reserve: the reservation, with the claim handed over to its hold."""
        budgets = self.services.budgets
        limits = self.limits
        if limits is None or not limits.rated:
            return await self._reserve(self.spec)
        spec = self.spec
        allowance = spec.model_max_output
        tpm = limits.tightest_tpm()
        if tpm is not None and spec.max_tokens is None:
            # No max_tokens from the client: the output allowance is what the tpm_limit leaves.
            fits = (tpm - prompt_bound) // max(choices, 1)
            if 1 <= fits < allowance:
                allowance = fits
        wanted = spec.max_tokens if spec.max_tokens is not None else allowance
        try:
            claim = await budgets.admissions.admit(limits, prompt_bound + wanted * choices)
        except RateLimited as exc:
            raise rate_limited(exc) from None
        spec = self.spec = replace(spec, model_max_output=allowance, rates=claim)
        try:
            return await self._reserve(spec)
        except BaseException as exc:
            # No hold carries the claim: given back, whatever ended the request; unless its
            # hold may have been written, and carries it (it stays counted then).
            if not _may_have_written(exc):
                await rates.release_claim(self.services.db, claim, limits)
            raise

    async def _reserve(self, spec: HoldSpec) -> Reservation:
        budgets = self.services.budgets
        try:
            return await reserve(budgets, spec, self.services.settings.hold_ttl_s, budgets.leases)
        except BaseException as exc:
            if _may_have_written(exc):
                # The request is answered without it (503): released once the database answers.
                self.services.live_holds.doubt(spec.hold_id)
            raise


def _may_have_written(exc: BaseException) -> bool:
    """A failure of the hold's write after which it may still have committed (the connection
    lost mid-commit): not an answer of ours, nor a statement the server refused."""
    return not isinstance(exc, MeteringError | RateLimited) and not refused_by_server(exc)

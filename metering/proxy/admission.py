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
from metering.db import utcnow, write_in_doubt
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
        ttl_s = self.services.settings.hold_ttl_s
        limits = self.limits
        if limits is None or not limits.rated:
            try:
                return await reserve(budgets, self.spec, ttl_s, budgets.leases)
            except BaseException as exc:
                self._doubt(exc, rates_too=False)
                raise
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
            return await reserve(budgets, spec, ttl_s, budgets.leases)
        except BaseException as exc:
            # No hold carries the claim: given back, whatever ended the request.
            given_back = await rates.release_claim(self.services.db, claim, limits)
            self._doubt(exc, rates_too=not given_back)
            raise

    def _doubt(self, exc: BaseException, rates_too: bool) -> None:
        """The hold's write failed in a way after which it may have committed (the connection
        lost mid-commit): the request is answered without it (503), and the hold released once
        the database answers (metering.proxy.live); `rates_too`: with its rate claim."""
        if write_in_doubt(exc):
            self.services.live_holds.doubt(self.spec.hold_id, rates_too)

"""Limits beyond credit at the door of a request: the model allow-lists (403) and the rate and
parallel limits (429, with OpenAI's x-ratelimit-* headers and retry-after, so the official SDKs'
own retries work). The counting itself is metering.budgets.rates'."""

from dataclasses import replace

from metering import metrics
from metering.auth.principal import Principal
from metering.budgets import rates
from metering.budgets.rates import RateLimited
from metering.budgets.refusals import Refused
from metering.budgets.reserve import HoldSpec
from metering.db import utcnow
from metering.errors import MeteringError
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


async def admit(
    services: ProxyServices, principal: Principal, spec: HoldSpec, prompt_bound: int, choices: int
) -> HoldSpec:
    """Count the request against its rate and parallel limits (one statement), or raise the
    429. The returned spec carries the claim onto the hold."""
    limits = principal.limits
    if limits is None or not limits.rated:
        return spec
    tpm = limits.tightest_tpm()
    if tpm is not None and spec.max_tokens is None:
        # No max_tokens from the client: the output allowance is what the tpm_limit leaves.
        fits = (tpm - prompt_bound) // max(choices, 1)
        if 1 <= fits < spec.model_max_output:
            spec = replace(spec, model_max_output=fits)
    wanted = spec.max_tokens if spec.max_tokens is not None else spec.model_max_output
    try:
        claim = await services.budgets.admissions.admit(limits, prompt_bound + wanted * choices)
    except RateLimited as exc:
        raise rate_limited(exc) from None
    return replace(spec, rates=claim)

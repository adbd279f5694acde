"""A request's own ceilings, from its headers: x-metering-max-cost (the most it may cost) and
the run it belongs to (x-metering-run, with x-metering-run-budget on a run's first request).
Read the same way for a proxied request and for usage a user's credential reports."""

from collections.abc import Mapping

from metering.budgets.runs import RunKey
from metering.errors import InvalidRequest
from metering.money import MoneyError, parse_usd, usd_to_pico

MAX_COST = "x-metering-max-cost"
RUN, RUN_BUDGET = "x-metering-run", "x-metering-run-budget"
# Not ceilings, but read from the same request's headers: who it was made for and its tags
# (metering.ledger.attribution).
END_USER, TAGS = "x-metering-end-user", "x-metering-tags"
_RUN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")
RUN_PATTERN = r"^[A-Za-z0-9._:-]{1,100}$"  # run_of's rule, declared


def usd_header(headers: Mapping[str, str], name: str) -> int | None:
    """A positive USD amount from a header, in picodollars; None when absent."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        amount = usd_to_pico(parse_usd(value.strip(), field=name))
    except MoneyError as exc:
        raise InvalidRequest(str(exc), param=name) from None
    if amount <= 0:
        raise InvalidRequest(f"{name} must be more than 0", param=name)
    return amount


def run_of(headers: Mapping[str, str], team_id: str, idle_s: int) -> RunKey | None:
    """The run the headers name, or None."""
    run_id = headers.get(RUN)
    budget = usd_header(headers, RUN_BUDGET)
    if run_id is None:
        if budget is not None:
            raise InvalidRequest(f"{RUN_BUDGET} needs {RUN}", param=RUN_BUDGET)
        return None
    if not 1 <= len(run_id) <= 100 or not _RUN_CHARS.issuperset(run_id):
        raise InvalidRequest(
            f"{RUN} must be 1 to 100 characters among letters, digits and . _ : -", param=RUN
        )
    return RunKey(team_id, run_id, budget, idle_s)


def unknown_run(run: RunKey) -> InvalidRequest:
    return InvalidRequest(
        f"run {run.run_id!r} is not running (never started, or idle past its time): send "
        f"{RUN_BUDGET} with its first request",
        param=RUN_BUDGET,
    )

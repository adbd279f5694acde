"""Schemathesis hooks of the fuzz run (SCHEMATHESIS_HOOKS=tests.fuzz.hooks): one check more.

An operation whose input has rules no schema can declare lists them on its 400 response
(`x-data-rules`, metering.errors.DATA_RULES), each by the `param` its error names, and the run's
configuration (tests.fuzz.runner.config) lets positive_data_acceptance take that operation's
400. This check narrows it back: a request the schema takes may be refused with 400 only by one
of the listed rules, in the OpenAI error shape, naming that rule's param."""

from typing import Any

import schemathesis

DATA_RULES = "x-data-rules"


def declared(operation: Any) -> list[dict[str, Any]]:
    """The data rules an operation's 400 declares ([] for none)."""
    responses = operation.definition.raw.get("responses", {})
    return list(responses.get("400", {}).get(DATA_RULES, []))


@schemathesis.check
def refused_only_by_data_rules(ctx, response, case) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    rules = declared(case.operation)
    if not rules:
        return None  # positive_data_acceptance fails it: the operation declares no such rule
    try:
        error = response.json()["error"]
        param = error["param"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError("a 400 without the OpenAI error shape") from None
    params = [rule.get("param") for rule in rules]  # null params are left out of the document
    if param not in params:
        raise AssertionError(
            f"schema-valid request refused by a rule the document does not declare: "
            f"param {param!r} (declared: {params}); {error.get('message')}"
        )
    return None

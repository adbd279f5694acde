"""Every date a client sends is between 2000-01-01T00:00:00Z and 2999-12-31T23:59:59Z: outside,
a 400 naming the parameter, never a 500 (a year 9999 once overflowed rounding to the hour)."""

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.timefmt import BOUNDS, OutOfBounds, parse_rfc3339, rfc3339

BEFORE, AFTER = "1999-12-31T23:00:00Z", "3000-01-01T00:00:00Z"
LAST = "2999-12-31T23:59:59Z"
REPORTS = ["/v1/usage", "/v1/spend", "/v1/refusals", "/v1/refusals/summary", "/v1/exports/focus"]


def refused(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_request",
        param,
    )
    assert error["message"] == f"{param}: must be {BOUNDS}", error["message"]


@pytest.fixture(scope="module")
def owner(api):
    return api.principal()


def test_the_year_9999_spend_by_hour_is_too_large_not_an_overflow(api, owner):
    """An end past the bounds reads as the first moment after them: an hourly report to it is
    refused for its size (never an overflow of the window arithmetic)."""
    params = {"start": "2026-01-01T00:00:00Z", "end": "9999-12-31T23:30:00Z", "group_by": "hour"}
    response = api.request("GET", "/v1/spend", key=owner[2]["token"], params=params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "report_too_large"


@pytest.mark.parametrize("path", REPORTS)
@pytest.mark.parametrize("param", ["start", "end"])
@pytest.mark.parametrize("value", [BEFORE, AFTER, "9999-12-31T23:00:00-01:00"])
def test_a_report_date_beyond_the_bounds_reads_as_the_bound(api, path, param, value):
    """/openapi.json declares `format: date-time`: any valid date-time is taken, one before 2000
    read as 2000-01-01T00:00:00Z, one after 2999 as 3000-01-01T00:00:00Z (nothing is stored
    outside them), so the same report answers with or without the edge's excess."""
    edge = {"start": "2000-01-01T00:00:00Z", "end": "3000-01-01T00:00:00Z"}
    clamped = edge["start"] if value == BEFORE else edge["end"]
    beyond = api.request("GET", path, params={param: value})
    within = api.request("GET", path, params={param: clamped})
    assert beyond.status_code == within.status_code, (beyond.text, within.text)
    assert beyond.status_code in (200, 400), beyond.text
    if beyond.status_code == 400:  # a range that is refused for its size, not for its edge
        assert beyond.json()["error"]["param"] != param or "must be" not in beyond.text
    elif path != "/v1/exports/focus":
        drop = ("start", "end")
        strip = lambda body: {k: v for k, v in body.items() if k not in drop}  # noqa: E731
        assert strip(beyond.json()) == strip(within.json())


@pytest.mark.parametrize("path", ["/v1/usage", "/v1/refusals", "/v1/spend"])
def test_the_last_second_of_2999_is_an_end(api, owner, path):
    params = {"start": "2026-01-01T00:00:00Z", "end": LAST}
    response = api.request("GET", path, key=owner[2]["token"], params=params)
    assert response.status_code == 200, response.text


def test_the_last_hour_of_2999_is_a_focus_end(api):
    params = {"start": "2999-12-31T00:00:00Z", "end": "2999-12-31T23:00:00Z"}
    assert api.request("GET", "/v1/exports/focus", params=params).status_code == 200


@pytest.mark.parametrize("value", [BEFORE, AFTER])
def test_a_token_expiry_out_of_bounds_is_400_naming_it(api, owner, value):
    created = api.request(
        "POST", f"/v1/users/{owner[1]['id']}/tokens", json={"name": "t", "expires_at": value}
    )
    refused(created, "expires_at")
    patched = api.request("PATCH", f"/v1/tokens/{owner[2]['id']}", json={"expires_at": value})
    refused(patched, "expires_at")


def test_a_token_may_expire_in_the_last_second_of_2999(api, owner):
    created = api.ok(
        "POST", f"/v1/users/{owner[1]['id']}/tokens", 201, json={"name": "t", "expires_at": LAST}
    )
    assert created["expires_at"] == "2999-12-31T23:59:59.000000Z"


@pytest.mark.parametrize("value", [BEFORE, AFTER])
def test_an_adjustment_moment_out_of_bounds_is_400_naming_it(api, owner, value):
    body = {"amount": "1", "reason": "credit", "team_id": owner[0]["id"], "at": value}
    refused(api.request("POST", "/v1/adjustments", json=body), "at")


@pytest.mark.parametrize("param", ["start", "end"])
@pytest.mark.parametrize("value", [BEFORE, AFTER])
def test_a_rerate_range_out_of_bounds_is_400_naming_it(api, param, value):
    body = {"provider": "sim-openai", "model": "gpt-sim", "reason": "price"}
    body = {"start": "2026-01-01T00:00:00Z", **body, param: value}
    refused(api.request("POST", "/v1/rerate", json=body), param)


# --- the one parser ---------------------------------------------------------------------------

INSIDE = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2999, 12, 31, 23, 59, 59, 999999)
)
OUTSIDE = st.datetimes(max_value=datetime(1999, 12, 31, 23, 59, 59, 999999)) | st.datetimes(
    min_value=datetime(3000, 1, 1)
)


@given(INSIDE)
def test_a_moment_inside_the_bounds_reads_back_exactly(moment):
    at = moment.replace(tzinfo=UTC)
    assert parse_rfc3339(rfc3339(at)) == at


@given(OUTSIDE)
def test_a_moment_outside_the_bounds_is_refused(moment):
    with pytest.raises(OutOfBounds):
        parse_rfc3339(moment.isoformat() + "Z")


@given(INSIDE, st.integers(-23 * 60 - 59, 23 * 60 + 59))
def test_the_bounds_are_judged_in_utc(moment, offset_minutes):
    local = moment.replace(tzinfo=timezone(timedelta(minutes=offset_minutes)))
    utc = local.astimezone(UTC).replace(tzinfo=None)
    inside = datetime(2000, 1, 1) <= utc < datetime(3000, 1, 1)
    if inside:
        assert parse_rfc3339(local.isoformat()) == local.astimezone(UTC)
    else:
        with pytest.raises(OutOfBounds):
            parse_rfc3339(local.isoformat())

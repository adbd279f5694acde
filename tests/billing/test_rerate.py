"""Corrections that never rewrite history: a planted wrong price, corrected by a back-dated
catalog entry and a rerate, after which every report, budget and reconciliation agrees to the
picodollar with a recomputation from scratch; a second rerate changes nothing."""

import json
import os
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import select

from metering.models import BudgetWindow, Price
from metering.money import PICO, cost_pico, format_usd
from tests.billing.test_ingest import post, rfc, usage_event
from tests.budgets.conftest import pico, query, wait_for

RIGHT = (150_000, 75_000, 600_000)  # gpt-sim as the test catalog prices it
WRONG = {  # planted: ten times too dear
    "input_usd_per_mtok": "1.50",
    "cached_input_usd_per_mtok": "0.75",
    "output_usd_per_mtok": "6.00",
}
WRONG_MICRO = (1_500_000, 750_000, 6_000_000)


def usd(value: str) -> int:
    return pico(value)


def all_events(api, **filters) -> list[dict]:
    return api.events(**filters)


def day_of(event: dict) -> str:
    return event["created_at"][:10]


def recomputed(event: dict) -> int:
    """An event's charge from scratch: its usage at the right price (gpt-sim), or as charged."""
    assert event["uncharged"] == "0"
    if event["model"] != "gpt-sim":
        return usd(event["cost"])
    return cost_pico(
        event["prompt_tokens"],
        event["prompt_tokens_details"]["cached_tokens"],
        event["completion_tokens"],
        *RIGHT,
    )


def test_a_wrong_price_corrected_agrees_everywhere(own_server):
    own = own_server(gpt=WRONG)
    api = own.api
    now = datetime.now(UTC)
    team = api.team()
    user = api.user(team["id"])
    token = api.token(user["id"], "100", "daily")
    # Usage from outside on four days, through the proxy today, another model, and a credit.
    outside = [
        usage_event(token_id=token["id"], occurred_at=rfc(now - timedelta(days=d, hours=h)))
        for d in range(4)
        for h in (0, 5)
    ]
    outside.append(usage_event(token_id=token["id"], model="minimax-m2.1", cached_tokens=0))
    assert {a["status"] for a in post(api, outside)} == {"created"}
    client = api.openai(token["token"])
    for n in range(2):
        client.chat.completions.create(
            model="gpt-sim", messages=[{"role": "user", "content": f"hello {n}"}], max_tokens=20
        )
    credit = api.ok(
        "POST",
        "/v1/adjustments",
        201,
        json={"team_id": team["id"], "amount": "-0.001", "reason": "outage credit"},
    )
    assert credit["cost"] == "-0.001" and credit["kind"] == "adjustment"

    originals = all_events(api, team_id=team["id"])
    usage = [e for e in originals if e["kind"] == "usage"]
    gpt = [e for e in usage if e["model"] == "gpt-sim"]
    assert len(gpt) == 10
    for e in gpt:  # charged at the wrong price
        assert usd(e["cost"]) == cost_pico(
            e["prompt_tokens"],
            e["prompt_tokens_details"]["cached_tokens"],
            e["completion_tokens"],
            *WRONG_MICRO,
        )

    # The correction: the right price, effective from before every event.
    effective = (now - timedelta(days=20)).replace(microsecond=0)
    own.write_catalog(effective_from=rfc(effective))

    def recorded():
        rows = query(
            api.settings.database_url,
            select(Price.input_price).where(
                Price.model == "gpt-sim", Price.effective_from == effective
            ),
        )
        return rows

    assert [r.input_price for r in wait_for(recorded, message="the back-dated price")] == [RIGHT[0]]
    start, end = rfc(now - timedelta(days=30)), rfc(now + timedelta(hours=1))
    rerate = {
        "provider": "sim-openai",
        "model": "gpt-sim",
        "start": start,
        "end": end,
        "reason": "gpt-sim was priced 10x",
    }
    result = api.ok("POST", "/v1/rerate", json=rerate)
    wanted_difference = sum(recomputed(e) - usd(e["cost"]) for e in gpt)
    assert result == {
        "adjusted": 10,
        "difference": format_usd(wanted_difference),
        "over_limit": [],
    }

    # The ledger: originals unchanged, one adjustment per corrected event.
    after = all_events(api, team_id=team["id"])
    by_id = {e["id"]: e for e in after}
    for e in originals:
        assert by_id[e["id"]] == e
    adjustments = [e for e in after if e["kind"] == "adjustment" and e["corrects_event_id"]]
    assert sorted(a["corrects_event_id"] for a in adjustments) == sorted(e["id"] for e in gpt)
    for a in adjustments:
        corrected = by_id[a["corrects_event_id"]]
        assert a["reason"] == "gpt-sim was priced 10x"
        assert a["created_at"] == corrected["created_at"]
        assert usd(a["cost"]) == recomputed(corrected) - usd(corrected["cost"])
        assert a["usage_source"] == "rerated" and a["prompt_tokens"] == 0

    # From scratch: every usage event at the right price, and the credit.
    credit_pico = usd(credit["cost"])
    by_day: dict[str, int] = defaultdict(int)
    for e in usage:
        by_day[day_of(e)] += recomputed(e)
    total = sum(by_day.values()) + credit_pico

    spend = api.ok("GET", "/v1/spend", params={"team_id": team["id"], "start": start, "end": end})
    assert usd(spend["total"]["cost"]) == total
    assert spend["total"]["requests"] == len(usage)
    assert usd(spend["total"]["adjustments"]) == wanted_difference + credit_pico
    without = api.ok(
        "GET",
        "/v1/spend",
        params={"team_id": team["id"], "start": start, "end": end, "adjustments": "exclude"},
    )
    assert usd(without["total"]["cost"]) == sum(usd(e["cost"]) for e in usage)
    daily = api.ok(
        "GET",
        "/v1/spend",
        params={"token_id": token["id"], "start": start, "end": end, "group_by": "day"},
    )
    assert {r["day"]: usd(r["cost"]) for r in daily["rows"]} == dict(by_day)
    hourly = api.ok(
        "GET",
        "/v1/spend",
        params={"team_id": team["id"], "start": start, "end": end, "group_by": "hour,model"},
    )
    assert sum(usd(r["cost"]) for r in hourly["rows"]) == total

    # Budgets: the team's and user's (never reset) and the token's (daily: today's window,
    # and each earlier day's closed total).
    team_budget = api.ok("GET", f"/v1/teams/{team['id']}/budget")
    assert usd(team_budget["spent"]) == total
    user_budget = api.ok("GET", f"/v1/users/{user['id']}/budget")
    assert usd(user_budget["spent"]) == total - credit_pico
    today = now.strftime("%Y-%m-%d")
    token_budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert usd(token_budget["spent"]) == by_day.pop(today)
    windows = BudgetWindow.__table__
    closed = query(
        api.settings.database_url,
        select(windows.c.window_start, windows.c.spent).where(windows.c.subject_id == token["id"]),
    )
    assert {r.window_start.strftime("%Y-%m-%d"): r.spent for r in closed} == dict(by_day)

    # Reconciliation with the provider's export of the right prices: every day matches.
    export: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for e in usage:
        if e["provider"] != "sim-openai":
            continue
        sums = export[(day_of(e), e["upstream_model"])]
        sums[0] += e["prompt_tokens"]
        sums[1] += e["completion_tokens"]
        sums[2] += recomputed(e)
    lines = ["date,provider,model,prompt_tokens,completion_tokens,cost"]
    for (day, model), (p, c, cost) in sorted(export.items()):
        lines.append(f"{day},sim-openai,{model},{p},{c},{Decimal(cost) / PICO}")
    body = api.ok(
        "POST",
        "/v1/reconciliations",
        201,
        params={"provider": "sim-openai", "tolerance": "0"},
        content=("\n".join(lines) + "\n").encode(),
        headers={"content-type": "text/csv"},
    )
    assert body["summary"]["matched"] == len(export)
    assert body["summary"]["differs"] == 0

    # Twice: nothing more, through the API and the command line.
    nothing = {"adjusted": 0, "difference": "0", "over_limit": []}
    assert api.ok("POST", "/v1/rerate", json=rerate) == nothing
    cli = subprocess.run(
        [sys.executable, "-m", "metering.cli", "rerate", "--provider", "sim-openai"]
        + ["--model", "gpt-sim", "--start", start, "--end", end, "--reason", "again"],
        env={**os.environ, "METERING_DATABASE_URL": api.settings.database_url},
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == nothing
    assert len(all_events(api, team_id=team["id"])) == len(after)


def test_rerate_and_adjustments_check_their_input(api):
    bad = [
        {"provider": "sim-openai", "model": "gpt-sim", "start": "yesterday", "reason": "x"},
        {"provider": "sim-openai", "model": "gpt-sim", "start": "2026-01-01T00:00:00Z"},
        {
            "provider": "sim-openai",
            "model": "gpt-sim",
            "start": "2026-01-02T00:00:00Z",
            "end": "2026-01-01T00:00:00Z",
            "reason": "x",
        },
    ]
    for body in bad:
        response = api.request("POST", "/v1/rerate", json=body)
        assert response.status_code == 400, response.text
    response = api.request(
        "POST",
        "/v1/rerate",
        json={
            "provider": "nowhere",
            "model": "gpt-sim",
            "start": "2026-01-01T00:00:00Z",
            "reason": "x",
        },
    )
    assert response.status_code == 404
    team, _, token = api.principal()
    for body in (
        {"team_id": team["id"], "amount": "0", "reason": "x"},
        {"team_id": team["id"], "amount": "-1.5.0", "reason": "x"},
        {"team_id": team["id"], "amount": "1", "reason": ""},
        {"amount": "1", "reason": "x"},
    ):
        response = api.request("POST", "/v1/adjustments", json=body)
        assert response.status_code == 400, (body, response.text)
    response = api.request(
        "POST", "/v1/adjustments", json={"team_id": "team_none", "amount": "1", "reason": "x"}
    )
    assert response.status_code == 404
    # Admin only.
    response = api.request(
        "POST",
        "/v1/adjustments",
        key=token["token"],
        json={"team_id": team["id"], "amount": "-1", "reason": "x"},
    )
    assert response.status_code == 403

"""GET /dashboard in headless Chromium against a server with known traffic: every chart draws
what /v1/spend, /v1/usage and the budget endpoints say, exactly; a user's token sees its own
data only; the key stays in sessionStorage; no console errors."""

import random
import re
import uuid
from collections import Counter
from datetime import datetime
from decimal import Decimal

import pytest

from tests.dashboard.conftest import OUTPUT
from tests.demo_site import ADMIN_KEY

READY = "body[data-state=ready]"


class Dashboard:
    """One browser tab on the dashboard, with what it logged and asked for."""

    def __init__(self, browser, site, *, clock: bool = False) -> None:
        self.site = site
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        if clock:
            self.page.clock.install(time=datetime.now())
        self.page.goto(f"{site.url}/dashboard")
        self.page.wait_for_selector("#login:not([hidden])")

    def sign_in(self, key: str, wait: bool = True) -> "Dashboard":
        self.page.fill("#key", key)
        self.page.click("#login button[type=submit]")
        if wait:
            self.page.wait_for_selector(READY)
        return self

    def chart(self, name: str) -> dict:
        svg = self.page.locator(f"svg[data-chart='{name}']")
        return {
            "series": int(svg.get_attribute("data-series")),
            "points": int(svg.get_attribute("data-points")),
            "total": svg.get_attribute("data-total"),
        }

    def series_totals(self, name: str) -> dict[str, Decimal]:
        groups = self.page.locator(f"svg[data-chart='{name}'] g[data-series-key]")
        return {
            g.get_attribute("data-series-key"): Decimal(g.get_attribute("data-total"))
            for g in groups.all()
        }

    def attrs(self, selector: str, *names: str) -> list[tuple]:
        return [
            tuple(el.get_attribute(n) for n in names) for el in self.page.locator(selector).all()
        ]

    def choose(self, select: str, value: str) -> None:
        self.page.evaluate("document.body.dataset.state = 'changing'")
        self.page.select_option(select, value)
        self.page.wait_for_selector(READY)

    def start(self) -> str:
        return self.page.locator("body").get_attribute("data-start")

    def screenshot(self, name: str) -> None:
        OUTPUT.mkdir(exist_ok=True)
        self.page.screenshot(path=str(OUTPUT / f"dashboard-{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def dashboard(browser, site):
    tabs = []

    def open_tab(**kwargs) -> Dashboard:
        tabs.append(Dashboard(browser, site, **kwargs))
        return tabs[-1]

    yield open_tab
    for tab in tabs:
        tab.close()


def spend(site, key=ADMIN_KEY, **params) -> dict:
    return site.get("/v1/spend", key, **params)


def by_key(rows: list[dict], field: str) -> dict:
    return {row[field]: Decimal(row["cost"]) for row in rows}


def test_the_page_and_its_files_are_served_to_anyone(site):
    page = site.http.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assets = re.findall(r'(?:src|href)="/dashboard/([^"]+)"', page.text)
    assert sorted(assets) == [
        "admin-ops.js",
        "admin.css",
        "admin.js",
        "app.js",
        "charts.js",
        "money.js",
        "self.css",
        "self.js",
        "style.css",
    ]
    for name in assets:
        response = site.http.get(f"/dashboard/{name}")
        assert response.status_code == 200, name
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        assert response.headers["content-type"] == f"{kind}; charset=utf-8"
    for missing in ("index.html", "nothing.js", "..%2Fendpoints.py", "%2E%2E%2Fapp.py"):
        assert site.http.get(f"/dashboard/{missing}").status_code == 404, missing


def test_the_admin_sees_every_panel_drawn_from_the_api(dashboard, site):
    tab = dashboard().sign_in(ADMIN_KEY)
    start = tab.start()
    by_team = spend(site, start=start, group_by="team")
    total = Decimal(by_team["total"]["cost"])
    assert total > 0

    chart = tab.chart("spend")
    assert chart == {"series": len(by_team["rows"]), "points": 24, "total": chart["total"]}
    assert Decimal(chart["total"]) == total
    assert tab.series_totals("spend") == by_key(by_team["rows"], "team_id")
    assert Decimal(tab.page.locator("#total-cost").get_attribute("data-value")) == total
    hours = {b for (b,) in tab.attrs("svg[data-chart='spend'] rect[data-bucket]", "data-bucket")}
    hourly = spend(site, start=start, group_by="hour")["rows"]
    assert hours == {row["hour"] for row in hourly}

    for group in ("model", "provider"):
        tab.choose("#group", group)
        rows = spend(site, start=start, group_by=group)["rows"]
        assert tab.chart("spend")["series"] == len(rows) >= 3
        assert tab.series_totals("spend") == by_key(rows, group)
        assert Decimal(tab.chart("spend")["total"]) == total
    # By the API asked (chat completions or the Responses API): summed from the ledger itself.
    tab.choose("#group", "endpoint")
    rows = spend(site, start=start, group_by="endpoint")["rows"]
    assert tab.chart("spend")["series"] == len(rows) >= 1
    assert tab.series_totals("spend") == by_key(rows, "endpoint")
    assert Decimal(tab.chart("spend")["total"]) == total

    tab.choose("#range", "7d")
    week = tab.chart("spend")
    assert week["points"] == 7
    assert Decimal(week["total"]) == Decimal(spend(site, start=tab.start())["total"]["cost"])

    by_model = spend(site, start=tab.start(), group_by="model")
    kinds = tab.chart("token-kinds")
    assert kinds["series"] == 4
    assert kinds["points"] == len(by_model["rows"])
    assert int(kinds["total"]) == (
        by_model["total"]["prompt_tokens"] + by_model["total"]["completion_tokens"]
    )
    reasoning = tab.series_totals("token-kinds")["reasoning"]
    assert reasoning == by_model["total"]["reasoning_tokens"] > 0
    assert tab.series_totals("token-kinds")["cached"] == by_model["total"]["cached_tokens"] > 0

    tokens = sorted(
        spend(site, start=tab.start(), group_by="token")["rows"],
        key=lambda r: Decimal(r["cost"]),
        reverse=True,
    )[:10]
    shown = tab.attrs("svg[data-chart='top-tokens'] g[data-key]", "data-key", "data-value")
    assert [(k, Decimal(v)) for k, v in shown] == [
        (r["token_id"], Decimal(r["cost"])) for r in tokens
    ]
    assert tab.chart("top-tokens")["points"] == len(tokens)

    expected = limited_budgets(site)
    drawn = tab.attrs(
        "svg[data-chart='budgets'] g[data-scope]",
        "data-scope",
        "data-id",
        "data-spent",
        "data-limit",
        "data-resets-at",
    )
    assert {(s, i) for s, i, *_ in drawn} == set(expected)
    for scope, subject, spent, limit, resets_at in drawn:
        budget = expected[(scope, subject)]
        assert Decimal(spent) == Decimal(budget["spent"])
        assert Decimal(limit) == Decimal(budget["credit_limit"])
        assert resets_at == (budget["resets_at"] or "")
    assert tab.chart("budgets")["series"] == 3

    recent = site.get("/v1/usage", limit=25)["data"]
    assert tab.attrs("#recent-body tr", "data-id") == [(e["id"],) for e in recent]
    assert tab.page.locator("#recent tr.error").count() == sum(e["status"] != "ok" for e in recent)

    tab.screenshot(f"admin-{site.backend}")
    assert tab.errors == []


def limited_budgets(site) -> dict:
    """Every live team, user and token with a credit limit: its budget, by (scope, id)."""
    subjects = [("team", t) for t in site.get("/v1/teams")["data"]]
    users = site.get("/v1/users")["data"]
    subjects += [("user", u) for u in users]
    for user in users:
        subjects += [("token", t) for t in site.get(f"/v1/users/{user['id']}/tokens")["data"]]
    return {
        (scope, o["id"]): site.get(f"/v1/{scope}s/{o['id']}/budget")
        for scope, o in subjects
        if o["credit_limit"] is not None
    }


def user_token(site, email: str) -> tuple[dict, str]:
    """A fresh API token of a demo user (made with the admin key), and that user."""
    user = next(u for u in site.get("/v1/users")["data"] if u["email"] == email)
    made = site.http.post(
        f"/v1/users/{user['id']}/tokens",
        json={"name": "dashboard", "credit_limit": None, "reset_interval": "never"},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert made.status_code == 201, made.text
    return user, made.json()["token"]


def test_a_users_token_sees_only_its_own_data(dashboard, site):
    user, token = user_token(site, "alice@demo.example")
    tab = dashboard().sign_in(token)
    assert tab.page.locator("body").get_attribute("data-mode") == "user"
    start = tab.start()
    own = spend(site, token, start=start, group_by="team")
    assert own["rows"] == [own["rows"][0]] and own["rows"][0]["team_id"] == user["team_id"]
    everyone = spend(site, start=start)["total"]["cost"]
    assert Decimal(tab.chart("spend")["total"]) == Decimal(own["total"]["cost"]) < Decimal(everyone)
    assert tab.series_totals("spend") == by_key(own["rows"], "team_id")

    mine = {
        t["id"] for t in site.get(f"/v1/users/{user['id']}/tokens", include_revoked="true")["data"]
    }
    shown = {k for (k,) in tab.attrs("svg[data-chart='top-tokens'] g[data-key]", "data-key")}
    assert shown and shown <= mine
    budgets = tab.attrs("svg[data-chart='budgets'] g[data-scope]", "data-scope", "data-id")
    active = {t["id"] for t in site.get(f"/v1/users/{user['id']}/tokens")["data"]}
    assert Counter(s for s, _ in budgets) == Counter({"team": 1, "user": 1, "token": len(active)})
    assert set(budgets) == {("team", user["team_id"]), ("user", user["id"])} | {
        ("token", t) for t in active
    }
    events = tab.attrs("#recent-body tr", "data-id")
    assert events == [(e["id"],) for e in site.get("/v1/usage", token, limit=25)["data"]]
    assert len(events) > 0
    # Never the admin-only lists: a 403 would be an error in the console.
    assert not [u for u in tab.requests if re.search(r"/v1/(teams|users)(\?|$)", u)]
    tab.screenshot(f"user-{site.backend}")
    assert tab.errors == []


def test_the_key_stays_in_session_storage_and_off_every_url(dashboard, site):
    tab = dashboard().sign_in(ADMIN_KEY)
    assert tab.page.evaluate("sessionStorage.getItem('metering.key')") == ADMIN_KEY
    assert tab.page.input_value("#key") == ""
    tab.page.reload()
    tab.page.wait_for_selector(READY)  # the same tab keeps it across a reload
    assert all(ADMIN_KEY not in url for url in tab.requests)
    assert ADMIN_KEY not in tab.page.url
    tab.page.click("#sign-out")
    tab.page.wait_for_selector("#login:not([hidden])")
    assert tab.page.evaluate("sessionStorage.getItem('metering.key')") is None
    assert tab.errors == []


def test_a_refused_key_returns_to_the_sign_in_form(dashboard, site):
    tab = dashboard().sign_in("mtr_not-a-real-token", wait=False)
    tab.page.wait_for_selector("body[data-state=signed-out] #login:not([hidden])")
    assert "refused" in tab.page.text_content("#login-message")
    assert tab.page.evaluate("sessionStorage.getItem('metering.key')") is None
    # The browser reports the 401 itself; nothing else went wrong.
    assert all("401" in error for error in tab.errors)


def test_the_page_refreshes_itself(dashboard, site):
    tab = dashboard(clock=True).sign_in(ADMIN_KEY)
    before = int(tab.page.text_content("#total-requests").replace(",", ""))
    _, token = user_token(site, "bob@demo.example")
    answer = site.http.post(
        "/v1/chat/completions",
        json={"model": "gpt-sim", "messages": [{"role": "user", "content": "hi sim:tokens=5"}]},
        headers={"authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 200
    tab.page.evaluate("document.body.dataset.state = 'waiting'")
    tab.page.clock.run_for(31_000)  # the default: every 30 s
    tab.page.wait_for_selector(READY)
    assert int(tab.page.text_content("#total-requests").replace(",", "")) == before + 1
    assert tab.attrs("#recent-body tr", "data-id")[0] == (answer.headers["x-request-id"],)
    assert tab.errors == []


def test_money_in_the_page_is_exact(dashboard):
    page = dashboard().page
    rng = random.Random(7)
    amounts = [f"{rng.randrange(10**6)}.{rng.randrange(10**12):012d}" for _ in range(2000)]
    amounts += ["0.1", "0.2", "0.000360", "7", "0.000000000001"] * 100
    total = page.evaluate("a => Money.plain(Money.sum(a))", amounts)
    assert Decimal(total) == sum(Decimal(a) for a in amounts)
    assert page.evaluate("Money.plain(Money.sum(['0.1', '0.2']))") == "0.3"
    formatted = page.evaluate(
        "xs => xs.map(x => Money.format(Money.parse(x)))",
        ["1234567.5", "0.00036", "0", "12.000000000001"],
    )
    assert formatted == ["$1,234,567.50", "$0.00036", "$0.00", "$12.000000000001"]
    assert page.evaluate("Money.plain(Money.niceStep(Money.parse('0.0173'), 4))") == "0.005"
    for bad in ("1e-5", "0.0000000000001", "abc"):
        assert page.evaluate(
            "x => { try { Money.parse(x); return false } catch { return true } }", bad
        )


def test_a_user_without_requests_sees_empty_panels(dashboard, site):
    team = site.http.post(
        "/v1/teams",
        json={
            "name": f"quiet-{uuid.uuid4().hex[:6]}",
            "credit_limit": "1.00",
            "reset_interval": "daily",
        },
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    user = site.http.post(
        "/v1/users",
        json={
            "email": f"quiet-{uuid.uuid4().hex[:6]}@example.com",
            "name": "Quiet",
            "team_id": team["id"],
            "credit_limit": None,
            "reset_interval": "never",
        },
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    _, token = user_token(site, user["email"])
    tab = dashboard().sign_in(token)
    for chart in ("spend", "top-tokens", "token-kinds"):
        assert tab.chart(chart)["points" if chart != "spend" else "series"] == 0, chart
    assert tab.page.locator("#recent").get_attribute("data-rows") == "0"
    # GET /v1/me names the user before any request: its token, user and team budgets show.
    assert tab.chart("budgets")["points"] == 3
    assert tab.errors == []


def test_the_limits_panel_shows_each_limit_its_use_and_the_refusals(dashboard, site):
    tab = dashboard().sign_in(ADMIN_KEY)
    rows = tab.attrs("#limits-body tr", "data-scope", "data-id")
    users = site.get("/v1/users")["data"]
    tokens = [t for u in users for t in site.get(f"/v1/users/{u['id']}/tokens")["data"]]
    limited = [
        ("token", t["id"])
        for t in tokens
        if t["rpm_limit"] is not None or t["allowed_models"] is not None
    ]
    assert limited and rows == limited  # the demo's `scripts` token, nothing else
    cells = tab.page.locator("#limits-body tr td").all_inner_texts()
    # requests in this minute / rpm_limit; no token or parallel limit; the allow-list
    assert re.fullmatch(r"[0-2] / 2", cells[2]) and cells[3:] == ["—", "—", "gpt-*"]
    refused = int(tab.page.locator("#refusals").get_attribute("data-total"))
    metrics = site.http.get("/metrics").text
    counted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("metering_limit_rejections_total{")
    )
    assert refused == counted >= 2  # the demo's 403 and 429, at least


def test_recent_alerts_and_budgets_past_a_threshold_are_shown(dashboard, site):
    """The demo's "notebook" token is brought past its limit: its thresholds are crossed."""
    tab = dashboard().sign_in(ADMIN_KEY)
    alerts = site.get("/v1/alerts", limit=20)["data"]
    assert any(a["type"] == "budget.threshold_crossed" for a in alerts)
    assert tab.attrs("#alerts-body tr", "data-id", "data-type") == [
        (a["id"], a["type"]) for a in alerts
    ]
    assert tab.page.locator("#alerts-empty").is_hidden()

    expected = limited_budgets(site)
    passed = {key: b["threshold_passed"] for key, b in expected.items() if b["threshold_passed"]}
    assert passed
    marked = tab.attrs(
        "svg[data-chart='budgets'] g.past-threshold", "data-scope", "data-id", "data-threshold"
    )
    assert {(s, i): int(t) for s, i, t in marked} == passed
    for scope, subject in passed:
        mark = tab.page.locator(f"svg[data-chart='budgets'] g[data-id='{subject}'] .threshold-mark")
        assert mark.text_content() == f"▲ past {passed[(scope, subject)]}%"
    assert tab.errors == []

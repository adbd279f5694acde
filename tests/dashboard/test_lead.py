"""The dashboard as a team lead's tool, in headless Chromium: no sideways scrolling at 1280x800
or 390x844; filters by team, user, token and model that every panel and the URL carry; a
drill-down from a team to its users to their tokens; refusals and clamped requests shown; a CSV
of what is on screen; one time zone, UTC unless the viewer asks for local time, said on the
page; percentages that never show non-zero spend as 0.0%; empty states that say what to do."""

import csv
import io
import struct
from datetime import UTC, datetime
from decimal import Decimal
from urllib.parse import parse_qs, urlsplit
from zoneinfo import ZoneInfo

import httpx
import pytest

from tests.dashboard.conftest import OUTPUT
from tests.demo_site import ADMIN_KEY

READY = "body[data-state=ready]"
VIEWPORTS = {"desktop": (1280, 800), "phone": (390, 844)}


class Tab:
    def __init__(self, browser, site, *, size=(1280, 800), timezone="UTC", path="/dashboard"):
        self.site = site
        self.context = browser.new_context(
            viewport={"width": size[0], "height": size[1]}, timezone_id=timezone
        )
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.goto(f"{site.url}{path}")

    def sign_in(self, key: str = ADMIN_KEY) -> "Tab":
        self.page.wait_for_selector("#login:not([hidden])")
        self.page.fill("#key", key)
        self.page.click("#login button[type=submit]")
        self.page.wait_for_selector(READY)
        return self

    def waiting(self, action) -> None:
        """Run an action that refreshes the page and wait until the refresh is drawn."""
        self.page.evaluate("document.body.dataset.state = 'changing'")
        action()
        self.page.wait_for_selector(READY)

    def select(self, selector: str, value: str) -> None:
        self.waiting(lambda: self.page.select_option(selector, value))

    def ids(self, selector: str, attr: str = "data-id") -> list[str]:
        return [el.get_attribute(attr) for el in self.page.locator(selector).all()]

    def query(self) -> dict:
        return {k: v[0] for k, v in parse_qs(urlsplit(self.page.url).query).items()}

    def no_sideways_scroll(self) -> bool:
        return self.page.evaluate(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser, site):
    tabs = []

    def open_tab(**kwargs) -> Tab:
        tabs.append(Tab(browser, site, **kwargs))
        return tabs[-1]

    yield open_tab
    for each in tabs:
        each.close()


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("name", list(VIEWPORTS))
def test_no_sideways_scrolling_at_desktop_and_phone_widths(tab, site, name):
    width, height = VIEWPORTS[name]
    page = tab(size=(width, height)).sign_in()
    assert page.no_sideways_scroll(), name
    assert int(page.page.locator("#recent").get_attribute("data-rows")) > 0
    # The recent requests' cost and latency are inside the page (the table scrolls in its
    # panel, never the page).
    panel = page.page.locator("#recent").locator("xpath=ancestor::section").bounding_box()
    assert panel["x"] >= 0 and panel["x"] + panel["width"] <= width + 0.5
    OUTPUT.mkdir(exist_ok=True)
    path = OUTPUT / f"dashboard-lead-{name}-{site.backend}.png"
    page.page.screenshot(path=str(path), full_page=True)
    shot_width, shot_height = png_size(path)
    assert shot_width == width  # a full-page screenshot is as wide as the page: nothing beyond
    assert shot_height >= height
    assert page.errors == []


def test_filters_reach_every_panel_and_the_url(tab, site):
    page = tab().sign_in()
    teams = {t["name"]: t for t in site.get("/v1/teams")["data"]}
    team = teams["demo-platform"]
    page.select("#filter-team", team["id"])
    assert page.query()["team"] == team["id"]
    assert "key" not in page.query() and ADMIN_KEY not in page.page.url
    start = page.page.locator("body").get_attribute("data-start")
    spend = site.get("/v1/spend", start=start, team_id=team["id"])
    chart_total = page.page.locator("svg[data-chart='spend']").get_attribute("data-total")
    assert Decimal(chart_total) == Decimal(spend["total"]["cost"]) > 0
    assert Decimal(page.page.locator("#total-cost").get_attribute("data-value")) == Decimal(
        spend["total"]["cost"]
    )
    recent = site.get("/v1/usage", limit=25, team_id=team["id"])["data"]
    assert page.ids("#recent-body tr") == [e["id"] for e in recent]
    users = {u["id"] for u in site.get("/v1/users")["data"] if u["team_id"] == team["id"]}
    drawn = [
        (el.get_attribute("data-scope"), el.get_attribute("data-id"))
        for el in page.page.locator("svg[data-chart='budgets'] g[data-scope]").all()
    ]
    assert drawn
    for scope, subject in drawn:
        if scope == "team":
            assert subject == team["id"]
        if scope == "user":
            assert subject in users
    assert "team" in page.page.text_content("#filters-note")
    # The model filter narrows further; a link with the filters opens the same view.
    page.select("#filter-model", "gpt-sim")
    assert page.query() == {"team": team["id"], "model": "gpt-sim"}
    recent = site.get("/v1/usage", limit=25, team_id=team["id"], model="gpt-sim")["data"]
    assert page.ids("#recent-body tr") == [e["id"] for e in recent]
    again = tab(path=f"/dashboard?team={team['id']}&model=gpt-sim")
    again.sign_in()
    assert again.page.input_value("#filter-team") == team["id"]
    assert again.ids("#recent-body tr") == [e["id"] for e in recent]
    page.waiting(lambda: page.page.click("#filters-clear"))
    assert page.query() == {}
    assert page.errors == [] and again.errors == []


def test_drill_down_from_a_team_to_its_users_to_their_tokens(tab, site):
    page = tab().sign_in()
    start = page.page.locator("body").get_attribute("data-start")
    by_team = site.get("/v1/spend", start=start, group_by="team")["rows"]
    assert set(page.ids("#drill-body tr", "data-key")) == {r["team_id"] for r in by_team}
    team_id = next(t["id"] for t in site.get("/v1/teams")["data"] if t["name"] == "demo-platform")
    page.waiting(lambda: page.page.click(f"#drill-body button[data-key='{team_id}']"))
    assert page.page.locator("#drill").get_attribute("data-level") == "user"
    by_user = site.get("/v1/spend", start=start, group_by="user", team_id=team_id)["rows"]
    assert set(page.ids("#drill-body tr", "data-key")) == {r["user_id"] for r in by_user}
    shares = page.page.locator("#drill-body tr td:nth-child(4)").all_inner_texts()
    assert all(s.endswith("%") and s != "0.0%" for s in shares)
    user_id = max(by_user, key=lambda r: Decimal(r["cost"]))["user_id"]
    page.waiting(lambda: page.page.click(f"#drill-body button[data-key='{user_id}']"))
    assert page.query() == {"team": team_id, "user": user_id}
    by_token = site.get("/v1/spend", start=start, group_by="token", user_id=user_id)["rows"]
    assert set(page.ids("#drill-body tr", "data-key")) == {r["token_id"] for r in by_token}
    costs = {
        el.get_attribute("data-key"): Decimal(el.get_attribute("data-cost"))
        for el in page.page.locator("#drill-body tr").all()
    }
    assert costs == {r["token_id"]: Decimal(r["cost"]) for r in by_token}
    # Back up through the crumbs.
    page.waiting(lambda: page.page.click("#crumbs a >> nth=0"))
    assert page.page.locator("#drill").get_attribute("data-level") == "team"
    assert page.errors == []


def test_refusals_and_clamps_are_shown(tab, site):
    # A clamped request: a token whose credit cannot cover the model's whole output allowance.
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    team = site.http.post(
        "/v1/teams", json={"name": f"clamp-{datetime.now(UTC).timestamp()}"}, headers=admin
    ).json()
    user = site.http.post(
        "/v1/users",
        json={"email": f"clamp{team['id'][-8:]}@example.com", "name": "C", "team_id": team["id"]},
        headers=admin,
    ).json()
    token = site.http.post(
        f"/v1/users/{user['id']}/tokens",
        json={"name": "tight", "credit_limit": "0.001"},
        headers=admin,
    ).json()
    import openai

    client = openai.OpenAI(base_url=f"{site.url}/v1", api_key=token["token"], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-sim", messages=[{"role": "user", "content": "sim:tokens=3"}]
    )
    clamped_id, clamped_to = raw.headers["x-request-id"], raw.headers["x-max-tokens-clamped"]
    page = tab().sign_in()
    row = page.page.locator(f"#recent-body tr[data-id='{clamped_id}']")
    assert row.get_attribute("data-clamped") == clamped_to
    assert f"clamped to {int(clamped_to):,}" in row.inner_text()
    start = page.page.locator("body").get_attribute("data-start")
    refusals = site.get("/v1/refusals", start=start, limit=10)["data"]
    assert refusals  # the demo's 402, 403 and 429
    assert page.ids("#refused-body tr") == [r["id"] for r in refusals]
    total = site.get("/v1/refusals/summary", start=start)["total"]["refusals"]
    assert page.page.locator("#refusal-counts").get_attribute("data-total") == str(total)
    assert {r["reason"] for r in refusals} >= {"budget", "model", "rpm"}
    assert page.errors == []


def test_csv_export_is_what_is_on_screen(tab, site):
    page = tab().sign_in()
    with page.page.expect_download() as info:
        page.page.click("button.csv[data-table='recent']")
    with open(info.value.path(), encoding="utf-8") as f:
        text = f.read()
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == [
        "time",
        "who",
        "end user",
        "tags",
        "model",
        "status",
        "tokens in → out",
        "cost",
        "latency",
    ]
    shown = page.page.locator("#recent-body tr").all()
    assert len(rows) == len(shown) + 1
    first = shown[0].locator("td").all_inner_texts()
    assert rows[1][0] == first[0] and rows[1][7] == first[7]
    with page.page.expect_download() as info:
        page.page.click("button.csv[data-table='drill']")
    with open(info.value.path(), encoding="utf-8") as f:
        drill = list(csv.reader(f))
    assert len(drill) == len(page.ids("#drill-body tr", "data-key")) + 1
    assert page.errors == []


def test_one_time_zone_utc_by_default_local_on_request(tab, site):
    page = tab(timezone="Asia/Kolkata").sign_in()
    assert page.page.text_content("#tz-note") == "times in UTC"
    event = site.get("/v1/usage", limit=1)["data"][0]
    at = datetime.fromisoformat(event["created_at"].replace("Z", "+00:00"))
    first = page.page.locator("#recent-body tr >> nth=0").locator("td >> nth=0").inner_text()
    assert first == at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    page.select("#tz", "local")
    assert page.query()["tz"] == "local"
    assert "UTC+05:30" in page.page.text_content("#tz-note")
    first = page.page.locator("#recent-body tr >> nth=0").locator("td >> nth=0").inner_text()
    assert first == at.astimezone(ZoneInfo("Asia/Kolkata")).strftime("%Y-%m-%d %H:%M:%S")
    assert page.errors == []


def test_percentages_never_round_non_zero_spend_to_zero(tab, site):
    page = tab().sign_in()
    assert page.page.evaluate("Money.percent(1n, 10000n)") == "<0.1%"
    assert page.page.evaluate("Money.percent(0n, 10000n)") == "0%"
    assert page.page.evaluate("Money.percent(9999n, 10000n)") == "99.9%"
    assert page.page.evaluate("Money.percent(10000n, 10000n)") == "100.0%"
    shown = [
        (el.get_attribute("data-spent"), el.get_attribute("data-percent"))
        for el in page.page.locator("svg[data-chart='budgets'] g[data-scope]").all()
    ]
    assert shown
    for spent, percent in shown:
        if percent and Decimal(spent) > 0:
            assert percent != "0%" and percent != "0.0%"
    assert page.errors == []


def test_empty_states_say_what_to_do(tab, site):
    page = tab(path="/dashboard?model=no-such-model").sign_in()
    assert page.page.locator("#recent").get_attribute("data-rows") == "0"
    empty = page.page.text_content("#recent-empty")
    assert "send one" in empty and "clear the filters" in empty
    assert "clear them" in page.page.text_content("#drill-empty")
    assert "clear them" in page.page.locator("svg[data-chart='spend'] .empty").text_content()
    assert page.errors == []


def test_the_page_asks_for_no_admin_list_with_a_users_token(tab, site):
    """Filters for a user's own credential are its own team, user and tokens only."""
    user = next(u for u in site.get("/v1/users")["data"] if u["email"] == "carol@demo.example")
    made = httpx.post(
        f"{site.url}/v1/users/{user['id']}/tokens",
        json={"name": "lead-view"},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    page = tab().sign_in(made["token"])
    teams = page.page.locator("#filter-team option").all_inner_texts()
    assert teams == ["all teams", "your team"]
    users = page.page.locator("#filter-user option").all_inner_texts()
    assert users == ["all users", user["email"]]
    assert page.errors == []

"""The dashboard by end user and by tag, in headless Chromium against the real server: requests
sent through the proxy with the official SDK and the `x-metering-end-user` / `x-metering-tags`
headers; filtering by end user and by tag shows only their requests; grouping by end user and by
a tag key draws /v1/spend's totals exactly; the URL keeps all of it; a view the API refuses says
why in its panel; nothing scrolls sideways at 390 px."""

import csv
import json
import uuid
from decimal import Decimal

import openai
import pytest

from tests.dashboard.conftest import OUTPUT
from tests.dashboard.test_lead import Tab
from tests.demo_site import ADMIN_KEY

# What each request of the module's own team carries: (end user, tags, completion tokens).
SENT = [
    ("acme", {"project": "search", "env": "prod"}, 7),
    ("acme", {"project": "search", "env": "prod"}, 11),
    ("acme", {"project": "search"}, 5),
    ("globex", {"project": "chat"}, 13),
    ("globex", {"project": "chat", "env": "dev"}, 3),
    ("initech", {}, 17),
    (None, {"project": "search"}, 9),
    (None, {}, 4),
]


@pytest.fixture(scope="module")
def attributed(site) -> dict:
    """A team of its own whose requests carry end users and tags; its id and their event ids."""
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    team = site.http.post(
        "/v1/teams", json={"name": f"attributed-{uuid.uuid4().hex[:8]}"}, headers=admin
    ).json()
    user = site.http.post(
        "/v1/users",
        json={
            "email": f"att-{uuid.uuid4().hex[:8]}@example.com",
            "name": "A",
            "team_id": team["id"],
        },
        headers=admin,
    ).json()
    token = site.http.post(
        f"/v1/users/{user['id']}/tokens", json={"name": "app"}, headers=admin
    ).json()
    client = openai.OpenAI(base_url=f"{site.url}/v1", api_key=token["token"], max_retries=0)
    ids = []
    for end_user, tags, tokens in SENT:
        headers = {}
        if end_user is not None:
            headers["x-metering-end-user"] = end_user
        if tags:
            headers["x-metering-tags"] = json.dumps(tags)
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-sim",
            messages=[{"role": "user", "content": f"hello sim:tokens={tokens}"}],
            extra_headers=headers,
        )
        ids.append(raw.headers["x-request-id"])
    return {"team": team["id"], "ids": ids}


@pytest.fixture
def tab(browser, site):
    tabs = []

    def open_tab(**kwargs) -> Tab:
        tabs.append(Tab(browser, site, **kwargs))
        return tabs[-1]

    yield open_tab
    for each in tabs:
        each.close()


def sent_ids(attributed, end_user=..., tags: dict | None = None) -> set[str]:
    """The ids of the requests sent with this end user (... any) and these tags (all match)."""
    return {
        event_id
        for event_id, (who, carried, _) in zip(attributed["ids"], SENT, strict=True)
        if (end_user is ... or who == end_user)
        and all(carried.get(k) == v for k, v in (tags or {}).items())
    }


def typed(page: Tab, selector: str, text: str) -> None:
    """Types into a filter input and presses Enter; waits for the refresh it starts."""

    def act() -> None:
        page.page.fill(selector, text)
        page.page.press(selector, "Enter")

    page.waiting(act)


def costs(rows: list[dict], field: str) -> dict:
    return {row[field]: Decimal(row["cost"]) for row in rows}


def test_filters_by_end_user_and_tag_show_only_their_requests(tab, site, attributed):
    team = attributed["team"]
    page = tab(path=f"/dashboard?team={team}").sign_in()
    assert set(page.ids("#recent-body tr")) == set(attributed["ids"])

    typed(page, "#filter-end-user", "acme")
    assert page.query() == {"team": team, "end_user": "acme"}
    acme = sent_ids(attributed, "acme")
    assert set(page.ids("#recent-body tr")) == acme and len(acme) == 3
    cells = page.page.locator("#recent-body td.end-user").all_inner_texts()
    assert cells == ["acme"] * 3
    start = page.page.locator("body").get_attribute("data-start")
    spend = site.get("/v1/spend", start=start, team_id=team, end_user="acme")
    assert Decimal(page.page.locator("#total-cost").get_attribute("data-value")) == Decimal(
        spend["total"]["cost"]
    )
    assert spend["total"]["requests"] == 3

    typed(page, "#filter-tag", "env:prod")
    assert page.page.url.endswith("end_user=acme&tag=env%3Aprod")
    both = sent_ids(attributed, "acme", {"env": "prod"})
    assert set(page.ids("#recent-body tr")) == both and len(both) == 2
    chips = page.page.locator("#recent-body td.tags").all()
    assert all(c.locator("[data-tag='env:prod']").count() == 1 for c in chips)

    # Without the end user: every request tagged env:prod and project:search, whoever sent it.
    typed(page, "#filter-end-user", "")
    typed(page, "#filter-tag", "project:search")
    assert page.query()["tag"] == "env:prod"  # parse_qs keeps the first of the repeated tags
    assert "tag=env%3Aprod&tag=project%3Asearch" in page.page.url
    tagged = sent_ids(attributed, tags={"env": "prod", "project": "search"})
    assert set(page.ids("#recent-body tr")) == tagged
    page.waiting(lambda: page.page.click("#tag-chips button[data-tag='env:prod']"))
    search = sent_ids(attributed, tags={"project": "search"})
    assert set(page.ids("#recent-body tr")) == search and len(search) == 4
    usage = site.get("/v1/usage", team_id=team, tag="project:search", limit=25)["data"]
    assert page.ids("#recent-body tr") == [e["id"] for e in usage]
    assert "project:search" in page.page.text_content("#filters-note")
    page.waiting(lambda: page.page.click("#filters-clear"))
    assert page.query() == {}
    assert page.errors == []


def test_grouping_by_end_user_and_by_a_tag_key_draws_the_reports_totals(tab, site, attributed):
    team = attributed["team"]
    page = tab(path=f"/dashboard?team={team}").sign_in()
    assert page.page.locator("#grouped-panel").is_hidden()
    page.select("#group", "end_user")
    assert page.query() == {"team": team, "group": "end_user"}
    start = page.page.locator("body").get_attribute("data-start")
    rows = site.get("/v1/spend", start=start, team_id=team, group_by="end_user")["rows"]
    expected = costs(rows, "end_user")
    assert set(expected) == {"acme", "globex", "initech", None}
    assert {r["end_user"]: r["requests"] for r in rows} == {
        "acme": 3,
        "globex": 2,
        "initech": 1,
        None: 2,
    }
    drawn = {
        el.get_attribute("data-key"): Decimal(el.get_attribute("data-cost"))
        for el in page.page.locator("#grouped-body tr").all()
    }
    assert drawn == expected
    series = {
        g.get_attribute("data-series-key"): Decimal(g.get_attribute("data-total"))
        for g in page.page.locator(
            "svg[data-chart='spend'] g[data-series-key], "
            "svg[data-chart='spend'] g:not([data-series-key])[data-total]"
        ).all()
    }
    assert series == expected
    assert "(no end user)" in page.page.locator("#grouped-body").inner_text()

    # By a tag: the key is typed once "tag…" is chosen.
    page.page.select_option("#group", "tag")
    assert page.page.locator("#group-tag").is_visible()
    typed(page, "#group-tag", "project")
    assert page.query() == {"team": team, "group": "tag:project"}
    rows = site.get("/v1/spend", start=start, team_id=team, group_by="tag:project")["rows"]
    expected = costs(rows, "tag:project")
    assert set(expected) == {"search", "chat", None}
    drawn = {
        el.get_attribute("data-key"): Decimal(el.get_attribute("data-cost"))
        for el in page.page.locator("#grouped-body tr").all()
    }
    assert drawn == expected
    total = Decimal(page.page.locator("#grouped").get_attribute("data-total"))
    assert total == sum(expected.values())
    assert (
        Decimal(page.page.locator("svg[data-chart='spend']").get_attribute("data-total")) == total
    )

    # Filtered and grouped at once: the filter narrows the groups.
    typed(page, "#filter-end-user", "acme")
    rows = site.get(
        "/v1/spend", start=start, team_id=team, group_by="tag:project", end_user="acme"
    )["rows"]
    assert [r["tag:project"] for r in rows] == ["search"]
    assert page.ids("#grouped-body tr", "data-key") == ["search"]
    OUTPUT.mkdir(exist_ok=True)
    page.page.screenshot(path=str(OUTPUT / f"dashboard-by-tag-{site.backend}.png"), full_page=True)
    assert page.errors == []


def test_a_link_opens_the_same_view(tab, site, attributed):
    team = attributed["team"]
    path = f"/dashboard?team={team}&group=tag%3Aenv&end_user=globex&tag=project%3Achat"
    page = tab(path=path).sign_in()
    assert page.page.input_value("#filter-end-user") == "globex"
    assert page.ids("#tag-chips button", "data-tag") == ["project:chat"]
    assert page.page.input_value("#group") == "tag"
    assert page.page.input_value("#group-tag") == "env"
    assert set(page.ids("#recent-body tr")) == sent_ids(attributed, "globex", {"project": "chat"})
    start = page.page.locator("body").get_attribute("data-start")
    rows = site.get(
        "/v1/spend",
        start=start,
        team_id=team,
        group_by="tag:env",
        end_user="globex",
        tag="project:chat",
    )["rows"]
    assert {r["tag:env"] for r in rows} == {"dev", None}
    assert set(page.ids("#grouped-body tr", "data-key")) == {"dev", None}
    page.page.reload()
    page.page.wait_for_selector("body[data-state=ready]")
    assert page.page.input_value("#filter-end-user") == "globex"
    assert page.errors == []


def test_the_requests_csv_has_end_user_and_tags(tab, site, attributed):
    page = tab(path=f"/dashboard?team={attributed['team']}&end_user=acme").sign_in()
    with page.page.expect_download() as info:
        page.page.click("button.csv[data-table='recent']")
    with open(info.value.path(), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["end user"] for r in rows] == ["acme"] * 3
    events = {
        e["id"]: e for e in site.get("/v1/usage", team_id=attributed["team"], limit=25)["data"]
    }
    shown = page.ids("#recent-body tr")
    assert [json.loads(r["tags"]) for r in rows] == [events[i]["tags"] for i in shown]
    assert page.errors == []


def test_a_view_the_api_refuses_says_why_in_its_panel(tab, site, attributed):
    """group_by is a list separated by commas: a tag key holding one is refused (400)."""
    team = attributed["team"]
    page = tab(path=f"/dashboard?team={team}&group=tag%3Aproject%2Cenv").sign_in()
    refused = site.http.get(
        "/v1/spend",
        params={"group_by": "tag:project,env", "team_id": team},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    for panel in ("#grouped-error", "#spend-error"):
        assert page.page.locator(panel).is_visible()
        assert "(400)" in page.page.text_content(panel)
    assert message in page.page.text_content("#grouped-error")
    # The rest of the page is drawn.
    assert set(page.ids("#recent-body tr")) == set(attributed["ids"])
    assert page.page.locator("body").get_attribute("data-state") == "ready"
    # The browser reports the 400s itself; nothing else went wrong.
    assert page.errors and all("400" in error for error in page.errors)


def test_no_sideways_scrolling_at_phone_width_with_end_users_and_tags(tab, site, attributed):
    team = attributed["team"]
    page = tab(size=(390, 844), path=f"/dashboard?team={team}&group=end_user&tag=project%3Asearch")
    page.sign_in()
    assert page.page.locator("#grouped-panel").is_visible()
    assert int(page.page.locator("#recent").get_attribute("data-rows")) == 4
    assert page.page.locator("#recent-body td.tags .chip").count() > 0
    assert page.no_sideways_scroll()
    OUTPUT.mkdir(exist_ok=True)
    page.page.screenshot(
        path=str(OUTPUT / f"dashboard-end-users-phone-{site.backend}.png"), full_page=True
    )
    for selector in ("#grouped-panel", "#filters"):
        box = page.page.locator(selector).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390.5, selector
    assert page.errors == []

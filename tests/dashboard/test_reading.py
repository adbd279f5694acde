"""The dashboard's reading side in headless Chromium, one tab per database, at 1280x800 then
390x844: the budget threshold mark clear of the reset time, the limits' headers over their
columns, two tokens of one name told apart, refusals' reasons with names and times in the
chosen zone, phone cards that show a refusal's reason and status and an alert's event without a
sideways scroll, month-to-date and custom ranges with the API's figures, the chart of spend by
end user. Checked by the elements' boxes and text; screenshots in test-output/."""

import re
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import parse_qs, urlsplit

import httpx
import openai
import pytest

from tests.dashboard.conftest import OUTPUT
from tests.demo_site import ADMIN_KEY

READY = "body[data-state=ready]"
STAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?Z")

BOXES = """(selector) => [...document.querySelectorAll(selector)].map((e) => {
  const b = e.getBoundingClientRect();
  return {x: b.x, y: b.y, w: b.width, h: b.height, text: e.textContent};
})"""


def overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["w"] - 0.5
        and b["x"] < a["x"] + a["w"] - 0.5
        and a["y"] < b["y"] + b["h"] - 0.5
        and b["y"] < a["y"] + a["h"] - 0.5
    )


class Tab:
    def __init__(self, browser, site) -> None:
        self.site = site
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))

    def open(self, path: str = "/dashboard") -> None:
        self.page.goto(f"{self.site.url}{path}")
        if self.page.locator("#login").is_visible():
            self.page.fill("#key", ADMIN_KEY)
            self.page.click("#login button[type=submit]")
        self.page.wait_for_selector(READY)

    def waiting(self, action) -> None:
        self.page.evaluate("document.body.dataset.state = 'changing'")
        action()
        self.page.wait_for_selector(READY)

    def boxes(self, selector: str) -> list[dict]:
        return self.page.evaluate(BOXES, selector)

    def query(self) -> dict:
        return {k: v[0] for k, v in parse_qs(urlsplit(self.page.url).query).items()}

    def total(self) -> Decimal:
        return Decimal(self.page.locator("#total-cost").get_attribute("data-value"))

    def no_sideways_scroll(self) -> bool:
        return self.page.evaluate(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )

    def shot(self, name: str) -> None:
        OUTPUT.mkdir(exist_ok=True)
        path = OUTPUT / f"dashboard-reading-{name}-{self.site.backend}.png"
        self.page.screenshot(path=str(path), full_page=True)


def two_of_a_name(site) -> dict:
    """A team and user of its own (the demo's teams, users and tokens stay as the demo tests
    expect them) with three tokens named "scratch": two with some spend, one whose daily budget
    refuses its first request (a refusal with a reset time in its message)."""
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    team = httpx.post(
        f"{site.url}/v1/teams", json={"name": f"reading-{uuid.uuid4().hex[:8]}"}, headers=admin
    ).json()
    user = httpx.post(
        f"{site.url}/v1/users",
        json={
            "team_id": team["id"],
            "email": f"reader-{uuid.uuid4().hex[:8]}@example.com",
            "name": "Reader",
        },
        headers=admin,
    ).json()
    spent, other, refused = (
        httpx.post(
            f"{site.url}/v1/users/{user['id']}/tokens",
            json={"name": "scratch", **limit},
            headers=admin,
        ).json()
        for limit in ({}, {}, {"credit_limit": "0.000000000001", "reset_interval": "daily"})
    )
    messages = [{"role": "user", "content": "sim:tokens=5"}]
    clients = {
        t["id"]: openai.OpenAI(base_url=f"{site.url}/v1", api_key=t["token"], max_retries=0)
        for t in (spent, other, refused)
    }
    for token in (spent, other):
        clients[token["id"]].chat.completions.create(model="gpt-sim", messages=messages)
    with pytest.raises(openai.APIStatusError, match="402"):
        clients[refused["id"]].chat.completions.create(model="gpt-sim", messages=messages)
    return {"user": user, "token": spent, "refused": refused}


def test_the_reading_side_at_desktop_and_phone_widths(browser, site):
    made = two_of_a_name(site)
    user = made["user"]
    tab = Tab(browser, site)
    try:
        tab.open(f"/dashboard?user={user['id']}&team={user['team_id']}")
        # Two tokens of one name: distinct labels in "Spend by token" and the token filter.
        labels = {
            el.get_attribute("data-key"): el.inner_text()
            for el in tab.page.locator("#drill-body button.drill").all()
        }
        scratch = [label for label in labels.values() if label.startswith("scratch")]
        assert len(scratch) == 2 and len(set(scratch)) == 2, labels
        assert labels[made["token"]["id"]] == f"scratch ({made['token']['prefix']}…)"
        options = tab.page.locator("#filter-token option").all_inner_texts()
        assert len([o for o in options if o.startswith("scratch")]) == 3
        assert len(set(options)) == len(options)

        # The refusals' why: the token's name, not its id; the reset time in the zone.
        tab.waiting(lambda: tab.page.click("#filters-clear"))
        start = tab.page.locator("body").get_attribute("data-start")
        refusals = site.get(
            "/v1/refusals", start=start, token_id=made["refused"]["id"], labels="true"
        )["data"]
        budget = next(r for r in refusals if r["reason"] == "budget" and r["scope"] == "token")
        why = tab.page.locator(f"#refused-body tr[data-id='{budget['id']}'] td.why").inner_text()
        assert budget["subject_id"] in budget["message"] and budget["subject_id"] not in why
        assert f"scratch ({made['refused']['prefix']}" in why
        raw = STAMP.search(budget["message"]).group(0)
        at = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        assert at.strftime("%Y-%m-%d %H:%M:%S") in why and not STAMP.search(why)

        # Budget use: the threshold mark clear of the reset time and of every other text.
        assert tab.page.locator("svg[data-chart='budgets'] .threshold-mark").count() > 0
        marks = tab.boxes("svg[data-chart='budgets'] .threshold-mark")
        resets = tab.boxes("svg[data-chart='budgets'] .resets")
        assert resets and all(not overlap(m, r) for m in marks for r in resets)
        texts = tab.boxes("svg[data-chart='budgets'] text")
        for i, a in enumerate(texts):
            assert all(not overlap(a, b) for b in texts[i + 1 :]), (a, texts)

        # Rate and model limits: each header over its column (numbers right-aligned).
        assert int(tab.page.locator("#limits").get_attribute("data-rows")) > 0
        heads = tab.page.evaluate(
            """() => [...document.querySelectorAll('#limits thead th')].map((th, i) => {
              const b = th.getBoundingClientRect(), right = th.classList.contains('num');
              const cells = [...document.querySelectorAll(`#limits tbody tr td:nth-child(${i + 1})`)]
                .map((td) => td.getBoundingClientRect());
              return {right, th: [b.left, b.right], cells: cells.map((c) => [c.left, c.right])};
            })"""
        )
        assert [h["right"] for h in heads] == [False, False, True, True, True, False]
        for head in heads:
            for cell in head["cells"]:
                assert abs(cell[0] - head["th"][0]) < 1 and abs(cell[1] - head["th"][1]) < 1
        values = tab.page.evaluate(
            """() => [...document.querySelectorAll('#limits tbody td.num .v')].map((v) => {
              const c = v.parentElement.getBoundingClientRect(), b = v.getBoundingClientRect();
              const cs = getComputedStyle(v.parentElement);
              return c.right - parseFloat(cs.paddingRight) - b.right;
            })"""
        )
        assert values and all(abs(gap) < 1 for gap in values)  # right-aligned numbers
        tab.shot("desktop")

        # Month to date: the API's figures from the 1st (UTC).
        tab.waiting(lambda: tab.page.select_option("#range", "mtd"))
        now = datetime.now(UTC)
        first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        assert tab.query()["range"] == "mtd"
        assert tab.page.locator("body").get_attribute("data-start") == first.strftime(
            "%Y-%m-%dT%H:%M:%S.000Z"
        )
        spend = site.get("/v1/spend", start=first.isoformat())
        assert tab.total() == Decimal(spend["total"]["cost"]) > 0
        # A custom range: yesterday only (nothing: the demo's traffic is today's), then today.
        yesterday = (now - timedelta(days=1)).strftime("%Y-%m-%d")
        today = now.strftime("%Y-%m-%d")
        for day in (yesterday, today):
            tab.open(f"/dashboard?range=custom&from={day}&to={day}")
            assert tab.query() == {"range": "custom", "from": day, "to": day}
            assert tab.page.input_value("#range") == "custom"
            assert tab.page.input_value("#range-from") == day
            begin = datetime.fromisoformat(f"{day}T00:00:00+00:00")
            end = begin + timedelta(days=1)
            assert tab.page.locator("body").get_attribute("data-end") == end.strftime(
                "%Y-%m-%dT%H:%M:%S.000Z"
            )
            spend = site.get("/v1/spend", start=begin.isoformat(), end=end.isoformat())
            assert tab.total() == Decimal(spend["total"]["cost"])
            summary = site.get("/v1/refusals/summary", start=begin.isoformat(), end=end.isoformat())
            counted = tab.page.locator("#refusal-counts").get_attribute("data-total")
            assert counted == str(summary["total"]["refusals"])
            if day == yesterday:
                assert tab.total() == 0
            else:
                assert tab.total() > 0
        # Back to 24 hours: no dates in the URL; "custom dates…" again: the last ones chosen.
        tab.waiting(lambda: tab.page.select_option("#range", "24h"))
        assert tab.query() == {}
        assert tab.page.locator("#custom-range").is_hidden()
        tab.waiting(lambda: tab.page.select_option("#range", "custom"))
        assert tab.query() == {"range": "custom", "from": today, "to": today}

        # Spend by end user: the chart of the grouped rows, as the API reports them.
        tab.waiting(lambda: tab.page.select_option("#group", "end_user"))
        start = tab.page.locator("body").get_attribute("data-start")
        end = tab.page.locator("body").get_attribute("data-end")
        grouped = site.get("/v1/spend", start=start, end=end, group_by="end_user")
        chart = tab.page.locator("svg[data-chart='grouped']")
        assert Decimal(chart.get_attribute("data-total")) == Decimal(grouped["total"]["cost"]) > 0
        assert int(chart.get_attribute("data-points")) == min(10, len(grouped["rows"]))
        spend_chart = tab.page.locator("svg[data-chart='spend']")
        assert Decimal(spend_chart.get_attribute("data-total")) == Decimal(grouped["total"]["cost"])

        # A phone: refusals and alerts as cards, reason, status and event inside the screen.
        tab.page.set_viewport_size({"width": 390, "height": 844})
        tab.open("/dashboard")
        assert tab.no_sideways_scroll()
        for table, labels_first in (("refused", ("reason", "status")), ("alerts", ("event",))):
            assert int(tab.page.locator(f"#{table}").get_attribute("data-rows")) > 0
            wrap = tab.page.evaluate(
                f"(() => {{ const w = document.querySelector('#{table}').parentElement;"
                " return [w.scrollWidth, w.clientWidth]; })()"
            )
            assert wrap[0] <= wrap[1], table  # no inner sideways scroll
            for label in labels_first:
                cells = tab.boxes(f"#{table} tbody td[data-label='{label}']")
                assert cells
                for cell in cells:
                    assert cell["x"] >= 0 and cell["x"] + cell["w"] <= 390 + 0.5, (table, cell)
                    assert cell["text"].strip()
            # What matters first: the first cell drawn in each card is the reason (or event).
            firsts = tab.page.evaluate(
                f"""() => [...document.querySelectorAll('#{table} tbody tr')].map((tr) =>
                  [...tr.cells].sort((a, b) => a.getBoundingClientRect().top
                    - b.getBoundingClientRect().top)[0].dataset.label)"""
            )
            assert set(firsts) == {labels_first[0]}, firsts
            # No text of a card drawn over another's.
            cells = tab.boxes(f"#{table} tbody td .v")
            for i, a in enumerate(cells):
                assert all(not overlap(a, b) for b in cells[i + 1 :]), table
        texts = tab.boxes("svg[data-chart='budgets'] text")
        for i, a in enumerate(texts):
            assert all(not overlap(a, b) for b in texts[i + 1 :])
        tab.shot("phone")
        assert tab.errors == []
    finally:
        tab.context.close()

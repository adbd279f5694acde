"""The console's search in headless Chromium: what is typed is sent to the server as `q`, which
searches every row (a row past the first page is found), pages the matches and stays in the
page's URL; and an end user's alert named by the end user's own id, not its budget's. A site
of its own (SQLite; the API's tests cover both databases), so the demo's objects stay as they
are."""

import uuid

import httpx
import openai
import pytest

from metering import migrate
from metering.demo import demo_catalog
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.dashboard.test_admin import CONSOLE, READY, Console
from tests.demo_site import ADMIN_KEY, Site

PAGE = 50  # the console's page (admin.js)


@pytest.fixture(scope="module")
def own_site(sim, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('search') / 'metering.db'}"
    migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
    server = metering_server(settings, parse_catalog(demo_catalog(sim)))
    http = httpx.Client(base_url=server.url, timeout=30)
    yield Site("sqlite", server.url, url, server, {}, http)
    http.close()
    server.stop()


@pytest.fixture
def console(browser):
    tabs: list[Console] = []

    def open_console(site) -> Console:
        tabs.append(Console(browser, site))
        return tabs[-1]

    yield open_console
    for each in tabs:
        each.close()


def post(site: Site, path: str, body: dict) -> dict:
    response = site.http.post(path, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 201, response.text
    return response.json()


def search(page: Console, text: str) -> list[str]:
    """Type into the search box; the ids of the rows the server answered for it."""
    page.page.fill("#admin-search", text)
    page.page.wait_for_function(
        "q => document.getElementById('admin-table').dataset.q === q", arg=text
    )
    page.page.wait_for_selector(CONSOLE)
    return shown(page)


def shown(page: Console) -> list[str]:
    return page.page.eval_on_selector_all(
        "#admin-rows tr[data-id]", "rows => rows.map(r => r.dataset.id)"
    )


def test_the_search_box_finds_a_row_past_the_first_page_and_pages_the_matches(console, own_site):
    tag = uuid.uuid4().hex[:8]
    team = post(own_site, "/v1/teams", {"name": f"searched {tag}"})
    made = [
        post(
            own_site,
            "/v1/users",
            {
                "name": f"member {tag} {n:02d}",
                "email": f"m{n:02d}-{tag}@example.com",
                "team_id": team["id"],
            },
        )
        for n in range(PAGE + 1)
    ]
    first_page = {u["id"] for u in own_site.get("/v1/users", limit=PAGE)["data"]}
    target = next(u for u in made if u["id"] not in first_page)

    page = console(own_site)
    page.tab("users")
    assert target["id"] not in shown(page)
    # Any case; the server answers with the one user, though it is not on the page loaded.
    assert search(page, target["name"].upper()) == [target["id"]]
    assert f"q={target['name'].upper().replace(' ', '+')}" in page.page.url
    assert "manage=users" in page.page.url

    # The tag matches every member: the first page of the matches, then the rest.
    everyone = sorted(u["id"] for u in made)
    assert search(page, tag) == everyone[:PAGE]
    page.page.evaluate("document.getElementById('admin').dataset.state = 'loading'")
    page.page.click("#admin-next")
    page.page.wait_for_selector(CONSOLE)
    assert shown(page) == everyone[PAGE:]
    # A new search starts again from the first page of its matches.
    assert search(page, f"m{PAGE:02d}-{tag}") == [made[PAGE]["id"]]

    # `%` is only itself: no member's name or email holds one.
    assert search(page, f"{tag}%") == []
    assert page.page.locator("#admin-rows .admin-empty").count() == 1

    # A reload keeps the tab and the search: they are in the URL.
    assert search(page, target["email"]) == [target["id"]]
    page.page.reload()
    page.page.wait_for_selector(READY)
    page.page.wait_for_selector(CONSOLE)
    assert page.page.input_value("#admin-search") == target["email"]
    assert (
        page.page.get_attribute("#admin .admin-tabs button[data-tab=users]", "aria-pressed")
        == "true"
    )
    assert shown(page) == [target["id"]]
    # Emptied, the box lists every user again, the search gone from the URL.
    assert search(page, "")[:PAGE] == sorted(first_page)
    assert "q=" not in page.page.url
    assert page.errors == []


def test_an_end_user_alert_is_named_by_the_end_users_own_id(console, own_site):
    tag = uuid.uuid4().hex[:8]
    team = post(
        own_site,
        "/v1/teams",
        {"name": f"end users {tag}", "end_user_credit_limit": "0.00002"},
    )
    user = post(
        own_site,
        "/v1/users",
        {"name": "caller", "email": f"caller-{tag}@example.com", "team_id": team["id"]},
    )
    token = post(own_site, f"/v1/users/{user['id']}/tokens", {"name": "app"})
    client = openai.OpenAI(base_url=f"{own_site.url}/v1", api_key=token["token"], max_retries=0)
    end_user = f"ivy-{tag}"
    refused = None
    for _ in range(20):
        try:
            client.chat.completions.create(
                model="gpt-sim",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=16,
                user=end_user,
            )
        except openai.APIStatusError as exc:
            refused = exc.status_code
            break
    assert refused == 402
    events = own_site.get("/v1/alerts", scope="end_user")["data"]
    assert events and {e["data"]["end_user"] for e in events} == {end_user}

    page = console(own_site)
    rows = page.page.locator("#alerts-body tr", has_text=end_user)
    assert rows.count() == len(events)
    assert rows.first.locator("td").nth(3).text_content() == f"{end_user} ({team['name']})"
    assert "eu_" not in page.page.locator("#alerts-body").text_content()
    assert page.errors == []

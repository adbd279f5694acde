"""Self-service in headless Chromium against a live server on each database: a user signs in
with their password, creates tokens up to the cap (the eleventh refused with the API's message),
spends with one through the `openai` SDK, tightens and revokes, and sees their own spend only,
never another user's or team's; the session's access token is refreshed when it expires; a
wrong password is said; no sideways scroll or overlapping text at desktop and phone sizes."""

import uuid
from decimal import Decimal

from tests.conftest import ADMIN_KEY
from tests.dashboard.conftest import OUTPUT
from tests.dashboard.test_admin import HOSTILE, no_overlap

READY = "body[data-state=ready]"
PANEL = "#self[data-state=ready]"
FITS = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
PASSWORD = "correct horse battery staple"


def spend_with(api, secret: str, times: int = 1) -> None:
    client = api.openai(secret)
    for _ in range(times):
        client.chat.completions.create(
            model="gpt-sim",
            messages=[{"role": "user", "content": "hello sim:tokens=5"}],
            max_tokens=8,
        )


def people(api) -> dict:
    """A user with a password; a teammate and a user of another team, each with spend."""
    team = api.team()
    email = f"ana-{uuid.uuid4().hex[:8]}@example.com"
    user = api.ok(
        "POST",
        "/v1/users",
        201,
        json={"email": email, "name": "Ana", "team_id": team["id"], "password": PASSWORD},
    )
    mate = api.user(team["id"])
    other_team, other, other_token = api.principal()
    mate_token = api.token(mate["id"])
    spend_with(api, mate_token["token"])
    spend_with(api, other_token["token"])
    return {
        "user": user,
        "mate": mate,
        "mate_token": mate_token,
        "other_team": other_team,
        "other": other,
        "other_token": other_token,
    }


class Tab:
    def __init__(self, browser, api) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.context.grant_permissions(["clipboard-read", "clipboard-write"])
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(f"{r.method} {r.url}"))
        self.page.goto(f"{api.url}/dashboard")
        self.page.wait_for_selector("#password-login:not([hidden])")

    def sign_in(self, email: str, password: str) -> None:
        self.page.fill("#email", email)
        self.page.fill("#password", password)
        self.page.click("#password-login button[type=submit]")

    def action(self, do) -> None:
        """Runs do(), then waits for the panel to have drawn what the API now says."""
        self.page.evaluate("document.getElementById('self').dataset.state = 'changing'")
        do()
        self.page.wait_for_selector(PANEL)

    def submit(self, form: str, fields: dict, *, ok: bool = True) -> None:
        for name, value in fields.items():
            self.page.fill(f"{form} [name={name}]", value)
        if ok:
            self.action(lambda: self.page.click(f"{form} button[type=submit]"))
        else:
            self.page.click(f"{form} button[type=submit]")
            self.page.wait_for_selector(f"{form}[data-state=error]")

    def error(self, form: str, field: str | None = None) -> str:
        where = f".admin-error[data-for={field}]" if field else ".admin-form-error"
        return self.page.locator(f"{form} {where}").text_content()

    def row(self, token_id: str):
        return self.page.locator(f"#self-rows tr[data-id='{token_id}']")

    def named(self, name: str) -> str:
        rows = self.page.locator("#self-rows tr").filter(has_text=name)
        assert rows.count() == 1, name
        return rows.get_attribute("data-id")

    def ids(self) -> list[str]:
        return self.page.locator("#self-rows tr").evaluate_all(
            "rows => rows.map(r => r.dataset.id)"
        )

    def key(self) -> str:
        return self.page.evaluate("sessionStorage.getItem('metering.key')")

    def fetch(self, path: str) -> int:
        """What the API answers the page's own key for path (a call the page never makes)."""
        return self.page.evaluate(
            """async (path) => (await fetch(path, { headers: {
                 authorization: `Bearer ${sessionStorage.getItem('metering.key')}` } })).status""",
            path,
        )

    def layout(self, name: str, size: str) -> None:
        assert self.page.evaluate(FITS), (name, size)
        assert no_overlap(self.page, "#self", "td, p") == [], (name, size)
        assert no_overlap(self.page, "#password-login", "label, p") == [], (name, size)
        OUTPUT.mkdir(exist_ok=True)
        shot = OUTPUT / f"dashboard-self-{name}-{size}.png"
        if self.page.locator("#self").is_visible():
            self.page.locator("#self").screenshot(path=str(shot))
        else:
            self.page.screenshot(path=str(shot))


def test_a_user_manages_their_own_tokens_and_sees_their_own_spend_only(browser, api, clock):
    who = people(api)
    user = who["user"]
    tab = Tab(browser, api)
    page = tab.page
    tab.layout("sign-in", "desktop")

    # A wrong password: the API's reason, and still signed out.
    tab.sign_in(user["email"], "not the password")
    page.wait_for_selector("#password-login[data-state=error]")
    assert page.locator("#password-message").text_content() == (
        "Not signed in: invalid email or password"
    )
    assert page.locator("#panels").is_hidden()

    tab.sign_in(user["email"], PASSWORD)
    page.wait_for_selector(READY)
    page.wait_for_selector(PANEL)
    assert page.locator("#password-login").is_hidden()
    # Only the test's own refreshes from here on.
    page.evaluate("document.body.dataset.state = 'changing'")
    tab.action(lambda: page.select_option("#refresh-every", "0"))
    assert tab.key().startswith("mat_")
    # What a user may do, and nothing of an admin's: no console, no team or user pickers.
    assert page.locator("#admin").is_hidden()
    assert page.locator("#filter-team").is_hidden()
    assert page.locator("#filter-user").is_hidden()
    assert f"Signed in as {user['email']}" in page.locator("#self-who").text_content()
    assert page.locator("#self-count").text_content() == "0 of 10 active tokens"

    # The first token: a value the API refuses, named next to its field; one the form refuses
    # before sending; then created, its secret shown once with a copy button.
    form = "#self-form"
    page.click("#self-new")
    tab.submit(form, {"name": HOSTILE, "rpm_limit": "99999999999"}, ok=False)
    assert "rpm_limit" in tab.error(form, "rpm_limit")
    tab.submit(form, {"rpm_limit": "", "credit_limit": "1.2.3"}, ok=False)
    assert "credit_limit" in tab.error(form, "credit_limit")
    assert tab.error(form, "rpm_limit") == ""
    tab.submit(form, {"credit_limit": "1"})
    secret = page.locator("#self-secret").text_content()
    assert secret.startswith("mtr_")
    page.click("#self-copy")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    first = tab.named(HOSTILE)
    assert tab.row(first).locator(".self-name").text_content() == HOSTILE
    assert page.locator("#self img").count() == 0
    assert page.evaluate("window.__pwned") is None
    page.click("#self-done")
    assert page.locator("#self-secret").count() == 0

    # Up to the cap, then the eleventh is refused with the API's own message.
    for n in range(2, 11):
        page.click("#self-new")
        tab.submit(form, {"name": f"nb-{n}"})
    assert page.locator("#self-count").text_content().startswith("10 of 10 active tokens")
    page.click("#self-new")
    tab.submit(form, {"name": "one too many"}, ok=False)
    assert tab.error(form) == (f"user {user['id']} already has 10 active tokens: revoke one first")
    page.click(f"{form} .self-cancel")

    # Spend with the first token through the SDK: the page shows it, and only the user's own.
    spend_with(api, secret, times=2)
    page.evaluate("document.body.dataset.state = 'changing'")
    tab.action(lambda: page.click("#refresh-now"))
    page.wait_for_selector(READY)
    token_budget = api.ok("GET", f"/v1/tokens/{first}/budget")
    assert Decimal(token_budget["spent"]) > 0
    assert (
        tab.row(first).locator(".self-spent").get_attribute("data-spent") == (token_budget["spent"])
    )
    start = page.locator("body").get_attribute("data-start")
    own = api.ok("GET", "/v1/spend", params={"start": start, "user_id": user["id"]})
    everyone = api.ok("GET", "/v1/spend", params={"start": start})
    assert Decimal(everyone["total"]["cost"]) > Decimal(own["total"]["cost"]) > 0
    assert Decimal(page.locator("#total-cost").get_attribute("data-value")) == Decimal(
        own["total"]["cost"]
    )
    text = page.locator("body").inner_text()
    for foreign in (
        who["other"]["email"],
        who["mate"]["email"],
        who["other_team"]["name"],
        who["other_token"]["prefix"],
        who["mate_token"]["prefix"],
    ):
        assert foreign not in text

    # Tighten: lower the credit limit and add a rate limit; then a raise, refused by the API
    # with its message next to the field.
    tighten = "#self-tighten-form"
    tab.row(first).locator(".self-tighten").click()
    tab.submit(tighten, {"credit_limit": "0.5", "rpm_limit": "5"})
    shown = api.ok("GET", f"/v1/tokens/{first}")
    assert (shown["credit_limit"], shown["rpm_limit"]) == ("0.5", 5)
    assert "5 requests/min" in tab.row(first).locator(".self-limits").text_content()
    tab.row(first).locator(".self-tighten").click()
    tab.submit(tighten, {"rpm_limit": "6"}, ok=False)
    assert tab.error(tighten, "rpm_limit") == (
        "rpm_limit: only the admin key may raise or remove a token's limit"
    )
    page.click(f"{tighten} .self-cancel")

    # Revoke one, after a confirmation saying what it does: its next request is refused.
    second = tab.named("nb-2")
    tab.row(second).locator(".self-revoke").click()
    assert "refused (401) at once" in page.locator("#self-confirm-text").text_content()
    tab.action(lambda: page.click("#self-confirm-yes"))
    assert second not in tab.ids()
    assert page.locator("#self-count").text_content() == "9 of 10 active tokens"
    assert api.ok("GET", f"/v1/tokens/{second}")["revoked_at"] is not None

    # Another team or user, forced with the page's own key: the API refuses.
    for path in (
        "/v1/teams",
        "/v1/users",
        f"/v1/teams/{who['other_team']['id']}/budget",
        f"/v1/users/{who['other']['id']}/tokens",
        f"/v1/users/{who['mate']['id']}",
        f"/v1/spend?user_id={who['other']['id']}",
    ):
        assert tab.fetch(path) == 403, path

    # The access token expires (the server's clock moves past its 15 minutes): the page's next
    # refresh renews the pair once, and the page stays signed in.
    before = tab.key()
    clock.advance(api.settings.access_token_ttl_s + 60)
    tab.requests.clear()
    page.evaluate("document.body.dataset.state = 'changing'")
    tab.action(lambda: page.click("#refresh-now"))
    page.wait_for_selector(READY)
    assert [r for r in tab.requests if "/v1/auth/" in r] == [f"POST {api.url}/v1/auth/refresh"]
    assert tab.key() != before and tab.key().startswith("mat_")
    assert api.request("GET", "/v1/me", key=before).status_code == 401
    assert page.locator("#panels").is_visible()

    tab.layout("tokens", "desktop")
    page.set_viewport_size({"width": 390, "height": 844})
    page.click("#self-new")
    page.wait_for_selector(form)
    tab.layout("tokens", "phone")

    # Signing out ends the session on the server too; the sign-in form fits a phone.
    session = page.evaluate("JSON.parse(sessionStorage.getItem('metering.session'))")
    with page.expect_response("**/v1/auth/logout") as logout:
        page.click("#sign-out")
    assert logout.value.status == 204
    page.wait_for_selector("#password-login:not([hidden])")
    assert page.evaluate("sessionStorage.getItem('metering.session')") is None
    tab.layout("sign-in", "phone")
    assert api.request("GET", "/v1/me", key=session["access"]).status_code == 401

    # The admin key in the same tab: the Manage console, and no "My tokens".
    page.fill("#key", ADMIN_KEY)
    page.click("#login button[type=submit]")
    page.wait_for_selector("#admin[data-state=ready]")
    assert page.locator("#self").is_hidden()
    assert tab.errors == []
    tab.context.close()

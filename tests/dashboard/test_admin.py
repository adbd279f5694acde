"""The admin console ("Manage") in headless Chromium against a live server on each database:
teams, users and tokens created, edited and revoked through its forms, with the `openai` SDK
spending through the proxy; the API's errors next to their fields; hostile names as text; no
sideways scroll or overlapping text at desktop and phone sizes."""

import uuid

import openai
import pytest

from tests.dashboard.conftest import OUTPUT
from tests.demo_site import ADMIN_KEY

READY = "body[data-state=ready]"
CONSOLE = "#admin[data-state=ready]"
SIZES = {"desktop": (1280, 800), "phone": (390, 844)}
HOSTILE = "<img src=x onerror=window.__pwned=1>"


class Console:
    def __init__(self, browser, site) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(f"{site.url}/dashboard")
        self.page.fill("#key", ADMIN_KEY)
        self.page.click("#login button[type=submit]")
        self.page.wait_for_selector(READY)
        self.page.wait_for_selector(CONSOLE)

    def tab(self, kind: str) -> None:
        self.page.evaluate("document.getElementById('admin').dataset.state = 'loading'")
        self.page.click(f"#admin .admin-tabs button[data-tab={kind}]")
        self.page.wait_for_selector(CONSOLE)

    def submit(self, fields: dict, *, ok: bool = True) -> None:
        form = self.page.locator("#admin-form")
        for name, value in fields.items():
            control = form.locator(f"[name={name}]")
            if control.evaluate("e => e.tagName") == "SELECT":
                control.select_option(value)
            else:
                control.fill(value)
        if ok:
            self.page.evaluate("document.getElementById('admin').dataset.state = 'loading'")
            form.locator("button[type=submit]").click()
            self.page.wait_for_selector(CONSOLE)
            self.page.wait_for_selector("#admin-form", state="detached")
        else:
            form.locator("button[type=submit]").click()
            self.page.wait_for_selector("#admin-form[data-state=error]")

    def create(self, kind: str, fields: dict) -> None:
        self.tab(kind)
        self.page.click("#admin-new")
        self.submit(fields)

    def row(self, text: str):
        return self.page.locator("#admin-rows tr", has_text=text)

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def sqlite_site(sites):
    """The demo site on SQLite only: for what does not depend on the database."""
    return sites.get("sqlite")


@pytest.fixture
def console(browser):
    tabs = []

    def open_console(site) -> Console:
        tabs.append(Console(browser, site))
        return tabs[-1]

    yield open_console
    for each in tabs:
        each.close()


def chat(site, secret: str):
    client = openai.OpenAI(base_url=f"{site.url}/v1", api_key=secret, max_retries=0)
    return client.chat.completions.create(
        model="gpt-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=16
    )


def no_overlap(page, root: str = "#admin", extra: str = ".admin-name, .admin-id") -> list:
    """Pairs of the visible text boxes within root (the console) that overlap (none expected)."""
    kinds = f"button, input, select, h2, h3, th, .admin-field > span, {extra}".split(", ")
    selector = ", ".join(f"{root} {kind}" for kind in kinds)
    return page.evaluate(
        """(selector) => {
        const boxes = [...document.querySelectorAll(selector)]
          .filter(e => e.offsetParent !== null).map(e => [e, e.getBoundingClientRect()])
          .filter(([, r]) => r.width > 0 && r.height > 0);
        const bad = [];
        for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
          const [a, ra] = boxes[i], [b, rb] = boxes[j];
          if (a.contains(b) || b.contains(a)) continue;
          const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
          const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
          if (w > 1 && h > 1) bad.push([a.outerHTML.slice(0, 60), b.outerHTML.slice(0, 60)]);
        }
        return bad;
    }""",
        selector,
    )


def test_an_admin_manages_a_team_user_and_token_through_the_forms(console, site):
    tag = uuid.uuid4().hex[:8]
    page = console(site)
    # A team with a hostile name: shown as text, never run.
    team_name = f"{HOSTILE} {tag}"
    page.create("teams", {"name": team_name})
    assert page.row(tag).locator(".admin-name").text_content() == team_name
    assert page.page.locator("#admin img").count() == 0
    assert page.page.evaluate("window.__pwned") is None
    team_id = page.row(tag).get_attribute("data-id")

    page.create(
        "users", {"name": f"ana {tag}", "email": f"ana-{tag}@example.com", "team_id": team_id}
    )
    user_id = page.row(f"ana {tag}").get_attribute("data-id")

    # A token: first a value the API refuses, its message next to the field it names.
    page.tab("tokens")
    page.page.select_option("#admin-user", user_id)
    page.page.wait_for_selector(CONSOLE)
    page.page.click("#admin-new")
    page.submit(
        {"name": f"nb-{tag}", "credit_limit": "0.0001", "rpm_limit": "99999999999"}, ok=False
    )
    error = page.page.locator(".admin-error[data-for=rpm_limit]").text_content()
    assert "rpm_limit" in error
    assert page.page.locator(".admin-error[data-for=credit_limit]").text_content() == ""
    # A malformed amount is named by the form before any call, in the API's terms.
    page.submit({"rpm_limit": "", "credit_limit": "1.2.3"}, ok=False)
    assert "credit_limit" in page.page.locator(".admin-error[data-for=credit_limit]").text_content()
    page.submit({"credit_limit": "0.0001"})
    secret = page.page.locator("#admin-secret").text_content()
    assert secret.startswith("mtr_")
    token_id = page.row(f"nb-{tag}").get_attribute("data-id")

    # Spend until the budget refuses.
    statuses = []
    for _ in range(30):
        try:
            chat(site, secret)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
            break
    assert statuses == [402]
    page.page.evaluate("document.body.dataset.state = 'changing'")
    page.page.click("#refresh-now")
    page.page.wait_for_selector(READY)
    refused = page.page.locator("#refused-body tr", has_text="402").first
    assert refused.count() == 1

    # Raise the limit through the form: the next request is served.
    page.row(f"nb-{tag}").locator(".admin-edit").click()
    page.submit({"credit_limit": "100"})
    assert site.get(f"/v1/tokens/{token_id}")["credit_limit"] == "100"
    assert chat(site, secret).choices

    # Revoke it, after a confirmation naming what happens: the next request is refused.
    page.row(f"nb-{tag}").locator(".admin-delete").click()
    assert "refuses its next request" in page.page.locator("#admin-confirm-text").text_content()
    page.page.evaluate("document.getElementById('admin').dataset.state = 'loading'")
    page.page.click("#admin-confirm-yes")
    page.page.wait_for_selector(CONSOLE)
    assert page.row(f"nb-{tag}").count() == 0
    with pytest.raises(openai.AuthenticationError):
        chat(site, secret)

    # Deleting the user names its tokens in the confirmation; cancelling keeps it.
    page.tab("users")
    page.row(f"ana {tag}").locator(".admin-delete").click()
    page.page.wait_for_selector("#admin-confirm[open]")
    assert (
        "revokes every one of its tokens" in page.page.locator("#admin-confirm-text").text_content()
    )
    page.page.click("#admin-confirm-no")
    assert page.row(f"ana {tag}").count() == 1
    assert page.errors == []


@pytest.mark.parametrize("size", list(SIZES))
def test_the_console_fits_desktop_and_phone(console, sqlite_site, size):
    width, height = SIZES[size]
    page = console(sqlite_site)
    page.page.set_viewport_size({"width": width, "height": height})
    OUTPUT.mkdir(exist_ok=True)
    fits = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    # The token list with its form open, then each of the other tabs.
    page.tab("tokens")
    page.page.click("#admin-new")
    page.page.wait_for_selector("#admin-form")
    views = {
        "tokens": None,
        "webhooks": "#admin-webhook-form",
        "reconcile": "#admin-reconcile-form",
    }
    for name, ready in views.items():
        if ready:
            page.page.click(f"#admin .admin-tabs button[data-tab='{name}']")
            page.page.wait_for_selector(ready)
        assert page.page.evaluate(fits), name
        # Only the list tabs show the list's search and paging.
        assert page.page.locator("#admin-search").is_visible() == (name == "tokens")
        assert no_overlap(page.page) == [], name
        shot = OUTPUT / f"dashboard-admin-{name}-{size}.png"
        page.page.locator("#admin").screenshot(path=str(shot))


def test_webhooks_ingest_keys_adjustments_and_reconciliation_through_the_console(
    console, sqlite_site
):
    # The flow test covers both databases; these forms are the same on each.
    site = sqlite_site
    page = console(site)
    p = page.page

    def panel(name: str, ready: str) -> None:
        p.click(f"#admin .admin-tabs button[data-tab='{name}']")
        p.wait_for_selector(ready)

    # Webhooks: a refused URL named next to its field, then create, test, deliveries, delete.
    panel("webhooks", "#admin-webhook-form")
    p.fill("#admin-webhook-form [name=url]", "ftp://hooks.example.invalid/x")
    p.click("#admin-webhook-form button[type=submit]")
    p.wait_for_selector("#admin-webhook-form[data-state=error]")
    assert "url" in p.locator("#admin-webhook-form .admin-error[data-for=url]").text_content()
    url = f"https://hooks.example.invalid/{uuid.uuid4().hex[:8]}"
    p.fill("#admin-webhook-form [name=url]", url)
    p.click("#admin-webhook-form button[type=submit]")
    p.wait_for_selector("#admin-secret")
    hook = p.locator("#admin-webhooks tr", has_text=url)
    hook_id = hook.get_attribute("data-id")
    hook.locator(".admin-test").click()
    p.wait_for_selector("#admin-status:has-text('queued')")
    hook.locator(".admin-deliveries").click()
    p.wait_for_selector("#admin-deliveries tr:has-text('webhook.test')")
    hook.locator(".admin-delete").click()
    p.click("#admin-confirm-yes")
    p.wait_for_selector(f"#admin-webhooks tr[data-id='{hook_id}']", state="detached")
    assert hook_id not in {h["id"] for h in site.get("/v1/webhooks")["data"]}

    # An ingestion key: created (secret shown once), then revoked: its next use is a 401.
    panel("ingest keys", "#admin-ingest-form")
    name = f"importer-{uuid.uuid4().hex[:8]}"
    p.fill("#admin-ingest-form [name=name]", name)
    p.click("#admin-ingest-form button[type=submit]")
    p.wait_for_selector("#admin-secret")
    secret = p.locator("#admin-secret").text_content()
    assert secret.startswith("mik_")
    p.locator("#admin-ingest-keys tr", has_text=name).locator(".admin-delete").click()
    p.click("#admin-confirm-yes")
    p.wait_for_selector(f"#admin-ingest-keys tr:has-text('{name}')", state="detached")
    refused = site.http.post(
        "/v1/events", json={"events": []}, headers={"authorization": f"Bearer {secret}"}
    )
    assert refused.status_code == 401

    # An adjustment with its reason; a malformed amount named before any call.
    user = site.get("/v1/users")["data"][0]
    panel("adjustments", "#admin-adjust-form")
    p.fill("#admin-adjust-form [name=amount]", "five")
    p.fill("#admin-adjust-form [name=reason]", "outage credit")
    p.fill("#admin-adjust-form [name=user_id]", user["id"])
    p.click("#admin-adjust-form button[type=submit]")
    p.wait_for_selector("#admin-adjust-form[data-state=error]")
    assert "amount" in p.locator("#admin-adjust-form .admin-error[data-for=amount]").text_content()
    p.fill("#admin-adjust-form [name=amount]", "0.25")
    p.click("#admin-adjust-form button[type=submit]")
    p.wait_for_selector("#admin-adjust-form:not([data-state=sending])")
    assert p.locator("#admin-adjust-form").get_attribute("data-state") == "done", p.locator(
        "#admin-adjust-form"
    ).text_content()
    assert "0.25" in p.locator("#admin-adjust-out").text_content()
    assert user["id"] in p.locator("#admin-adjust-out").text_content()

    # A reconciliation upload and its result.
    day = site.get("/v1/spend", group_by="day,provider,model")["rows"][-1]["day"]
    csv = (
        "date,provider,model,prompt_tokens,completion_tokens,cost\n"
        f"{day},sim-openai,sim/unknown-model,10,10,0.01\n"
    )
    panel("reconcile", "#admin-reconcile-form")
    p.fill("#admin-reconcile-form [name=provider]", "sim-openai")
    p.set_input_files(
        "#admin-reconcile-form [name=file]",
        files=[{"name": "export.csv", "mimeType": "text/csv", "buffer": csv.encode()}],
    )
    p.click("#admin-reconcile-form button[type=submit]")
    p.wait_for_selector("#admin-reconcile-summary")
    assert "missing in the ledger" in p.locator("#admin-reconcile-summary").text_content()
    assert p.locator("#admin-reconcile-rows tr[data-status=missing_in_ledger]").count() == 1
    assert page.errors == []

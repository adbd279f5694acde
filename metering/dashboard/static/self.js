"use strict";
// Self-service: a user signs in with their email and password (POST /v1/auth/login) and, in
// "My tokens", lists, creates (up to the API's 10 active tokens), revokes and tightens their own
// API tokens and sees their own spend. It appears only for a user's credential; the admin key
// gets the Manage console (admin.js) instead.
//
// The session: the access token is the key app.js holds (memory and this tab's sessionStorage,
// never a cookie); the refresh token and the access token's expiry are kept here, in the same
// sessionStorage. Every same-origin call the page makes with that access token goes through
// fetch below: shortly before the access token expires, or when the API answers 401 to it, one
// POST /v1/auth/refresh (never two at once: a refresh token is spent by its first use, and
// presenting it again ends the session) replaces the pair, and the call is sent again with the
// new token. Signing out ends the session on the server (POST /v1/auth/logout).

(() => {
  const SESSION_STORE = "metering.session";
  const KEY_STORE = "metering.key"; // app.js's
  const CAP = 10; // active tokens per user (the API's 409 token_limit_reached beyond)
  const EARLY_MS = 60_000; // refresh this long before the access token expires
  const plainFetch = window.fetch.bind(window);
  const kit = () => window.AdminKit;

  // --- the session ---------------------------------------------------------------------------

  const session = { access: null, refresh: null, expiresAt: 0, renewing: null, timer: null };

  function keep(pair) {
    session.access = pair.access_token;
    session.refresh = pair.refresh_token;
    session.expiresAt = Date.now() + Number(pair.expires_in) * 1000;
    sessionStorage.setItem(SESSION_STORE, JSON.stringify({
      access: session.access, refresh: session.refresh, expiresAt: session.expiresAt,
    }));
    clearTimeout(session.timer);
    const wait = Math.max(5_000, session.expiresAt - EARLY_MS - Date.now());
    session.timer = setTimeout(() => renew(session.access).catch(() => {}), wait);
  }

  function forget() {
    clearTimeout(session.timer);
    Object.assign(session, { access: null, refresh: null, expiresAt: 0, renewing: null, timer: null });
    sessionStorage.removeItem(SESSION_STORE);
  }

  function restore() {
    try {
      const saved = JSON.parse(sessionStorage.getItem(SESSION_STORE) ?? "null");
      // Only the session of the key app.js holds: a key pasted since replaced it.
      if (saved && saved.refresh && saved.access === sessionStorage.getItem(KEY_STORE)) {
        keep({ access_token: saved.access, refresh_token: saved.refresh, expires_in: (saved.expiresAt - Date.now()) / 1000 });
        return;
      }
    } catch {
      // unreadable: no session
    }
    forget();
  }

  /** A new pair for the one whose access token was `used`; whether the page has a live one. */
  async function renew(used) {
    if (used !== session.access) return session.access !== null; // renewed meanwhile
    if (!session.renewing) {
      session.renewing = (async () => {
        const response = await plainFetch("/v1/auth/refresh", {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ refresh_token: session.refresh }),
          cache: "no-store",
          credentials: "omit",
        });
        if (!response.ok) {
          forget(); // the page's next call is refused and app.js returns to the sign-in form
          return false;
        }
        keep(await response.json());
        // The page's key, unless another key was pasted since.
        if (typeof state !== "undefined" && state.key === used) {
          state.key = session.access;
          sessionStorage.setItem(KEY_STORE, session.access);
        }
        return true;
      })().finally(() => {
        session.renewing = null;
      });
    }
    return session.renewing;
  }

  /** fetch, with the session's access token kept fresh for the page's own calls to the API. */
  window.fetch = async (resource, init = {}) => {
    const headers = new Headers(init.headers);
    const used = (headers.get("authorization") || "").replace(/^Bearer /, "");
    const own = typeof resource === "string" && resource.startsWith("/") && !resource.startsWith("/v1/auth/");
    if (!own || !session.refresh || used !== session.access) return plainFetch(resource, init);
    const send = () => {
      headers.set("authorization", `Bearer ${session.access}`);
      return plainFetch(resource, { ...init, headers });
    };
    if (Date.now() >= session.expiresAt - EARLY_MS) await renew(session.access).catch(() => false);
    const sent = session.access;
    if (sent === null) return plainFetch(resource, init);
    const response = await send();
    if (response.status !== 401) return response;
    const renewed = await renew(sent).catch(() => false);
    return renewed ? send() : response;
  };

  async function logout() {
    const refresh = session.refresh;
    forget();
    if (!refresh) return;
    try {
      await plainFetch("/v1/auth/logout", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ refresh_token: refresh }),
        cache: "no-store",
        credentials: "omit",
      });
    } catch {
      // the session still ends when its refresh token expires
    }
  }

  // --- signing in with a password ------------------------------------------------------------

  async function passwordSignIn(event) {
    event.preventDefault();
    const form = event.target;
    const message = form.querySelector("#password-message");
    const email = form.elements.email.value.trim();
    const password = form.elements.password.value;
    if (!email || !password) {
      message.textContent = "enter your email and your password";
      return;
    }
    form.dataset.state = "sending";
    message.textContent = "";
    try {
      const response = await plainFetch("/v1/auth/login", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ email, password }),
        cache: "no-store",
        credentials: "omit",
      });
      let data = null;
      try {
        data = await response.json();
      } catch {
        data = null;
      }
      if (!response.ok) {
        const reason = (data && data.error && data.error.message) || response.statusText;
        message.textContent = `Not signed in: ${reason}`;
        form.dataset.state = "error";
        return;
      }
      form.elements.password.value = "";
      form.dataset.state = "done";
      keep(data);
      signIn(data.access_token); // app.js: keeps it as the page's key and loads the page
    } catch (error) {
      message.textContent = `Not signed in: ${error.message}`;
      form.dataset.state = "error";
    }
  }

  // --- My tokens -----------------------------------------------------------------------------

  const view = { root: null, me: null, user: null, tokens: [], loading: null };
  const TIGHTEN = ["credit_limit", "rpm_limit", "tpm_limit", "max_parallel_requests", "allowed_models", "expires_at"];

  function fieldsFor(names) {
    const all = [...kit().LIMITS, { name: "expires_at", label: "expires (RFC 3339, empty: never)", kind: "time" }];
    return names.map((name) => all.find((f) => f.name === name));
  }

  const $ = (selector) => view.root.querySelector(selector);

  function note(message, bad) {
    const line = $("#self-status");
    line.textContent = message;
    line.className = bad ? "caption bad" : "caption";
  }

  function limitsText(t) {
    const resets = t.reset_interval === "never" ? "never resets" : `resets ${t.reset_interval}`;
    const parts = [t.credit_limit === null ? "no credit limit" : `${Money.format(Money.parse(t.credit_limit))}, ${resets}`];
    if (t.rpm_limit !== null) parts.push(`${t.rpm_limit} requests/min`);
    if (t.tpm_limit !== null) parts.push(`${t.tpm_limit} tokens/min`);
    if (t.max_parallel_requests !== null) parts.push(`${t.max_parallel_requests} in parallel`);
    if (t.allowed_models !== null) parts.push(`models: ${t.allowed_models.join(", ") || "(none)"}`);
    return parts.join(" · ");
  }

  function spentText(budget) {
    if (!budget) return "";
    const spent = Money.format(Money.parse(budget.spent));
    if (budget.credit_limit === null) return `${spent} (no limit)`;
    return `${spent} of ${Money.format(Money.parse(budget.credit_limit))}`;
  }

  async function load() {
    const { send } = kit();
    view.me ??= await send("GET", "/v1/me");
    const id = encodeURIComponent(view.me.user_id);
    const [user, budget, tokens] = await Promise.all([
      send("GET", `/v1/users/${id}`),
      send("GET", `/v1/users/${id}/budget`),
      send("GET", `/v1/users/${id}/tokens`),
    ]);
    const budgets = await Promise.all(
      tokens.data.map((t) => send("GET", `/v1/tokens/${encodeURIComponent(t.id)}/budget`)),
    );
    view.user = user;
    view.tokens = tokens.data.map((t, i) => ({ ...t, budget: budgets[i] }));
    draw(budget);
    view.root.dataset.state = "ready";
  }

  function reload() {
    view.root.dataset.state = "loading";
    view.loading = load().catch((e) => {
      view.root.dataset.state = "error";
      note(e.message, true);
    });
    return view.loading;
  }

  function draw(budget) {
    const { el } = kit();
    const how = view.me.kind === "access" ? "with your password" : "with one of your API tokens";
    $("#self-who").textContent = `Signed in as ${view.user.email} (${view.user.name}) ${how}. ` +
      `You may create up to ${CAP} active tokens, revoke yours, and tighten their limits; ` +
      "raising a limit, your own budget, and other users and teams are for an administrator.";
    const resets = budget.resets_at ? `, resets ${fmtTime(budget.resets_at)}` : "";
    $("#self-spend").textContent = budget.credit_limit === null
      ? `Your spend this window: ${Money.format(Money.parse(budget.spent))} (no limit on your user)`
      : `Your spend this window: ${spentText(budget)} (${budget.reset_interval}${resets})`;
    const active = view.tokens.length;
    $("#self-count").textContent = `${active} of ${CAP} active tokens` +
      (active >= CAP ? ": revoke one to create another" : "");
    $("#self-rows").replaceChildren(...view.tokens.map((t) => {
      const tighten = el("button", { type: "button", class: "self-tighten", text: "tighten" });
      const revoke = el("button", { type: "button", class: "self-revoke", text: "revoke" });
      tighten.addEventListener("click", () => openTighten(t));
      revoke.addEventListener("click", () => confirmRevoke(t));
      const mine = view.me.token_id === t.id ? " (this sign-in)" : "";
      return el("tr", { "data-id": t.id },
        el("td", { class: "self-name", text: `${t.name}${mine}` }),
        el("td", { class: "self-prefix", "data-label": "prefix", text: `${t.prefix}…` }),
        el("td", { class: "self-limits", "data-label": "limits", text: limitsText(t) }),
        el("td", { class: "self-spent", "data-label": "spent this window", "data-spent": t.budget.spent, text: spentText(t.budget) }),
        el("td", { class: "self-expires", "data-label": "expires", text: t.expires_at ? fmtTime(t.expires_at) : "never" }),
        el("td", { class: "self-actions" }, tighten, revoke));
    }));
    $("#self-table").dataset.rows = String(active);
    $("#self-empty").hidden = active > 0;
  }

  /** A form in the form area; submit runs action(form), the API's errors next to the fields. */
  function openForm(id, title, fields, values, submit, action) {
    const { el, field } = kit();
    const area = $("#self-form-area");
    const form = el("form", { id, class: "self-form", novalidate: true },
      el("h3", { text: title }),
      el("div", { class: "self-grid" }, ...fields.map((f) => field(f, values[f.name]))),
      el("p", { class: "admin-form-error bad" }),
      el("div", { class: "self-buttons" },
        el("button", { type: "submit", text: submit }),
        el("button", { type: "button", class: "self-cancel", text: "cancel" })));
    form.querySelector(".self-cancel").addEventListener("click", () => area.replaceChildren());
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      form.dataset.state = "sending";
      try {
        await action(form);
      } catch (error) {
        form.dataset.state = "error";
        kit().showErrors(form, { [error.param || "_"]: error.message });
      }
    });
    area.replaceChildren(form);
    form.querySelector("input, select").focus();
  }

  function checked(form, fields, editing) {
    const { body, errors } = kit().collect(form, fields, editing);
    if (kit().showErrors(form, errors)) {
      const [param, message] = Object.entries(errors)[0];
      throw Object.assign(new Error(message), { param });
    }
    return body;
  }

  function openCreate() {
    const fields = [{ name: "name", label: "name", kind: "text", required: true }, ...fieldsFor(["expires_at", ...kit().LIMITS.map((f) => f.name)])];
    openForm("self-form", "New token", fields, {}, "create", async (form) => {
      const body = checked(form, fields, false);
      const made = await kit().send("POST", `/v1/users/${encodeURIComponent(view.me.user_id)}/tokens`, body);
      $("#self-form-area").replaceChildren(secretBox(made));
      note(`token ${made.name} created`);
      await reload();
    });
  }

  /** Only what changed is sent; the API refuses a loosening with its own message. */
  function openTighten(token) {
    const fields = fieldsFor(TIGHTEN);
    const shown = (v) => (v === null || v === undefined ? "" : Array.isArray(v) ? v.join(", ") : String(v));
    openForm("self-tighten-form", `Tighten ${token.name} (${token.prefix}…)`, fields, token, "save", async (form) => {
      const body = checked(form, fields, true);
      for (const f of fields) {
        if (shown(body[f.name]) === shown(token[f.name])) delete body[f.name];
      }
      // The API lets a token's own user set its credit limit freely (they may make another
      // token with any limit); this form only tightens, like the API does for the other limits.
      if ("credit_limit" in body && token.credit_limit !== null &&
          (body.credit_limit === null || Money.parse(body.credit_limit) > Money.parse(token.credit_limit))) {
        throw Object.assign(new Error(`credit_limit: this form only lowers a limit (now ${token.credit_limit}); an administrator may raise it`), { param: "credit_limit" });
      }
      if (!Object.keys(body).length) throw new Error("nothing changed");
      await kit().send("PATCH", `/v1/tokens/${encodeURIComponent(token.id)}`, body);
      $("#self-form-area").replaceChildren();
      note(`token ${token.name} tightened`);
      await reload();
    });
  }

  function confirmRevoke(token) {
    const dialog = $("#self-confirm");
    const self = view.me.token_id === token.id ? " This page is signed in with it: you will be signed out." : "";
    $("#self-confirm-text").textContent =
      `Revoke token ${token.name} (${token.prefix}…)? Its next request is refused (401) at once, on every replica, and it cannot be used again.${self}`;
    const yes = $("#self-confirm-yes");
    $("#self-confirm-no").onclick = () => dialog.close();
    yes.onclick = async () => {
      dialog.close();
      try {
        await kit().send("DELETE", `/v1/tokens/${encodeURIComponent(token.id)}`);
        note(`token ${token.name} revoked`);
        await reload();
      } catch (error) {
        note(error.message, true);
      }
    };
    dialog.showModal();
  }

  function secretBox(token) {
    const { el } = kit();
    const code = el("code", { id: "self-secret", class: "self-secret", text: token.token });
    const copy = el("button", { type: "button", id: "self-copy", text: "copy" });
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(token.token);
        copy.textContent = "copied";
      } catch {
        const range = document.createRange();
        range.selectNodeContents(code);
        window.getSelection().removeAllRanges();
        window.getSelection().addRange(range);
        copy.textContent = "selected: press Ctrl+C";
      }
    });
    const done = el("button", { type: "button", id: "self-done", text: "done" });
    const box = el("div", { class: "self-secret-box", role: "status" },
      el("p", { text: `The secret of token ${token.name}: shown this once, never again. Use it as the API key (base_url ${location.origin}/v1).` }),
      code, copy, done);
    done.addEventListener("click", () => box.remove()); // gone from the page: the API never shows it again
    return box;
  }

  function build(root) {
    const { el } = kit();
    const add = el("button", { type: "button", id: "self-new", text: "new token" });
    add.addEventListener("click", openCreate);
    const head = (...names) => el("thead", {}, el("tr", {}, ...names.map((n) => el("th", { text: n }))));
    root.replaceChildren(
      el("h2", { text: "My tokens" }),
      el("p", { id: "self-who", class: "caption" }),
      el("p", { id: "self-spend" }),
      el("div", { class: "self-bar" }, add, el("span", { id: "self-count", class: "caption" })),
      el("p", { id: "self-status", class: "caption" }),
      el("div", { id: "self-form-area" }),
      el("div", { class: "table-wrap" }, el("table", { id: "self-table", "data-rows": "0" },
        head("name", "prefix", "limits", "spent this window", "expires", ""),
        el("tbody", { id: "self-rows" }))),
      el("p", { id: "self-empty", class: "caption", text: "no active token: create one to call the API", hidden: true }),
      el("dialog", { id: "self-confirm" },
        el("p", { id: "self-confirm-text" }),
        el("div", { class: "self-buttons" },
          el("button", { type: "button", id: "self-confirm-yes", text: "yes, revoke it" }),
          el("button", { type: "button", id: "self-confirm-no", text: "cancel" }))),
    );
  }

  /** Follows app.js: shown for a user's credential once the page is ready, gone otherwise. */
  function sync() {
    const root = document.getElementById("self");
    const pageState = document.body.dataset.state;
    if (pageState === "signed-out" && session.refresh) logout();
    const user = typeof state !== "undefined" && state.key && state.who && state.who.mode === "user";
    if (!user) {
      if (pageState === "loading" || pageState === "changing") return; // a refresh, not a sign-out
      root.hidden = true;
      root.replaceChildren();
      view.root = null;
      view.me = null;
      return;
    }
    if (pageState !== "ready") return;
    if (!view.root) {
      view.root = root;
      build(root);
      root.hidden = false;
    }
    reload(); // after each refresh of the page: the spend and the tokens as they are now
  }

  // Before app.js's start (on DOMContentLoaded) signs in again with a kept key: its first
  // calls already go through the session.
  restore();
  document.addEventListener("DOMContentLoaded", () => {
    const password = document.getElementById("password-login");
    const login = document.getElementById("login");
    password.addEventListener("submit", passwordSignIn);
    // The password form is shown with app.js's key form, and hidden with it.
    const mirror = () => (password.hidden = login.hidden);
    new MutationObserver(mirror).observe(login, { attributes: true, attributeFilter: ["hidden"] });
    mirror();
    new MutationObserver(sync).observe(document.body, { attributes: true, attributeFilter: ["data-state"] });
  });
})();

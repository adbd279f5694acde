"use strict";
// The admin console ("Manage"): teams, users and tokens listed, searched, created, edited,
// revoked and deleted through the same API a script uses. It appears only when the page is
// signed in with the admin key. It reads the key app.js holds (in memory and this tab's
// sessionStorage, never a cookie) and sends it as a bearer header on every call. Everything
// from the API is shown with textContent: a hostile name is only ever text.

(() => {
  const PAGE = 50;
  const SEARCH_WAIT_MS = 250; // the server is asked once typing has paused this long
  const MAX_SEARCH = 200; // the API's bound of q
  // This console's parameters in the page's URL (app.js keeps them when it writes its own).
  const URL_SEARCH = "q";
  const URL_TAB = "manage";
  const INTERVALS = ["never", "hourly", "daily", "weekly", "monthly", "1h", "1d", "7d", "30d"];
  const USD = /^(0|[1-9][0-9]{0,11})(\.[0-9]{1,12})?$/;
  const WHOLE = /^(0|[1-9][0-9]{0,11})$/;

  const el = (tag, attrs, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else if (k in node && typeof v !== "string") node[k] = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) if (child) node.append(child);
    return node;
  };

  class ApiFailure extends Error {
    constructor(status, message, param) {
      super(message);
      this.status = status;
      this.param = param;
    }
  }

  /** A call with the admin key in the Authorization header; JSON in, JSON (or nothing) out. */
  async function send(method, path, body, contentType) {
    const headers = { authorization: `Bearer ${state.key}` };
    if (body !== undefined) headers["content-type"] = contentType || "application/json";
    const response = await fetch(path, {
      method,
      headers,
      cache: "no-store",
      credentials: "omit",
      body: body === undefined || contentType ? body : JSON.stringify(body),
    });
    if (response.status === 204) return null;
    let data = null;
    try {
      data = await response.json();
    } catch {
      data = null;
    }
    if (!response.ok) {
      const error = (data && data.error) || {};
      throw new ApiFailure(response.status, error.message || response.statusText, error.param);
    }
    return data;
  }

  // The other modules of the console (admin-ops.js) use these and add their own tabs.
  const kit = window.AdminKit || (window.AdminKit = { panels: [] });
  Object.assign(kit, { el, send, ApiFailure, showErrors, note: (m, bad) => note(m, bad), confirmThen: (m, a) => confirmThen(m, a) });
  kit.teams = () => view.teams;

  // --- the fields each kind of thing takes (what the API's bodies take) ----------------------

  const LIMITS = [
    { name: "credit_limit", label: "credit limit (USD)", kind: "usd" },
    { name: "reset_interval", label: "resets", kind: "interval" },
    { name: "alert_thresholds", label: "alert at (% list)", kind: "percents" },
    { name: "soft_limit", label: "soft limit (USD)", kind: "usd" },
    { name: "rpm_limit", label: "requests / min", kind: "whole" },
    { name: "tpm_limit", label: "tokens / min", kind: "whole" },
    { name: "max_parallel_requests", label: "parallel requests", kind: "whole" },
    { name: "allowed_models", label: "allowed models (comma list)", kind: "list" },
  ];
  const KINDS = {
    teams: {
      title: "team",
      searched: "name or id",
      list: () => "/v1/teams",
      path: (id) => `/v1/teams/${encodeURIComponent(id)}`,
      fields: [
        { name: "name", label: "name", kind: "text", required: true },
        ...LIMITS,
        { name: "end_user_credit_limit", label: "end user limit (USD)", kind: "usd" },
        { name: "end_user_reset_interval", label: "end user resets", kind: "interval" },
      ],
      gone: "Deleting a team refuses, at once, every token of its users and its ingestion keys (401).",
    },
    users: {
      title: "user",
      searched: "name, email or id",
      list: () => "/v1/users",
      path: (id) => `/v1/users/${encodeURIComponent(id)}`,
      fields: [
        { name: "name", label: "name", kind: "text", required: true },
        { name: "email", label: "email", kind: "email", required: true },
        { name: "team_id", label: "team", kind: "team", required: true },
        { name: "password", label: "password (optional)", kind: "password", secret: true },
        ...LIMITS,
      ],
      gone: "Deleting a user revokes every one of its tokens.",
    },
    tokens: {
      title: "token",
      searched: "name, prefix or id",
      list: (user) => `/v1/users/${encodeURIComponent(user)}/tokens`,
      path: (id) => `/v1/tokens/${encodeURIComponent(id)}`,
      fields: [
        { name: "name", label: "name", kind: "text", required: true },
        ...LIMITS,
        { name: "expires_at", label: "expires (RFC 3339, empty: never)", kind: "time" },
      ],
      gone: "Revoking a token refuses its next request at once, on every replica.",
    },
  };

  // The self-service panel (self.js) builds its token forms from the same fields and checks.
  Object.assign(kit, { field: input, collect, LIMITS });

  const view = {
    root: null,
    tab: "teams",
    search: "", // the q of every list call: the server searches, then pages the matches
    after: [], // the cursors of the pages before this one
    loads: 0, // how many loads began: only the latest one draws
    rows: [],
    user: "", // the user whose tokens are listed
    teams: [],
    users: [],
  };

  // --- forms --------------------------------------------------------------------------------

  function input(field, value) {
    const id = `admin-f-${field.name}`;
    let control;
    if (field.kind === "interval") {
      control = el("select", { id, name: field.name });
      const options = [...INTERVALS];
      if (value && !options.includes(value)) options.push(value);
      if (field.optional) options.unshift("");
      for (const v of options) control.append(el("option", { value: v, text: v || "(unchanged)" }));
      control.value = value || (field.optional ? "" : "never");
    } else if (field.kind === "team") {
      control = el("select", { id, name: field.name });
      for (const t of view.teams) control.append(el("option", { value: t.id, text: `${t.name} (${t.id})` }));
      if (value) control.value = value;
    } else {
      const type = field.kind === "password" ? "password" : field.kind === "email" ? "email" : "text";
      control = el("input", { id, name: field.name, type, autocomplete: "off", spellcheck: "false" });
      control.value = value === null || value === undefined ? "" : Array.isArray(value) ? value.join(", ") : String(value);
    }
    const error = el("span", { class: "admin-error bad", id: `${id}-error`, "data-for": field.name });
    return el("label", { class: "admin-field", "data-field": field.name }, el("span", { text: field.label }), control, error);
  }

  /** The body of a form, or {errors} as the API would name them. */
  function collect(form, fields, editing) {
    const body = {};
    const errors = {};
    for (const field of fields) {
      const raw = form.elements[field.name].value.trim();
      if (raw === "") {
        if (field.required) errors[field.name] = `${field.name}: a value is required`;
        else if (field.secret || field.kind === "interval" || field.kind === "team") continue;
        else if (field.kind === "percents") {
          if (editing) body[field.name] = null;
        } else if (editing || field.kind !== "text") body[field.name] = null;
        continue;
      }
      if (field.kind === "usd") {
        if (!USD.test(raw)) errors[field.name] = `${field.name}: a decimal USD amount such as 12.50`;
        else body[field.name] = raw; // a string: money is never a float
      } else if (field.kind === "whole") {
        if (!WHOLE.test(raw)) errors[field.name] = `${field.name}: a whole number`;
        else body[field.name] = Number(raw);
      } else if (field.kind === "percents") {
        const parts = raw.split(",").map((s) => s.trim()).filter(Boolean);
        if (!parts.every((p) => /^[0-9]{1,3}$/.test(p))) errors[field.name] = `${field.name}: whole percentages, comma separated`;
        else body[field.name] = parts.map(Number);
      } else if (field.kind === "list") {
        body[field.name] = raw.split(",").map((s) => s.trim()).filter(Boolean);
      } else {
        body[field.name] = raw;
      }
    }
    return { body, errors };
  }

  function showErrors(form, errors) {
    form.querySelectorAll(".admin-error").forEach((span) => (span.textContent = ""));
    let shown = false;
    for (const [param, message] of Object.entries(errors)) {
      const name = String(param).split(/[.[]/)[0];
      const span = form.querySelector(`.admin-error[data-for="${CSS.escape(name)}"]`);
      if (span) {
        span.textContent = message;
        shown = true;
      } else {
        form.querySelector(".admin-form-error").textContent = message;
        shown = true;
      }
    }
    return shown;
  }

  function openForm(kind, row) {
    const spec = KINDS[kind];
    const editing = Boolean(row);
    const area = view.root.querySelector("#admin-form-area");
    area.replaceChildren();
    const fields = spec.fields.map((f) => (editing && f.kind === "interval" ? { ...f, optional: true } : f));
    const form = el("form", { id: "admin-form", class: "admin-form", novalidate: true, "data-kind": kind, "data-mode": editing ? "edit" : "create" });
    form.append(el("h3", { text: editing ? `Edit ${spec.title} ${row.name}` : `New ${spec.title}` }));
    const grid = el("div", { class: "admin-grid" });
    for (const field of fields) {
      if (editing && field.kind === "team") continue;
      grid.append(input(field, row ? row[field.name] : null));
    }
    form.append(grid);
    form.append(el("p", { class: "admin-form-error bad" }));
    const buttons = el("div", { class: "admin-buttons" },
      el("button", { type: "submit", text: editing ? "save" : "create" }),
      el("button", { type: "button", class: "admin-cancel", text: "cancel" }));
    form.append(buttons);
    buttons.querySelector(".admin-cancel").addEventListener("click", () => area.replaceChildren());
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const shown = fields.filter((f) => !(editing && f.kind === "team"));
      const { body, errors } = collect(form, shown, editing);
      if (showErrors(form, errors)) return;
      form.dataset.state = "sending";
      try {
        let saved;
        if (editing) saved = await send("PATCH", spec.path(row.id), body);
        else if (kind === "tokens") saved = await send("POST", spec.list(view.user), body);
        else saved = await send("POST", spec.list(), body);
        area.replaceChildren();
        if (saved && saved.token) showSecret(saved);
        note(`${spec.title} ${saved.name} ${editing ? "saved" : "created"}`);
        await load();
      } catch (error) {
        form.dataset.state = "error";
        if (error instanceof ApiFailure) showErrors(form, { [error.param || "_"]: error.message });
        else throw error;
      }
    });
    area.append(form);
    form.querySelector("input, select").focus();
  }

  function showSecret(token) {
    const area = view.root.querySelector("#admin-form-area");
    const secret = el("code", { id: "admin-secret", class: "admin-secret", text: token.token });
    const copy = el("button", { type: "button", id: "admin-copy", text: "copy" });
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(token.token);
        copy.textContent = "copied";
      } catch {
        const range = document.createRange();
        range.selectNodeContents(secret);
        const selection = window.getSelection();
        selection.removeAllRanges();
        selection.addRange(range);
        copy.textContent = "selected: press Ctrl+C";
      }
    });
    const done = el("button", { type: "button", text: "done" });
    const box = el("div", { class: "admin-secret-box", role: "status" },
      el("p", { text: `The secret of token ${token.name}: shown this once, never again.` }),
      secret, copy, done);
    // Once dismissed the secret is gone from the page (the API never returns it again).
    done.addEventListener("click", () => box.remove());
    area.append(box);
  }

  // --- confirmation -------------------------------------------------------------------------

  function confirmThen(message, action) {
    const dialog = view.root.querySelector("#admin-confirm");
    dialog.querySelector("#admin-confirm-text").textContent = message;
    const yes = dialog.querySelector("#admin-confirm-yes");
    const no = dialog.querySelector("#admin-confirm-no");
    const close = () => {
      yes.onclick = null;
      dialog.close();
    };
    no.onclick = close;
    yes.onclick = async () => {
      close();
      try {
        await action();
      } catch (error) {
        note(error.message, true);
      }
    };
    dialog.showModal();
  }

  async function remove(kind, row) {
    const spec = KINDS[kind];
    let message = `${kind === "tokens" ? "Revoke" : "Delete"} ${spec.title} ${row.name} (${row.id})? ${spec.gone}`;
    if (kind === "users") {
      const tokens = await send("GET", `${KINDS.tokens.list(row.id)}?limit=1000`);
      message += ` It has ${tokens.data.length} active token${tokens.data.length === 1 ? "" : "s"}.`;
    } else if (kind === "teams") {
      const users = await send("GET", `/v1/users?${new URLSearchParams({ team_id: row.id, limit: 1000 })}`);
      message += ` It has ${users.data.length} user${users.data.length === 1 ? "" : "s"}.`;
    }
    confirmThen(message, async () => {
      await send("DELETE", spec.path(row.id));
      note(`${spec.title} ${row.name} ${kind === "tokens" ? "revoked" : "deleted"}`);
      await load();
    });
  }

  // --- the list -----------------------------------------------------------------------------

  function note(message, bad) {
    const status = view.root.querySelector("#admin-status");
    status.textContent = message;
    status.className = bad ? "caption bad" : "caption";
  }

  function limitText(row) {
    if (row.credit_limit === null || row.credit_limit === undefined) return "no limit";
    return `$${row.credit_limit} ${row.reset_interval}`;
  }

  function draw() {
    const body = view.root.querySelector("#admin-rows");
    body.replaceChildren();
    const rows = view.rows;
    for (const row of rows) {
      const edit = el("button", { type: "button", class: "admin-edit", text: "edit" });
      const drop = el("button", { type: "button", class: "admin-delete", text: view.tab === "tokens" ? "revoke" : "delete" });
      edit.addEventListener("click", () => openForm(view.tab, row));
      drop.addEventListener("click", () => remove(view.tab, row).catch((e) => note(e.message, true)));
      const detail = view.tab === "users" ? row.email : view.tab === "tokens" ? row.prefix || "" : "";
      body.append(el("tr", { "data-id": row.id },
        el("td", { class: "admin-name", text: row.name }),
        el("td", { class: "admin-id", text: detail ? `${detail} · ${row.id}` : row.id }),
        el("td", { text: limitText(row) }),
        el("td", { class: "admin-actions" }, edit, drop)));
    }
    if (!rows.length && view.search) {
      body.append(el("tr", { class: "admin-empty" },
        el("td", { colspan: "4", text: `no ${KINDS[view.tab].title} matches “${view.search}”` })));
    }
    const table = view.root.querySelector("#admin-table");
    table.dataset.rows = String(rows.length);
    table.dataset.q = view.search; // the search these rows answer
    view.root.querySelector("#admin-prev").disabled = view.after.length === 0;
    view.root.querySelector("#admin-next").disabled = view.rows.length < PAGE;
  }

  function listShown(shown) {
    view.root.querySelector("#admin-bar").hidden = !shown;
    view.root.querySelector("#admin-list").hidden = !shown;
    view.root.querySelector("#admin-panel").hidden = shown;
  }

  /** A tab of admin-ops.js: it draws itself into #admin-panel. */
  async function openPanel(panel) {
    view.root.querySelector("#admin-form-area").replaceChildren();
    listShown(false);
    view.teams = (await send("GET", "/v1/teams?limit=1000")).data;
    const area = view.root.querySelector("#admin-panel");
    area.replaceChildren();
    await panel.render(area);
    view.root.dataset.tab = panel.name;
    view.root.dataset.state = "ready";
  }

  /** The tab and the search in the page's URL, so that a reload or a shared link shows them. */
  function writeUrl() {
    const params = new URLSearchParams(location.search);
    if (view.search) params.set(URL_SEARCH, view.search);
    else params.delete(URL_SEARCH);
    if (view.tab !== "teams" && KINDS[view.tab]) params.set(URL_TAB, view.tab);
    else params.delete(URL_TAB);
    const search = params.toString();
    history.replaceState(null, "", `${location.pathname}${search ? "?" + search : ""}`);
  }

  function readUrl() {
    const params = new URLSearchParams(location.search);
    const tab = params.get(URL_TAB);
    if (tab && Object.hasOwn(KINDS, tab)) view.tab = tab;
    view.search = clean(params.get(URL_SEARCH) || "");
  }

  /** Search text as the API takes it: no control characters, at most MAX_SEARCH of them. */
  function clean(text) {
    return text.replace(/[\u0000-\u001f\u007f]/g, " ").trim().slice(0, MAX_SEARCH);
  }

  async function load() {
    const spec = KINDS[view.tab];
    if (!spec) return openPanel(kit.panels.find((p) => p.name === view.tab));
    const mine = ++view.loads;
    listShown(true);
    view.root.querySelector("#admin-search").placeholder = `search by ${spec.searched}`;
    const teams = (await send("GET", "/v1/teams?limit=1000")).data;
    const cursor = view.after.length ? view.after[view.after.length - 1] : null;
    const params = new URLSearchParams({ limit: String(PAGE) });
    if (cursor) params.set("after", cursor);
    if (view.search) params.set("q", view.search);
    const picker = view.root.querySelector("#admin-user");
    picker.hidden = view.tab !== "tokens";
    let rows;
    if (view.tab === "tokens") {
      view.users = (await send("GET", "/v1/users?limit=1000")).data;
      picker.replaceChildren(...view.users.map((u) => el("option", { value: u.id, text: `${u.name} (${u.email})` })));
      if (!view.users.some((u) => u.id === view.user)) view.user = view.users.length ? view.users[0].id : "";
      picker.value = view.user;
      rows = view.user ? (await send("GET", `${spec.list(view.user)}?${params}`)).data : [];
    } else {
      rows = (await send("GET", `${spec.list()}?${params}`)).data;
    }
    if (mine !== view.loads) return; // a later search or page asked since: it draws
    view.teams = teams;
    view.rows = rows;
    view.root.querySelector("#admin-new").disabled = view.tab === "tokens" && !view.user;
    view.root.dataset.tab = view.tab;
    draw();
    view.root.dataset.state = "ready";
  }

  function build(root) {
    const tabs = el("nav", { class: "admin-tabs", "aria-label": "manage" });
    for (const kind of Object.keys(KINDS)) {
      const button = el("button", { type: "button", "data-tab": kind, text: kind });
      button.addEventListener("click", () => {
        view.tab = kind;
        view.after = [];
        writeUrl();
        view.root.querySelector("#admin-form-area").replaceChildren();
        tabs.querySelectorAll("button").forEach((b) => b.setAttribute("aria-pressed", String(b === button)));
        load().catch((e) => note(e.message, true));
      });
      tabs.append(button);
    }
    for (const panel of kit.panels) {
      const button = el("button", { type: "button", "data-tab": panel.name, text: panel.name });
      button.addEventListener("click", () => {
        view.tab = panel.name;
        writeUrl();
        tabs.querySelectorAll("button").forEach((b) => b.setAttribute("aria-pressed", String(b === button)));
        openPanel(panel).catch((e) => note(e.message, true));
      });
      tabs.append(button);
    }
    const search = el("input", {
      id: "admin-search", type: "search", placeholder: "search", "aria-label": "search", maxlength: String(MAX_SEARCH),
    });
    search.value = view.search;
    // The server searches every row, not only the page shown: asked once typing pauses, from
    // the first page of the matches.
    let typing = null;
    search.addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => {
        const text = clean(search.value);
        if (text === view.search) return;
        view.search = text;
        view.after = [];
        writeUrl();
        load().catch((e) => note(e.message, true));
      }, SEARCH_WAIT_MS);
    });
    const user = el("select", { id: "admin-user", "aria-label": "user", hidden: true });
    user.addEventListener("change", () => {
      view.user = user.value;
      view.after = [];
      load().catch((e) => note(e.message, true));
    });
    const add = el("button", { type: "button", id: "admin-new", text: "new" });
    add.addEventListener("click", () => openForm(view.tab, null));
    const prev = el("button", { type: "button", id: "admin-prev", text: "previous page" });
    const next = el("button", { type: "button", id: "admin-next", text: "next page" });
    prev.addEventListener("click", () => {
      view.after.pop();
      load().catch((e) => note(e.message, true));
    });
    next.addEventListener("click", () => {
      view.after.push(view.rows[view.rows.length - 1].id);
      load().catch((e) => note(e.message, true));
    });
    const table = el("table", { id: "admin-table", "data-rows": "0" },
      el("thead", {}, el("tr", {}, el("th", { text: "name" }), el("th", { text: "id" }), el("th", { text: "budget" }), el("th", { text: "" }))),
      el("tbody", { id: "admin-rows" }));
    const dialog = el("dialog", { id: "admin-confirm" },
      el("p", { id: "admin-confirm-text" }),
      el("div", { class: "admin-buttons" },
        el("button", { type: "button", id: "admin-confirm-yes", text: "yes, go ahead" }),
        el("button", { type: "button", id: "admin-confirm-no", text: "cancel" })));
    root.append(
      el("h2", { text: "Manage" }),
      tabs,
      el("div", { class: "admin-bar", id: "admin-bar" }, search, user, add, prev, next),
      el("p", { id: "admin-status", class: "caption" }),
      el("div", { id: "admin-form-area" }),
      el("div", { class: "table-wrap", id: "admin-list" }, table),
      el("div", { id: "admin-panel", hidden: true }),
      dialog,
    );
    tabs.querySelector(`button[data-tab="${view.tab}"]`).setAttribute("aria-pressed", "true");
  }

  function sync() {
    const root = document.getElementById("admin");
    if (!root) return;
    const admin = typeof state !== "undefined" && state.key && state.who && state.who.mode === "admin";
    if (!admin) {
      root.hidden = true;
      root.replaceChildren();
      view.root = null;
      return;
    }
    if (document.body.dataset.state !== "ready" || view.root) return;
    view.root = root;
    readUrl();
    build(root);
    root.hidden = false;
    load().catch((e) => note(e.message, true));
  }

  // app.js marks the body ready after each sign-in and refresh, signed-out on sign-out.
  document.addEventListener("DOMContentLoaded", () => {
    new MutationObserver(sync).observe(document.body, { attributes: true, attributeFilter: ["data-state"] });
    sync();
  });
})();

"use strict";
// More tabs of the admin console (admin.js draws the console and gives these its helpers):
// webhooks (create, test, deliveries, delete), a team's ingestion keys (create, revoke),
// adjustments with a reason, and a reconciliation upload with its result.

(() => {
  const kit = window.AdminKit || (window.AdminKit = { panels: [] });
  const EVENTS = [
    "budget.threshold_crossed",
    "budget.soft_limit_reached",
    "budget.exhausted",
    "budget.window_reset",
    "token.expiring",
    "reconciliation.differs",
  ];

  function field(name, label, control) {
    control.name = name;
    control.id = `admin-f-${name}`;
    const { el } = kit;
    return el("label", { class: "admin-field", "data-field": name }, el("span", { text: label }), control,
      el("span", { class: "admin-error bad", "data-for": name }));
  }

  function text(name, label, attrs) {
    return field(name, label, kit.el("input", { type: "text", autocomplete: "off", spellcheck: "false", ...attrs }));
  }

  function teamPicker(name, label, blank) {
    const select = kit.el("select");
    if (blank) select.append(kit.el("option", { value: "", text: blank }));
    for (const t of kit.teams()) select.append(kit.el("option", { value: t.id, text: `${t.name} (${t.id})` }));
    return field(name, label, select);
  }

  /** A form whose submit runs action(values); the API's error goes next to its field. */
  function form(id, title, fields, submit, action) {
    const { el } = kit;
    const node = el("form", { id, class: "admin-form", novalidate: true },
      el("h3", { text: title }), el("div", { class: "admin-grid" }, ...fields),
      el("p", { class: "admin-form-error bad" }),
      el("div", { class: "admin-buttons" }, el("button", { type: "submit", text: submit })));
    node.addEventListener("submit", async (event) => {
      event.preventDefault();
      kit.showErrors(node, {});
      node.dataset.state = "sending";
      try {
        await action(node.elements, node);
        node.dataset.state = "done";
      } catch (error) {
        node.dataset.state = "error";
        if (error instanceof kit.ApiFailure || error.param !== undefined) kit.showErrors(node, { [error.param || "_"]: error.message });
        else throw error;
      }
    });
    return node;
  }

  function required(elements, names) {
    const errors = {};
    for (const name of names) if (!elements[name].value.trim()) errors[name] = `${name}: a value is required`;
    if (Object.keys(errors).length) {
      const [param, message] = Object.entries(errors)[0];
      throw Object.assign(new Error(message), { param });
    }
  }

  function secretBox(label, secret) {
    const { el } = kit;
    const code = el("code", { class: "admin-secret", id: "admin-secret", text: secret });
    const copy = el("button", { type: "button", text: "copy" });
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(secret);
        copy.textContent = "copied";
      } catch {
        const range = document.createRange();
        range.selectNodeContents(code);
        window.getSelection().removeAllRanges();
        window.getSelection().addRange(range);
        copy.textContent = "selected: press Ctrl+C";
      }
    });
    const done = el("button", { type: "button", text: "done" });
    const box = el("div", { class: "admin-secret-box", role: "status" }, el("p", { text: `${label}: shown this once, never again.` }), code, copy, done);
    done.addEventListener("click", () => box.remove());
    return box;
  }

  function table(id, headers, rows) {
    const { el } = kit;
    return el("div", { class: "table-wrap" }, el("table", { id, "data-rows": String(rows.length) },
      el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, ...rows)));
  }

  // --- webhooks -----------------------------------------------------------------------------

  async function webhooks(area) {
    const { el, send } = kit;
    const events = el("select", { multiple: true, size: String(EVENTS.length) });
    for (const e of EVENTS) events.append(el("option", { value: e, text: e, selected: true }));
    const out = el("div", { id: "admin-webhook-out" });
    const create = form("admin-webhook-form", "New webhook", [
      text("url", "URL (https://…)"), field("events", "events", events), teamPicker("team_id", "team", "every team"),
    ], "create", async (f) => {
      required(f, ["url"]);
      const body = { url: f.url.value.trim(), events: [...f.events.selectedOptions].map((o) => o.value) };
      if (f.team_id.value) body.team_id = f.team_id.value;
      const made = await send("POST", "/v1/webhooks", body);
      await webhooks(area);
      area.prepend(secretBox(`The signing secret of ${made.url}`, made.secret));
    });
    const hooks = (await send("GET", "/v1/webhooks")).data;
    const rows = hooks.map((h) => {
      const test = el("button", { type: "button", class: "admin-test", text: "send a test" });
      const deliveries = el("button", { type: "button", class: "admin-deliveries", text: "deliveries" });
      const drop = el("button", { type: "button", class: "admin-delete", text: "delete" });
      test.addEventListener("click", () => send("POST", `/v1/webhooks/${encodeURIComponent(h.id)}/test`)
        .then((sent) => kit.note(`test event ${sent.event_id} queued for ${h.url}`)).catch((e) => kit.note(e.message, true)));
      deliveries.addEventListener("click", () => showDeliveries(h, out).catch((e) => kit.note(e.message, true)));
      drop.addEventListener("click", () => kit.confirmThen(
        `Delete the webhook to ${h.url}? Nothing more is sent to it; its pending deliveries are dropped.`,
        async () => {
          await send("DELETE", `/v1/webhooks/${encodeURIComponent(h.id)}`);
          kit.note(`webhook ${h.url} deleted`);
          await webhooks(area);
        }));
      return el("tr", { "data-id": h.id }, el("td", { class: "admin-name", text: h.url }),
        el("td", { class: "admin-id", text: `${h.events.join(", ")} · ${h.team_id || "every team"}` }),
        el("td", { class: "admin-actions" }, test, deliveries, drop));
    });
    area.replaceChildren(create, table("admin-webhooks", ["url", "events · team", ""], rows), out);
  }

  async function showDeliveries(hook, out) {
    const { el, send } = kit;
    const list = (await send("GET", `/v1/webhooks/${encodeURIComponent(hook.id)}/deliveries?limit=20`)).data;
    const rows = list.map((d) => el("tr", { "data-id": d.id }, el("td", { text: d.created_at }), el("td", { text: d.event_type }),
      el("td", { text: d.status }), el("td", { text: `${d.attempts} · ${d.last_status_code ?? d.last_error ?? ""}` })));
    out.replaceChildren(el("h3", { text: `Deliveries to ${hook.url}` }), table("admin-deliveries", ["created", "event", "status", "attempts · last answer"], rows));
    out.dataset.state = "ready";
  }

  // --- ingestion keys -----------------------------------------------------------------------

  async function ingestKeys(area, chosen) {
    const { el, send } = kit;
    const teams = kit.teams();
    const team = chosen || (teams[0] && teams[0].id) || "";
    const picker = teamPicker("team", "team");
    picker.querySelector("select").value = team;
    picker.querySelector("select").addEventListener("change", (e) => ingestKeys(area, e.target.value).catch((x) => kit.note(x.message, true)));
    const create = form("admin-ingest-form", "New ingestion key", [picker, text("name", "what it is for")], "create", async (f) => {
      required(f, ["name"]);
      const made = await send("POST", `/v1/teams/${encodeURIComponent(f.team.value)}/ingest-keys`, { name: f.name.value.trim() });
      await ingestKeys(area, f.team.value);
      area.prepend(secretBox(`The ingestion key ${made.name}`, made.key));
    });
    const keys = team ? (await send("GET", `/v1/teams/${encodeURIComponent(team)}/ingest-keys`)).data : [];
    const rows = keys.map((k) => {
      const drop = el("button", { type: "button", class: "admin-delete", text: "revoke" });
      drop.addEventListener("click", () => kit.confirmThen(
        `Revoke the ingestion key ${k.name} (${k.prefix}…)? Its next use, on any replica, is refused (401).`,
        async () => {
          await send("DELETE", `/v1/teams/${encodeURIComponent(team)}/ingest-keys/${encodeURIComponent(k.id)}`);
          kit.note(`ingestion key ${k.name} revoked`);
          await ingestKeys(area, team);
        }));
      return el("tr", { "data-id": k.id }, el("td", { class: "admin-name", text: k.name }),
        el("td", { class: "admin-id", text: `${k.prefix}… · ${k.id}` }), el("td", { class: "admin-actions" }, drop));
    });
    area.replaceChildren(create, table("admin-ingest-keys", ["name", "prefix · id", ""], rows));
  }

  // --- adjustments --------------------------------------------------------------------------

  async function adjustments(area) {
    const { el, send } = kit;
    const out = el("p", { id: "admin-adjust-out", class: "caption" });
    const adjust = form("admin-adjust-form", "Adjust spend", [
      text("amount", "amount (USD, negative: a credit)"), text("reason", "reason"),
      teamPicker("team_id", "team", "(by user or token)"), text("user_id", "user id (optional)"),
      text("token_id", "token id (optional)"), text("at", "at (RFC 3339, empty: now)"),
    ], "adjust", async (f) => {
      required(f, ["amount", "reason"]);
      if (!/^-?(0|[1-9][0-9]{0,11})(\.[0-9]{1,12})?$/.test(f.amount.value.trim())) {
        throw Object.assign(new Error("amount: a signed decimal USD amount such as -5.00"), { param: "amount" });
      }
      const body = { amount: f.amount.value.trim(), reason: f.reason.value.trim() };
      for (const name of ["team_id", "user_id", "token_id", "at"]) if (f[name].value.trim()) body[name] = f[name].value.trim();
      const made = await send("POST", "/v1/adjustments", body);
      out.textContent = `adjustment ${made.id}: ${made.cost} USD to team ${made.team_id}, user ${made.user_id}` +
        `${made.token_id ? `, token ${made.token_id}` : ""} (${made.reason})`;
      kit.note(`adjustment ${made.id} recorded`);
    });
    area.replaceChildren(adjust, out);
  }

  // --- reconciliation -----------------------------------------------------------------------

  async function reconcile(area) {
    const { el, send } = kit;
    const out = el("div", { id: "admin-reconcile-out" });
    const upload = form("admin-reconcile-form", "Reconcile a provider's usage export", [
      text("provider", "provider"), text("tolerance", "tolerance (empty: 0.001)"),
      field("file", "CSV file (date, provider, model, prompt_tokens, completion_tokens, cost)", el("input", { type: "file", accept: ".csv,text/csv" })),
    ], "upload", async (f) => {
      required(f, ["provider"]);
      if (!f.file.files.length) throw Object.assign(new Error("file: choose the CSV export"), { param: "file" });
      const params = new URLSearchParams({ provider: f.provider.value.trim() });
      if (f.tolerance.value.trim()) params.set("tolerance", f.tolerance.value.trim());
      const result = await send("POST", `/v1/reconciliations?${params}`, await f.file.files[0].text(), "text/csv");
      const s = result.summary;
      const rows = result.rows.map((r) => el("tr", { "data-status": r.status }, el("td", { text: r.day }), el("td", { text: r.model }),
        el("td", { text: r.status }), el("td", { text: r.ledger ? r.ledger.cost : "–" }), el("td", { text: r.provider_side ? r.provider_side.cost : "–" })));
      out.replaceChildren(
        el("p", { id: "admin-reconcile-summary", text: `${result.id}: ${s.matched} matched, ${s.differs} differ, ${s.missing_in_ledger} missing in the ledger, ${s.missing_in_provider} missing in the export` }),
        table("admin-reconcile-rows", ["day", "model", "status", "ledger cost", "provider cost"], rows));
    });
    area.replaceChildren(upload, out);
  }

  kit.panels.push(
    { name: "webhooks", render: webhooks },
    { name: "ingest keys", render: (area) => ingestKeys(area) },
    { name: "adjustments", render: adjustments },
    { name: "reconcile", render: reconcile },
  );
})();

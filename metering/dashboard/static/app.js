"use strict";
// The dashboard: every figure comes from the public API with the visitor's own key, the same
// calls a script would make. The key lives in sessionStorage (this tab only) and is sent only
// in the Authorization header, never in a URL. The admin key sees everything; a user's API or
// access token sees its own user's data, so the page asks that credential only for its own
// user, team and tokens instead of the admin-only lists.

const KEY_STORE = "metering.key";
const PREFS_STORE = "metering.prefs";
const RANGES = {
  "24h": { unit: "hour", count: 24 },
  "7d": { unit: "day", count: 7 },
  "30d": { unit: "day", count: 30 },
};
const TOP_TOKENS = 10;
const RECENT = 25;
const RECENT_ALERTS = 20;
const MAX_SERIES = 8; // more groups than this are drawn as one "other" series
const MAX_BUDGETS = 100; // per scope, for the admin
const PARALLEL = 6;
const DIRECTORY_TTL_MS = 5 * 60 * 1000;

const $ = (id) => document.getElementById(id);
const { html } = Charts;

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

const state = {
  key: null,
  who: null, // {mode: "admin"} or {mode: "user", me: {user_id, team_id} | null}
  directory: null,
  directoryAt: 0,
  data: null, // what the last refresh fetched
  timer: null,
  generation: 0,
  prefs: { range: "24h", group: "team", refresh: 30 },
};

// --- the API ---------------------------------------------------------------------------------

async function api(path) {
  const response = await fetch(path, {
    headers: { authorization: `Bearer ${state.key}` },
    cache: "no-store",
  });
  if (!response.ok) {
    let message = response.statusText;
    try {
      message = (await response.json()).error.message;
    } catch {
      // not an error body: keep the status text
    }
    throw new ApiError(response.status, message);
  }
  return response.json();
}

function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined) search.set(name, value);
  }
  return search.toString();
}

/** fn over items, a few at a time; results in the items' order. */
async function pool(items, fn) {
  const out = new Array(items.length);
  let next = 0;
  async function worker() {
    while (next < items.length) {
      const index = next++;
      out[index] = await fn(items[index]);
    }
  }
  await Promise.all(Array.from({ length: Math.min(PARALLEL, items.length) }, worker));
  return out;
}

/** Every row of an admin list (/v1/teams, /v1/users), page by page. */
async function everything(path) {
  const out = [];
  let after = null;
  for (;;) {
    const page = await api(`${path}?${query({ limit: 1000, after })}`);
    out.push(...page.data);
    if (page.data.length < 1000) return out;
    after = page.data[page.data.length - 1].id;
  }
}

// --- who is looking ----------------------------------------------------------------------------

async function identify() {
  const me = await api("/v1/me");
  if (me.kind === "admin") return { mode: "admin" };
  return { mode: "user", me: { user_id: me.user_id, team_id: me.team_id } };
}

/** Names for ids: teams, users and tokens the credential may see. */
async function loadDirectory(force) {
  if (!force && state.directory && Date.now() - state.directoryAt < DIRECTORY_TTL_MS) {
    return state.directory;
  }
  const directory = { teams: new Map(), users: new Map(), tokens: new Map() };
  let users = [];
  if (state.who.mode === "admin") {
    const [teams, all] = await Promise.all([everything("/v1/teams"), everything("/v1/users")]);
    teams.forEach((t) => directory.teams.set(t.id, t));
    users = all;
  } else if (state.who.me) {
    users = [await api(`/v1/users/${encodeURIComponent(state.who.me.user_id)}`)];
  }
  users.forEach((u) => directory.users.set(u.id, u));
  const lists = await pool(users, (u) =>
    api(`/v1/users/${encodeURIComponent(u.id)}/tokens?include_revoked=true`),
  );
  for (const list of lists) list.data.forEach((t) => directory.tokens.set(t.id, t));
  state.directory = directory;
  state.directoryAt = Date.now();
  return directory;
}

function teamName(directory, id) {
  if (directory.teams.has(id)) return directory.teams.get(id).name;
  return state.who.me && id === state.who.me.team_id ? "your team" : id;
}

function userName(directory, id) {
  const user = directory.users.get(id);
  return user ? user.email : id;
}

function tokenName(directory, id) {
  if (id === null) return "access tokens (logins)";
  const token = directory.tokens.get(id);
  return token ? `${token.name} (${token.prefix}…)` : id;
}

// --- time --------------------------------------------------------------------------------------

/** The range's start and its buckets, keyed as /v1/spend writes `hour` and `day` (UTC). */
function rangeOf(name, now = new Date()) {
  const { unit, count } = RANGES[name];
  const start = new Date(now);
  if (unit === "hour") {
    start.setUTCMinutes(0, 0, 0);
    start.setUTCHours(start.getUTCHours() - (count - 1));
  } else {
    start.setUTCHours(0, 0, 0, 0);
    start.setUTCDate(start.getUTCDate() - (count - 1));
  }
  const buckets = [];
  for (let i = 0; i < count; i++) {
    const at = new Date(start);
    if (unit === "hour") {
      at.setUTCHours(at.getUTCHours() + i);
      const iso = at.toISOString();
      buckets.push({ key: `${iso.slice(0, 13)}:00:00Z`, label: iso.slice(11, 16), title: `${iso.slice(0, 16)} UTC` });
    } else {
      at.setUTCDate(at.getUTCDate() + i);
      const day = at.toISOString().slice(0, 10);
      buckets.push({ key: day, label: day.slice(5), title: day });
    }
  }
  return { name, unit, start: start.toISOString(), buckets };
}

function when(iso) {
  const at = new Date(iso);
  const minutes = Math.round((at - Date.now()) / 60000);
  const local = at.toLocaleString([], { dateStyle: "short", timeStyle: "short" });
  if (minutes < 0) return local;
  if (minutes < 90) return `in ${minutes} min (${local})`;
  if (minutes < 48 * 60) return `in ${Math.round(minutes / 60)} h (${local})`;
  return `in ${Math.round(minutes / 1440)} d (${local})`;
}

// --- data for each panel --------------------------------------------------------------------------

function spend(range, groupBy) {
  return api(`/v1/spend?${query({ start: range.start, group_by: groupBy })}`);
}

async function budgetRows(directory) {
  const subjects = [];
  if (state.who.mode === "admin") {
    const limited = (items, scope) =>
      items.filter((o) => o.credit_limit !== null).slice(0, MAX_BUDGETS).map((o) => ({ scope, o }));
    subjects.push(
      ...limited([...directory.teams.values()], "team"),
      ...limited([...directory.users.values()], "user"),
      ...limited([...directory.tokens.values()].filter((t) => !t.revoked_at), "token"),
    );
  } else if (state.who.me) {
    const { user_id, team_id } = state.who.me;
    subjects.push({ scope: "team", o: { id: team_id } }, { scope: "user", o: { id: user_id } });
    for (const token of directory.tokens.values()) {
      if (!token.revoked_at) subjects.push({ scope: "token", o: token });
    }
  }
  const budgets = await pool(subjects, ({ scope, o }) =>
    api(`/v1/${scope}s/${encodeURIComponent(o.id)}/budget`),
  );
  const label = {
    team: (id) => teamName(directory, id),
    user: (id) => userName(directory, id),
    token: (id) => tokenName(directory, id),
  };
  const order = { team: 0, user: 1, token: 2 };
  return budgets
    .map((b) => ({
      scope: b.scope,
      id: b.id,
      label: label[b.scope](b.id),
      limit: Money.parse(b.credit_limit),
      spent: Money.parse(b.spent),
      reserved: Money.parse(b.reserved),
      resetsAt: b.resets_at,
      interval: b.reset_interval,
      passed: b.threshold_passed ?? null,
    }))
    .map((r) => ({ ...r, used: r.limit === null ? -1 : Money.ratio(r.spent + r.reserved, r.limit) }))
    .sort((a, b) => order[a.scope] - order[b.scope] || b.used - a.used);
}

/** Teams, users and tokens with a rate, parallel or model limit, and their use now. */
async function limitRows(directory) {
  const limited = (o) =>
    o.rpm_limit !== null || o.tpm_limit !== null || o.max_parallel_requests !== null || o.allowed_models !== null;
  const subjects = [];
  if (state.who.mode === "admin") {
    const pick = (items, scope) => items.filter(limited).slice(0, MAX_BUDGETS).map((o) => ({ scope, o }));
    subjects.push(
      ...pick([...directory.teams.values()], "team"),
      ...pick([...directory.users.values()], "user"),
      ...pick([...directory.tokens.values()].filter((t) => !t.revoked_at), "token"),
    );
  } else if (state.who.me) {
    const { user_id, team_id } = state.who.me;
    subjects.push({ scope: "team", o: { id: team_id } }, { scope: "user", o: { id: user_id } });
    for (const token of directory.tokens.values()) {
      if (!token.revoked_at && limited(token)) subjects.push({ scope: "token", o: token });
    }
  }
  const rows = await pool(subjects, ({ scope, o }) =>
    api(`/v1/${scope}s/${encodeURIComponent(o.id)}/limits`),
  );
  const label = {
    team: (id) => teamName(directory, id),
    user: (id) => userName(directory, id),
    token: (id) => tokenName(directory, id),
  };
  return rows
    .filter((r) => limited(r))
    .map((r) => ({ ...r, label: label[r.scope](r.id) }));
}

/** Requests refused by limits, from this replica's /metrics (admin only; null when closed). */
async function limitRefusals() {
  if (state.who.mode !== "admin") return null;
  try {
    const response = await fetch("/metrics", {
      headers: { authorization: `Bearer ${state.key}` },
      cache: "no-store",
    });
    if (!response.ok) return null;
    const rows = [];
    for (const line of (await response.text()).split("\n")) {
      const found = line.match(/^metering_limit_rejections_total\{(.*)\} (\S+)$/);
      if (!found) continue;
      const labels = Object.fromEntries([...found[1].matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]]));
      rows.push({ scope: labels.scope, kind: labels.kind, count: Number(found[2]) });
    }
    return rows;
  } catch {
    return null;
  }
}

// --- drawing -------------------------------------------------------------------------------------

function compareDesc(a, b) {
  return a > b ? -1 : a < b ? 1 : 0;
}

function drawSpend(range, report, directory, group) {
  const field = group === "team" ? "team_id" : group;
  const byKey = new Map();
  for (const row of report.rows) {
    const key = row[field];
    if (!byKey.has(key)) byKey.set(key, new Map());
    const values = byKey.get(key);
    const bucket = row[range.unit];
    values.set(bucket, (values.get(bucket) ?? 0n) + Money.parse(row.cost));
  }
  let series = [...byKey.entries()].map(([key, values]) => ({
    key,
    label: group === "team" ? teamName(directory, key) : key,
    values,
    total: [...values.values()].reduce((a, v) => a + v, 0n),
  }));
  series.sort((a, b) => compareDesc(a.total, b.total) || String(a.key).localeCompare(String(b.key)));
  if (series.length > MAX_SERIES) {
    const other = { key: "__other__", label: `${series.length - (MAX_SERIES - 1)} others`, values: new Map() };
    for (const s of series.slice(MAX_SERIES - 1)) {
      for (const [bucket, value] of s.values) other.values.set(bucket, (other.values.get(bucket) ?? 0n) + value);
    }
    series = [...series.slice(0, MAX_SERIES - 1), other];
  }
  Charts.stacked($("spend-chart"), {
    name: "spend",
    title: `spend by ${group}`,
    buckets: range.buckets,
    series,
    format: Money.format,
    plain: Money.plain,
    empty: "no spend in this range",
  });
  $("spend-caption").textContent =
    `per ${range.unit} (UTC), stacked by ${group} · total ${Money.format(Money.parse(report.total.cost))}`;
}

function drawKinds(report) {
  const models = [...report.rows].sort(
    (a, b) => b.prompt_tokens + b.completion_tokens - (a.prompt_tokens + a.completion_tokens),
  );
  const kinds = [
    ["prompt", "prompt (not cached)", (r) => r.prompt_tokens - r.cached_tokens],
    ["cached", "cached prompt", (r) => r.cached_tokens],
    ["completion", "completion (not reasoning)", (r) => r.completion_tokens - r.reasoning_tokens],
    ["reasoning", "reasoning", (r) => r.reasoning_tokens],
  ];
  const series = kinds.map(([key, label, of], i) => ({
    key,
    label,
    color: Charts.PALETTE[[0, 4, 1, 6][i]],
    values: new Map(models.map((r) => [r.model, BigInt(of(r))])),
  }));
  Charts.stacked($("kinds-chart"), {
    name: "token-kinds",
    title: "tokens by kind and model",
    buckets: models.map((r) => ({ key: r.model, label: r.model })),
    series: models.length ? series : [],
    format: (v) => Money.count(v),
    plain: (v) => v.toString(),
    empty: "no tokens in this range",
  });
}

function drawTopTokens(report, directory) {
  const rows = report.rows
    .map((r) => ({ ...r, pico: Money.parse(r.cost) }))
    .sort((a, b) => compareDesc(a.pico, b.pico))
    .slice(0, TOP_TOKENS);
  Charts.ranking($("tokens-chart"), {
    name: "top-tokens",
    title: "top tokens by spend",
    items: rows.map((r) => {
      const token = r.token_id === null ? null : directory.tokens.get(r.token_id);
      return {
        key: r.token_id ?? "",
        label: tokenName(directory, r.token_id),
        sub: token ? userName(directory, token.user_id) : "",
        value: r.pico,
      };
    }),
    format: Money.format,
    plain: Money.plain,
    empty: "no token spent anything in this range",
  });
}

function drawBudgets(rows) {
  Charts.budgets($("budgets-chart"), { rows, when, empty: "no budgets with a limit" });
}

function drawLimits(rows, refusals) {
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  const use = (used, limit) => (limit === null ? "—" : `${Money.count(used)} / ${Money.count(limit)}`);
  const full = (used, limit) => limit !== null && used >= limit;
  const body = $("limits-body");
  body.replaceChildren(
    ...rows.map((r) =>
      html("tr", { "data-id": r.id, "data-scope": r.scope }, [
        cell(r.scope),
        cell(r.label),
        cell(use(r.requests, r.rpm_limit), full(r.requests, r.rpm_limit) ? "num bad" : "num"),
        cell(use(r.tokens, r.tpm_limit), full(r.tokens, r.tpm_limit) ? "num bad" : "num"),
        cell(use(r.in_flight, r.max_parallel_requests), full(r.in_flight, r.max_parallel_requests) ? "num bad" : "num"),
        cell(r.allowed_models === null ? "all" : r.allowed_models.join(", ")),
      ]),
    ),
  );
  $("limits").dataset.rows = String(rows.length);
  $("limits-empty").hidden = rows.length > 0;
  const line = $("refusals");
  if (refusals === null) {
    line.textContent = state.who.mode === "admin" ? "refusals: /metrics is closed to this key" : "";
    line.dataset.total = "";
    return;
  }
  const total = refusals.reduce((sum, r) => sum + r.count, 0);
  line.dataset.total = String(total);
  line.textContent = total
    ? `refused by this replica since it started: ${refusals
        .filter((r) => r.count)
        .map((r) => `${Money.count(r.count)} × ${r.scope} ${r.kind}`)
        .join(", ")}`
    : "no request refused by a limit on this replica since it started";
}

const ALERT_NAMES = {
  "budget.threshold_crossed": "threshold crossed",
  "budget.soft_limit_reached": "soft limit reached",
  "budget.exhausted": "budget exhausted",
  "budget.window_reset": "window reset",
  "token.expiring": "token expiring",
  "reconciliation.differs": "reconciliation differs",
};

function subjectName(directory, scope, id) {
  if (scope === "team") return teamName(directory, id);
  if (scope === "user") return userName(directory, id);
  if (scope === "token") return tokenName(directory, id);
  return id;
}

function drawAlerts(events, directory) {
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  const money = (text) => (text === null || text === undefined ? "" : Money.format(Money.parse(text)));
  const rows = events.map((e) => {
    const d = e.data;
    const bad = e.type === "budget.exhausted" || e.type === "reconciliation.differs";
    return html("tr", { "data-id": e.id, "data-type": e.type, class: bad ? "error" : "" }, [
      cell(new Date(e.created_at).toLocaleString()),
      cell(ALERT_NAMES[e.type] ?? e.type, bad ? "bad" : ""),
      cell(d.scope),
      cell(subjectName(directory, d.scope, d.subject_id)),
      cell(d.threshold === null || d.threshold === undefined ? "" : `${d.threshold}%`, "num"),
      cell(money(d.spent), "num"),
      cell(money(d.credit_limit), "num"),
    ]);
  });
  $("alerts-body").replaceChildren(...rows);
  $("alerts").dataset.rows = String(rows.length);
  $("alerts-empty").hidden = rows.length > 0;
}

function drawRecent(events, directory) {
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  const rows = events.map((e) => {
    const error = e.status !== "ok";
    const tokens = `${Money.count(e.prompt_tokens)} → ${Money.count(e.completion_tokens)}`;
    const details = [];
    if (e.prompt_tokens_details.cached_tokens) details.push(`${Money.count(e.prompt_tokens_details.cached_tokens)} cached`);
    if (e.completion_tokens_details.reasoning_tokens) details.push(`${Money.count(e.completion_tokens_details.reasoning_tokens)} reasoning`);
    return html("tr", { "data-id": e.id, class: error ? "error" : "" }, [
      cell(new Date(e.created_at).toLocaleTimeString()),
      cell(teamName(directory, e.team_id)),
      cell(userName(directory, e.user_id)),
      cell(tokenName(directory, e.token_id)),
      cell(e.model),
      cell(e.provider),
      cell(e.stream ? "stream" : "—"),
      cell(e.http_status ? `${e.status} (${e.http_status})` : e.status, error ? "bad" : "ok"),
      cell(details.length ? `${tokens} (${details.join(", ")})` : tokens, "num"),
      cell(Money.format(Money.parse(e.cost)), "num"),
      cell(e.latency_ms === null ? "" : `${Money.count(e.latency_ms)} ms`, "num"),
    ]);
  });
  const body = $("recent-body");
  body.replaceChildren(...rows);
  $("recent").dataset.rows = String(rows.length);
  $("recent-empty").hidden = rows.length > 0;
}

function drawSummary(total) {
  $("total-cost").textContent = Money.format(Money.parse(total.cost));
  $("total-cost").dataset.value = Money.plain(Money.parse(total.cost));
  $("total-requests").textContent = Money.count(total.requests);
  $("total-prompt").textContent = Money.count(total.prompt_tokens);
  $("total-completion").textContent = Money.count(total.completion_tokens);
}

/** Draws the last data fetched (again after a resize: charts are drawn at their pixel size). */
function draw() {
  if (!state.data) return;
  const { range, group, directory, byTime, byModel, byToken, recent, budgets, limits, refusals, alerts } =
    state.data;
  drawSummary(byModel.total);
  drawSpend(range, byTime, directory, group);
  drawKinds(byModel);
  drawTopTokens(byToken, directory);
  drawBudgets(budgets);
  drawLimits(limits, refusals);
  drawRecent(recent.data, directory);
  drawAlerts(alerts.data, directory);
  const me = state.who.me;
  $("who").textContent = state.who.mode === "admin"
    ? "admin: everything"
    : `${userName(directory, me.user_id)}: own data only`;
  document.body.dataset.mode = state.who.mode;
  document.body.dataset.start = range.start;
}

// --- the refresh cycle ---------------------------------------------------------------------------

function status(message, kind = "info") {
  const line = $("status");
  line.textContent = message;
  line.dataset.kind = kind;
}

async function refresh(force = false) {
  clearTimeout(state.timer);
  const generation = ++state.generation;
  document.body.dataset.state = "loading";
  try {
    state.who ??= await identify();
    const range = rangeOf(state.prefs.range);
    const unit = range.unit;
    const group = state.prefs.group;
    const directory = await loadDirectory(force);
    const [byTime, byModel, byToken, recent, budgets, limits, refusals, alerts] = await Promise.all([
      spend(range, `${unit},${group}`),
      spend(range, "model"),
      spend(range, "token"),
      api(`/v1/usage?${query({ limit: RECENT })}`),
      budgetRows(directory),
      limitRows(directory),
      limitRefusals(),
      api(`/v1/alerts?${query({ limit: RECENT_ALERTS })}`),
    ]);
    if (generation !== state.generation) return; // a newer refresh has started
    state.data = { range, group, directory, byTime, byModel, byToken, recent, budgets, limits, refusals, alerts };
    draw();
    status(`updated ${new Date().toLocaleTimeString()}`);
    document.body.dataset.state = "ready";
  } catch (error) {
    if (generation !== state.generation) return;
    if (error instanceof ApiError && error.status === 401) {
      signOut(`The API refused this key: ${error.message}`);
      return;
    }
    document.body.dataset.state = "error";
    status(`could not load: ${error.message}`, "error");
  } finally {
    if (generation === state.generation && state.key) schedule();
  }
}

function schedule() {
  clearTimeout(state.timer);
  const seconds = Number(state.prefs.refresh);
  if (!seconds) return;
  state.timer = setTimeout(() => {
    if (document.hidden) schedule();
    else refresh();
  }, seconds * 1000);
}

// --- signing in and out, preferences -----------------------------------------------------------

function show(signedIn) {
  $("login").hidden = signedIn;
  $("panels").hidden = !signedIn;
  $("controls").hidden = !signedIn;
}

function signIn(key) {
  state.key = key;
  state.data = null;
  state.who = null;
  state.directory = null;
  sessionStorage.setItem(KEY_STORE, key);
  show(true);
  refresh(true);
}

function signOut(message = "") {
  clearTimeout(state.timer);
  state.generation++;
  state.key = null;
  state.data = null;
  state.who = null;
  state.directory = null;
  sessionStorage.removeItem(KEY_STORE);
  show(false);
  $("login-message").textContent = message;
  document.body.dataset.state = "signed-out";
}

function savePrefs() {
  sessionStorage.setItem(PREFS_STORE, JSON.stringify(state.prefs));
}

function loadPrefs() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(PREFS_STORE) ?? "{}");
    if (saved.range in RANGES) state.prefs.range = saved.range;
    if (["team", "model", "provider"].includes(saved.group)) state.prefs.group = saved.group;
    if ([0, 10, 30, 60].includes(Number(saved.refresh))) state.prefs.refresh = Number(saved.refresh);
  } catch {
    // unreadable preferences: keep the defaults
  }
  $("range").value = state.prefs.range;
  $("group").value = state.prefs.group;
  $("refresh-every").value = String(state.prefs.refresh);
}

function start() {
  loadPrefs();
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    $("key").value = "";
    if (key) signIn(key);
  });
  $("sign-out").addEventListener("click", () => signOut());
  $("refresh-now").addEventListener("click", () => refresh(true));
  for (const [id, pref] of [["range", "range"], ["group", "group"], ["refresh-every", "refresh"]]) {
    $(id).addEventListener("change", (event) => {
      state.prefs[pref] = pref === "refresh" ? Number(event.target.value) : event.target.value;
      savePrefs();
      refresh();
    });
  }
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(draw, 150);
  });
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) signIn(key);
  else signOut();
}

document.addEventListener("DOMContentLoaded", start);

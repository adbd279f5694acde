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
  mtd: { unit: "day" }, // the 1st of this month (UTC) to now
  custom: { unit: "day" }, // from one UTC day to another, both included (from, to in the URL)
};
const MAX_CUSTOM_DAYS = 366;
const DAY_MS = 86_400_000;
const TOP_TOKENS = 10;
const RECENT = 25;
const RECENT_ALERTS = 20;
const MAX_SERIES = 8; // more groups than this are drawn as one "other" series
const MAX_BUDGETS = 100; // per scope, for the admin
const PARALLEL = 6;
const DIRECTORY_TTL_MS = 5 * 60 * 1000;
const GROUPED_ROWS = 10_000; // rows of the spend-by-end-user (or tag) table asked for at once
const MAX_TAG_FILTERS = 16; // a request holds at most 16 tags: more filters could match nothing
const MAX_TEXT = 200; // the longest end user, tag key or tag filter the URL may carry here
const PLAIN_GROUPS = ["team", "model", "provider", "end_user", "endpoint"];

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
  prefs: { range: "24h", group: "team", refresh: 30, tz: "utc", from: null, to: null },
  // What the viewer narrowed the page to; every panel's calls carry it, and so does the URL.
  // end_user and tags (["key:value", ...], all must match) narrow what /v1/spend and /v1/usage
  // report; budgets, limits and refusals are kept by team, user and token only.
  filters: { team: null, user: null, token: null, model: null, end_user: null, tags: [] },
  models: [],
};
const FILTERS = { team: "team_id", user: "user_id", token: "token_id", model: "model" };
const REFUSALS_SHOWN = 10;

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
    if (Array.isArray(value)) value.forEach((v) => search.append(name, v)); // a repeated parameter
    else if (value !== null && value !== undefined) search.set(name, value);
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
  const [me, models] = await Promise.all([api("/v1/me"), api("/v1/models")]);
  state.models = models.data.map((m) => m.id);
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

/** A token as a row labelled by the API names it: its name and the start of its secret when the
 * directory knows it, else its name and the start of its id (names are not unique). */
function tokenLabel(directory, id, name) {
  if (id === null || directory.tokens.has(id) || !name) return tokenName(directory, id);
  return `${name} (${id.slice(0, 12)}…)`;
}

const STAMP = /\b\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})/g;

/** An API message as a person reads it: ids of teams, users and tokens as their names, RFC 3339
 * times in the chosen zone. */
function humanize(directory, message, known = {}) {
  const names = (id) => {
    if (directory.tokens.has(id)) return tokenName(directory, id);
    if (directory.users.has(id)) return userName(directory, id);
    if (directory.teams.has(id)) return teamName(directory, id);
    return known[id] ?? null;
  };
  return String(message ?? "")
    .replace(STAMP, (stamp) => fmtTime(stamp, { seconds: true }))
    .replace(/[A-Za-z]+_[A-Za-z0-9]{8,}/g, (id) => names(id) ?? id);
}

// --- time --------------------------------------------------------------------------------------

/** The range's start and its buckets, keyed as /v1/spend writes `hour` and `day` (UTC). */
function rangeOf(name, now = new Date()) {
  if (name === "mtd" || name === "custom") return spanOf(name, now);
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
      buckets.push({
        key: `${iso.slice(0, 13)}:00:00Z`,
        label: fmtTime(at, { date: false }),
        title: fmtTime(at),
      });
    } else {
      at.setUTCDate(at.getUTCDate() + i);
      const day = at.toISOString().slice(0, 10);
      buckets.push({ key: day, label: day.slice(5), title: day });
    }
  }
  return { name, unit, start: start.toISOString(), end: null, buckets };
}

/** A UTC day "YYYY-MM-DD" as a Date at its 00:00 UTC, or null. */
function utcDay(text) {
  if (typeof text !== "string" || !/^\d{4}-\d{2}-\d{2}$/.test(text)) return null;
  const at = new Date(`${text}T00:00:00Z`);
  return Number.isNaN(at.getTime()) || at.toISOString().slice(0, 10) !== text ? null : at;
}

/** Whether from and to make a custom range the page draws: both days, from <= to, at most a year. */
function validSpan(from, to) {
  const a = utcDay(from), b = utcDay(to);
  return a !== null && b !== null && a <= b && (b - a) / DAY_MS < MAX_CUSTOM_DAYS;
}

/** Month to date (UTC), or the custom days from..to (both included): by day, by hour for one day. */
function spanOf(name, now) {
  let first, last;
  if (name === "mtd") {
    first = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1));
    last = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate()));
  } else {
    first = utcDay(state.prefs.from);
    last = utcDay(state.prefs.to);
  }
  const days = Math.round((last - first) / DAY_MS) + 1;
  const end = new Date(last.getTime() + DAY_MS);
  const buckets = [];
  const unit = days === 1 ? "hour" : "day";
  if (unit === "hour") {
    for (let i = 0; i < 24; i++) {
      const at = new Date(first.getTime() + i * 3_600_000);
      buckets.push({ key: `${at.toISOString().slice(0, 13)}:00:00Z`, label: fmtTime(at, { date: false }), title: fmtTime(at) });
    }
  } else {
    for (let i = 0; i < days; i++) {
      const day = new Date(first.getTime() + i * DAY_MS).toISOString().slice(0, 10);
      buckets.push({ key: day, label: day.slice(5), title: day });
    }
  }
  // Month to date ends now (open); a custom range ends at the 00:00 UTC after its last day.
  return { name, unit, start: first.toISOString(), end: name === "custom" ? end.toISOString() : null, buckets };
}

/** The viewer's time zone: UTC unless they chose local time. */
function timeZone() {
  return state.prefs.tz === "local" ? Intl.DateTimeFormat().resolvedOptions().timeZone : "UTC";
}

/** A time as text, in the chosen zone, 24-hour clock: "2026-12-01 14:05" (or with seconds). */
function fmtTime(iso, { seconds = false, date = true } = {}) {
  const at = iso instanceof Date ? iso : new Date(iso);
  const parts = Object.fromEntries(
    new Intl.DateTimeFormat("en-CA", {
      timeZone: timeZone(),
      year: "numeric", month: "2-digit", day: "2-digit",
      hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23",
    }).formatToParts(at).map((p) => [p.type, p.value]),
  );
  const clock = `${parts.hour}:${parts.minute}${seconds ? ":" + parts.second : ""}`;
  return date ? `${parts.year}-${parts.month}-${parts.day} ${clock}` : clock;
}

/** What the page says about its times. */
function zoneNote() {
  if (state.prefs.tz !== "local") return "times in UTC";
  const offset = -new Date().getTimezoneOffset();
  const sign = offset < 0 ? "-" : "+";
  const hh = String(Math.floor(Math.abs(offset) / 60)).padStart(2, "0");
  const mm = String(Math.abs(offset) % 60).padStart(2, "0");
  return `times in local time (${timeZone()}, UTC${sign}${hh}:${mm}); days are UTC days`;
}

function when(iso) {
  const at = new Date(iso);
  const minutes = Math.round((at - Date.now()) / 60000);
  const shown = fmtTime(at);
  if (minutes < 0) return shown;
  if (minutes < 90) return `in ${minutes} min (${shown})`;
  if (minutes < 48 * 60) return `in ${Math.round(minutes / 60)} h (${shown})`;
  return `in ${Math.round(minutes / 1440)} d (${shown})`;
}

// --- data for each panel --------------------------------------------------------------------------

/** The team, user, token and model filters as API parameters (what every panel takes). */
function whoParams() {
  const out = {};
  for (const [name, param] of Object.entries(FILTERS)) {
    if (state.filters[name]) out[param] = state.filters[name];
  }
  return out;
}

/** Every filter as parameters of /v1/spend and /v1/usage: with `end_user` and `tag` (repeated). */
function filterParams() {
  const out = whoParams();
  if (state.filters.end_user) out.end_user = state.filters.end_user;
  if (state.filters.tags.length) out.tag = state.filters.tags;
  return out;
}

function spend(range, groupBy, extra = {}) {
  return api(`/v1/spend?${query({ start: range.start, end: range.end, group_by: groupBy, ...filterParams(), ...extra })}`);
}

/** Whether a team, user or token falls within the filters (its own id, or its parents'). */
function inFilters(directory, scope, o) {
  const f = state.filters;
  if (!f.team && !f.user && !f.token) return true;
  if (scope === "team") {
    const teamOf = f.token ? teamOfToken(directory, f.token) : f.user ? teamOfUser(directory, f.user) : f.team;
    return o.id === teamOf;
  }
  if (scope === "user") {
    if (f.token) return o.id === userOfToken(directory, f.token);
    if (f.user) return o.id === f.user;
    return (o.team_id ?? teamOfUser(directory, o.id)) === f.team;
  }
  if (f.token) return o.id === f.token;
  const user = o.user_id ?? userOfToken(directory, o.id);
  if (f.user) return user === f.user;
  return teamOfUser(directory, user) === f.team;
}

function userOfToken(directory, id) {
  const token = directory.tokens.get(id);
  return token ? token.user_id : null;
}

function teamOfUser(directory, id) {
  const user = directory.users.get(id);
  if (user) return user.team_id;
  return state.who.me && id === state.who.me.user_id ? state.who.me.team_id : null;
}

function teamOfToken(directory, id) {
  return teamOfUser(directory, userOfToken(directory, id));
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
  const shown = subjects.filter(({ scope, o }) => inFilters(directory, scope, o));
  const budgets = await pool(shown, ({ scope, o }) =>
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
  const shown = subjects.filter(({ scope, o }) => inFilters(directory, scope, o));
  const rows = await pool(shown, ({ scope, o }) =>
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

/** The row key /v1/spend writes for a group: team_id, model, provider, end_user, tag:<key>. */
function groupField(group) {
  return group === "team" ? "team_id" : group;
}

/** What the page calls a group: "team", "end user", "tag project". */
function groupName(group) {
  if (group === "end_user") return "end user";
  if (group.startsWith("tag:")) return `tag ${group.slice(4)}`;
  return group;
}

/** A group's value as shown: a team's name, or what requests without one are called. */
function groupLabel(directory, group, key) {
  if (group === "team") return teamName(directory, key);
  if (key === null) return group === "end_user" ? "(no end user)" : `(no tag ${group.slice(4)})`;
  return key;
}

/** A report a panel could not have, said in that panel (the rest of the page still draws). */
function showError(id, error) {
  const line = $(id);
  line.hidden = !error;
  line.textContent = error
    ? `the API refused this view${error.status ? ` (${error.status})` : ""}: ${error.message}`
    : "";
}

function drawSpend(range, report, directory, group) {
  showError("spend-error", report.error);
  if (report.error) {
    Charts.stacked($("spend-chart"), {
      name: "spend", title: `spend by ${groupName(group)}`, buckets: range.buckets, series: [],
      format: Money.format, plain: Money.plain, empty: "nothing to draw: see the message above",
    });
    $("spend-caption").textContent = "";
    return;
  }
  const field = groupField(group);
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
    label: groupLabel(directory, group, key),
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
    title: `spend by ${groupName(group)}`,
    buckets: range.buckets,
    series,
    format: Money.format,
    plain: Money.plain,
    empty: emptyText("no spend in this range"),
  });
  const unit = range.unit === "hour" ? `hour (${state.prefs.tz === "local" ? "local time" : "UTC"})` : "UTC day";
  $("spend-caption").textContent =
    `per ${unit}, stacked by ${groupName(group)} · total ${Money.format(Money.parse(report.total.cost))}`;
}

/** Spend by end user or by a tag's values: one row each, largest first. */
function drawGrouped(report, directory, group) {
  const panel = $("grouped-panel");
  panel.hidden = !isAttribution(group);
  if (panel.hidden) return;
  $("grouped-name").textContent = groupName(group);
  $("grouped-key").textContent = groupName(group);
  $("grouped").dataset.group = group;
  showError("grouped-error", report.error);
  const rows = report.error ? [] : [...report.rows]
    .map((r) => ({ ...r, pico: Money.parse(r.cost) }))
    .sort((a, b) => compareDesc(a.pico, b.pico) || String(a[groupField(group)]).localeCompare(String(b[groupField(group)])));
  const total = report.error ? 0n : Money.parse(report.total.cost);
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  $("grouped-body").replaceChildren(
    ...rows.map((r) => {
      const key = r[groupField(group)];
      const attrs = { "data-cost": Money.plain(r.pico), "data-requests": String(r.requests) };
      if (key !== null) attrs["data-key"] = key; // no attribute: requests without one
      return html("tr", attrs, [
        cell(groupLabel(directory, group, key), key === null ? "none" : ""),
        cell(Money.count(r.requests), "num"),
        cell(Money.format(r.pico), "num"),
        cell(Money.percent(r.pico, total), "num"),
      ]);
    }),
  );
  // The chart view of the same rows: the largest ten, as bars (the stacked chart above draws them
  // over time).
  Charts.ranking($("grouped-chart"), {
    name: "grouped",
    title: `spend by ${groupName(group)}`,
    items: rows.slice(0, TOP_TOKENS).map((r) => {
      const key = r[groupField(group)];
      return { key: key ?? "", label: groupLabel(directory, group, key), value: r.pico };
    }),
    format: Money.format,
    plain: Money.plain,
    empty: emptyText("nothing spent in this range"),
  });
  $("grouped").dataset.rows = String(rows.length);
  $("grouped").dataset.total = report.error ? "" : Money.plain(total);
  const more = report.error ? 0 : report.row_count - rows.length;
  $("grouped-caption").textContent = report.error
    ? ""
    : `${Money.count(report.row_count)} ${group === "end_user" ? "end user" : "value"}${report.row_count === 1 ? "" : "s"} in this range` +
      (more > 0 ? ` · the first ${Money.count(rows.length)} by name are shown, largest first` : "") +
      ` · total ${Money.format(total)}`;
  const empty = $("grouped-empty");
  empty.hidden = rows.length > 0 || Boolean(report.error);
  empty.textContent = emptyText("nothing spent in this range");
}

function isAttribution(group) {
  return group === "end_user" || group.startsWith("tag:");
}

/** A datalist's suggestions: the values seen, each once, at most 200. */
function fillList(id, values) {
  const seen = [...new Set(values)].slice(0, 200);
  $(id).replaceChildren(...seen.map((v) => html("option", { value: v })));
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
    empty: emptyText("no tokens in this range"),
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
    empty: emptyText("no token spent anything in this range"),
  });
}

function drawBudgets(rows) {
  Charts.budgets($("budgets-chart"), {
    rows,
    when,
    empty: filtered()
      ? "no budget with a limit within these filters"
      : "no budgets with a limit: give a team, user or token a credit_limit (PATCH)",
  });
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
  stack($("limits"));
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

/** An alert's subject by name: an end user by its own id as its client sent it (the API's
 * data.end_user), not its budget's internal id. */
function subjectName(directory, data) {
  const { scope, subject_id: id } = data;
  if (scope === "team") return teamName(directory, id);
  if (scope === "user") return userName(directory, id);
  if (scope === "token") return tokenName(directory, id);
  if (scope === "end_user" && data.end_user) {
    return data.team_id ? `${data.end_user} (${teamName(directory, data.team_id)})` : data.end_user;
  }
  return id;
}

function drawAlerts(events, directory) {
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  const money = (text) => (text === null || text === undefined ? "" : Money.format(Money.parse(text)));
  const rows = events.map((e) => {
    const d = e.data;
    const bad = e.type === "budget.exhausted" || e.type === "reconciliation.differs";
    return html("tr", { "data-id": e.id, "data-type": e.type, class: bad ? "error" : "" }, [
      cell(fmtTime(e.created_at)),
      cell(ALERT_NAMES[e.type] ?? e.type, bad ? "bad" : ""),
      cell(d.scope),
      cell(subjectName(directory, d)),
      cell(d.threshold === null || d.threshold === undefined ? "" : `${d.threshold}%`, "num"),
      cell(money(d.spent), "num"),
      cell(money(d.credit_limit), "num"),
    ]);
  });
  $("alerts-body").replaceChildren(...rows);
  stack($("alerts"), 1);
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
    const who = whoCell(directory, e);
    const statusText = e.http_status ? `${e.status} (${e.http_status})` : e.status;
    const clamped = e.max_tokens_clamped;
    const statusCell = cell(statusText, error ? "bad" : "ok");
    if (clamped !== null && clamped !== undefined) {
      statusCell.append(html("span", { class: "tag", title: "max_tokens was lowered to fit the credit left" }, [
        `max_tokens clamped to ${Money.count(clamped)}`,
      ]));
      statusCell.dataset.csv = `${statusText}; max_tokens clamped to ${clamped}`;
    }
    // How it was asked: streamed, and through the Responses API rather than chat completions.
    const mode = [e.stream ? "stream" : "", e.endpoint === "responses" ? "responses" : ""].filter(Boolean).join(" · ");
    const modelCell = cell(e.model);
    modelCell.append(html("span", { class: "sub" }, [`${e.provider}${mode ? " · " + mode : ""}`]));
    modelCell.dataset.csv = `${e.model} (${e.provider}${mode ? ", " + mode.replace(" · ", ", ") : ""})`;
    return html("tr", {
      "data-id": e.id,
      "data-clamped": clamped ?? "",
      class: [error ? "error" : "", clamped !== null && clamped !== undefined ? "clamped" : ""].join(" ").trim(),
    }, [
      cell(fmtTime(e.created_at, { seconds: true })),
      who,
      cell(e.end_user ?? "", "end-user"),
      tagsCell(e.tags ?? {}),
      modelCell,
      statusCell,
      cell(details.length ? `${tokens} (${details.join(", ")})` : tokens, "num"),
      cell(Money.format(Money.parse(e.cost)), "num"),
      cell(e.latency_ms === null ? "" : `${Money.count(e.latency_ms)} ms`, "num"),
    ]);
  });
  const body = $("recent-body");
  body.replaceChildren(...rows);
  $("recent").dataset.rows = String(rows.length);
  $("recent-empty").hidden = rows.length > 0;
  const clamps = events.filter((e) => e.max_tokens_clamped !== null && e.max_tokens_clamped !== undefined).length;
  $("recent-caption").textContent = events.length
    ? `the last ${events.length} requests${filtered() ? " within the filters" : ""}` +
      (clamps ? ` · ${clamps} had max_tokens clamped to fit the credit left` : "")
    : "";
}

/** An event's tags, one "key: value" chip each (in CSV: the JSON object, as /v1/usage writes it). */
function tagsCell(tags) {
  const pairs = Object.entries(tags).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  const td = html("td", { class: "tags" }, pairs.map(([k, v]) =>
    html("span", { class: "chip", "data-tag": `${k}:${v}` }, [`${k}: ${v}`])));
  td.dataset.csv = pairs.length ? JSON.stringify(Object.fromEntries(pairs)) : "";
  return td;
}

/** Team, user and token of a row, on two lines (one cell of CSV). */
function whoCell(directory, row) {
  const team = row.team_name ?? teamName(directory, row.team_id);
  const user = row.user_email ?? userName(directory, row.user_id);
  const token = tokenLabel(directory, row.token_id, row.token_name);
  const td = html("td", {}, [user, html("span", { class: "sub" }, [`${team} · ${token}`])]);
  td.dataset.csv = `${team} / ${user} / ${token}`;
  return td;
}

function filtered() {
  const f = state.filters;
  return Object.keys(FILTERS).some((k) => f[k]) || Boolean(f.end_user) || f.tags.length > 0;
}

/** An empty panel's text: what to do about it. */
function emptyText(what) {
  return filtered() ? `${what} within these filters: clear them or pick a longer range` : `${what}: send requests with a token, or pick a longer range`;
}

/** Which level the drill-down shows: teams, a team's users, a user's tokens, a token's models. */
function drillLevel() {
  const f = state.filters;
  if (f.token) return "model";
  if (f.user) return "token";
  if (f.team) return "user";
  return "team";
}

const DRILL_KEY = { team: "team_id", user: "user_id", token: "token_id", model: "model" };

function drawDrill(level, report, directory) {
  const key = DRILL_KEY[level];
  const total = Money.parse(report.total.cost);
  const name = (r) => {
    if (level === "team") return r.team_name ?? teamName(directory, r.team_id);
    if (level === "user") return r.user_email ?? userName(directory, r.user_id);
    if (level === "token") return tokenLabel(directory, r.token_id, r.token_name);
    return r.model;
  };
  const rows = [...report.rows]
    .map((r) => ({ ...r, pico: Money.parse(r.cost) }))
    .sort((a, b) => compareDesc(a.pico, b.pico));
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  $("drill-body").replaceChildren(
    ...rows.map((r) => {
      const id = r[key];
      const label = name(r);
      const canDrill = id !== null && !(level === "model" && state.filters.model === id);
      const button = html("button", { type: "button", class: "drill", "data-level": level, "data-key": id ?? "" }, [label]);
      if (!canDrill) button.disabled = true;
      button.addEventListener("click", () => drillInto(level, id));
      const first = html("td", {}, [button]);
      first.dataset.csv = label;
      return html("tr", { "data-key": id ?? "", "data-cost": Money.plain(r.pico) }, [
        first,
        cell(Money.count(r.requests), "num"),
        cell(Money.format(r.pico), "num"),
        cell(Money.percent(r.pico, total), "num"),
      ]);
    }),
  );
  $("drill").dataset.rows = String(rows.length);
  $("drill").dataset.level = level;
  $("drill-level").textContent = level;
  $("drill-name").textContent = level;
  const empty = $("drill-empty");
  empty.hidden = rows.length > 0;
  empty.textContent = emptyText("nothing spent in this range");
  drawCrumbs(directory);
}

function drawCrumbs(directory) {
  const f = state.filters;
  const parts = [];
  const link = (label, apply) => {
    const a = html("a", { role: "button", tabindex: "0" }, [label]);
    a.addEventListener("click", () => { apply(); changed(); });
    return a;
  };
  parts.push(link("all teams", () => Object.assign(f, { team: null, user: null, token: null })));
  if (f.team) parts.push(" › ", link(teamName(directory, f.team), () => Object.assign(f, { user: null, token: null })));
  if (f.user) parts.push(" › ", link(userName(directory, f.user), () => Object.assign(f, { token: null })));
  if (f.token) parts.push(" › ", html("span", {}, [tokenName(directory, f.token)]));
  $("crumbs").replaceChildren(...parts);
}

function drillInto(level, id) {
  const f = state.filters;
  const directory = state.directory;
  if (level === "team") Object.assign(f, { team: id, user: null, token: null });
  else if (level === "user") Object.assign(f, { team: teamOfUser(directory, id) ?? f.team, user: id, token: null });
  else if (level === "token") Object.assign(f, { user: userOfToken(directory, id) ?? f.user, token: id });
  else f.model = id;
  changed();
}

const REASONS = {
  budget: "budget (402)",
  rpm: "requests per minute (429)",
  tpm: "tokens per minute (429)",
  parallel: "in flight (429)",
  model: "model not allowed (403)",
};

/** A refusal's message with names and times as the page shows them (the API's own text in the
 * tooltip). */
function whyCell(directory, r) {
  const known = {};
  if (r.token_id && r.token_name) known[r.token_id] = tokenLabel(directory, r.token_id, r.token_name);
  if (r.user_id && r.user_email) known[r.user_id] = r.user_email;
  if (r.team_id && r.team_name) known[r.team_id] = r.team_name;
  const text = humanize(directory, r.message, known);
  return html("td", { class: "why", title: r.message }, [text]);
}

/** On a phone a table.stack's rows are cards: each cell says its column's name (data-label);
 * the cells given first (by index) come first. */
function stack(table, ...first) {
  const names = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
  for (const row of table.tBodies[0].rows) {
    [...row.cells].forEach((td, i) => {
      td.dataset.label = names[i] ?? "";
      if (first.includes(i)) td.classList.add("first");
      if (!td.querySelector(":scope > .v")) {
        const value = html("span", { class: "v" });
        value.append(...td.childNodes);
        td.append(value);
      }
    });
  }
}

function drawRefused(summary, page, directory) {
  const counts = summary.rows.map((r) => `${Money.count(r.refusals)} × ${REASONS[r.reason] ?? r.reason}`);
  $("refusal-counts").textContent = summary.total.refusals
    ? `${Money.count(summary.total.refusals)} in this range: ${counts.join(", ")}`
    : "none in this range";
  $("refusal-counts").dataset.total = String(summary.total.refusals);
  const cell = (content, cls) => html("td", cls ? { class: cls } : {}, [content ?? ""]);
  $("refused-body").replaceChildren(
    ...page.data.map((r) =>
      html("tr", { "data-id": r.id, "data-reason": r.reason }, [
        cell(fmtTime(r.created_at, { seconds: true })),
        whoCell(directory, r),
        cell(r.model),
        cell(`${REASONS[r.reason] ?? r.reason} · ${r.scope}`),
        cell(String(r.http_status), "bad"),
        whyCell(directory, r),
      ]),
    ),
  );
  stack($("refused"), 3, 4);
  $("refused").dataset.rows = String(page.data.length);
  $("refused-empty").hidden = page.data.length > 0;
}

/** The filter selects: what the key may see, narrowed by the filters above each. */
function drawFilters(directory) {
  const f = state.filters;
  const fill = (select, all, options, value) => {
    const node = $(select);
    const known = new Set(options.map(([v]) => v));
    if (value && !known.has(value)) options.push([value, value]);
    node.replaceChildren(
      html("option", { value: "" }, [all]),
      ...options.map(([v, label]) => html("option", { value: v }, [label])),
    );
    node.value = value ?? "";
  };
  let teams = [...directory.teams.values()].map((t) => [t.id, t.name]);
  if (state.who.mode === "user" && state.who.me) teams = [[state.who.me.team_id, teamName(directory, state.who.me.team_id)]];
  teams.sort((a, b) => a[1].localeCompare(b[1]));
  const users = [...directory.users.values()]
    .filter((u) => !f.team || u.team_id === f.team)
    .map((u) => [u.id, u.email])
    .sort((a, b) => a[1].localeCompare(b[1]));
  const tokens = [...directory.tokens.values()]
    .filter((t) => (!f.user || t.user_id === f.user) && (!f.team || teamOfUser(directory, t.user_id) === f.team))
    .map((t) => [t.id, `${tokenName(directory, t.id)}${t.revoked_at ? " (revoked)" : ""}`])
    .sort((a, b) => a[1].localeCompare(b[1]));
  fill("filter-team", "all teams", teams, f.team);
  fill("filter-user", "all users", users, f.user);
  fill("filter-token", "all tokens", tokens, f.token);
  fill("filter-model", "all models", state.models.map((m) => [m, m]), f.model);
  $("filter-end-user").value = f.end_user ?? "";
  $("tag-chips").replaceChildren(...f.tags.map((tag) => {
    const chip = html("button", { type: "button", class: "chip", "data-tag": tag, title: "remove this filter" }, [`${tag} ×`]);
    chip.addEventListener("click", () => {
      f.tags = f.tags.filter((t) => t !== tag);
      changed();
    });
    return chip;
  }));
  const shown = Object.keys(FILTERS).filter((k) => f[k]);
  const parts = shown.map((k) => `${k} ${$(`filter-${k}`).selectedOptions[0]?.textContent ?? f[k]}`);
  const narrowed = [];
  if (f.end_user) narrowed.push(`end user ${f.end_user}`);
  if (f.tags.length) narrowed.push(`tag${f.tags.length > 1 ? "s" : ""} ${f.tags.join(" and ")}`);
  let note = parts.length ? `every panel shows only: ${parts.join(", ")}` : "";
  if (narrowed.length) {
    note += `${note ? "; " : ""}spend and requests only: ${narrowed.join(", ")} ` +
      "(budgets, limits and refusals are kept by team, user and token)";
  }
  $("filters-note").textContent = note || "showing everything this key may see";
  $("filters-clear").disabled = !filtered();
  $("tz-note").textContent = zoneNote();
  document.body.dataset.filters = query(filterParams());
  document.body.dataset.tz = state.prefs.tz;
}

/** A filter or preference changed: into the URL (never the key), then a refresh. */
function changed() {
  writeUrl();
  refresh();
}

const URL_PREFS = { range: "24h", group: "team", tz: "utc" };
// The admin console's own parameters (admin.js: its tab and its search), kept as they are.
const CONSOLE_PARAMS = ["manage", "q"];

/** A group the page knows: team, model, provider, end_user or tag:<key>; else null. */
function validGroup(value) {
  if (typeof value !== "string") return null;
  if (PLAIN_GROUPS.includes(value)) return value;
  if (value.startsWith("tag:") && value.length > 4 && value.length <= 4 + MAX_TEXT) return value;
  return null;
}

/** A tag filter as typed: "key:value" with a key (the value may be empty); else null. */
function validTag(value) {
  const text = (value ?? "").trim();
  const colon = text.indexOf(":");
  return colon > 0 && text.length <= MAX_TEXT ? text : null;
}

/** The group-by controls as the preference says: the select, and the tag key when by a tag. */
function showGroup() {
  const group = state.prefs.group;
  const byTag = group.startsWith("tag:");
  $("group").value = byTag ? "tag" : group;
  $("group-tag-label").hidden = !byTag;
  if (byTag) $("group-tag").value = group.slice(4);
}

function writeUrl() {
  const params = {};
  for (const [name, fallback] of Object.entries(URL_PREFS)) {
    if (state.prefs[name] !== fallback) params[name] = state.prefs[name];
  }
  if (state.prefs.range === "custom") Object.assign(params, { from: state.prefs.from, to: state.prefs.to });
  for (const name of Object.keys(FILTERS)) {
    if (state.filters[name]) params[name] = state.filters[name];
  }
  if (state.filters.end_user) params.end_user = state.filters.end_user;
  if (state.filters.tags.length) params.tag = state.filters.tags;
  const current = new URLSearchParams(location.search);
  for (const name of CONSOLE_PARAMS) if (current.has(name)) params[name] = current.get(name);
  const search = query(params);
  history.replaceState(null, "", `${location.pathname}${search ? "?" + search : ""}`);
}

function readUrl() {
  const params = new URLSearchParams(location.search);
  if (params.get("range") === "custom") {
    if (validSpan(params.get("from"), params.get("to"))) {
      Object.assign(state.prefs, { range: "custom", from: params.get("from"), to: params.get("to") });
    }
  } else if (params.get("range") in RANGES) state.prefs.range = params.get("range");
  state.prefs.group = validGroup(params.get("group")) ?? state.prefs.group;
  if (["utc", "local"].includes(params.get("tz"))) state.prefs.tz = params.get("tz");
  for (const name of Object.keys(FILTERS)) {
    const value = params.get(name);
    if (value && value.length <= MAX_TEXT) state.filters[name] = value;
  }
  const endUser = params.get("end_user");
  if (endUser && endUser.length <= MAX_TEXT) state.filters.end_user = endUser;
  const tags = params.getAll("tag").map(validTag).filter((t) => t !== null);
  state.filters.tags = [...new Set(tags)].slice(0, MAX_TAG_FILTERS);
}

/** A table as CSV, as it is on screen (a cell's data-csv where it shows more than one line). */
function tableCsv(table) {
  const escape = (text) => {
    let value = text.replace(/\s+/g, " ").trim();
    // A cell a spreadsheet would run as a formula gets a leading quote (OWASP), as the API does.
    if (/^[=+\-@\t\r]/.test(value) && !/^[+-]?\d+(\.\d+)?$/.test(value)) value = `'${value}`;
    return /[",\n]/.test(value) ? `"${value.replace(/"/g, '""')}"` : value;
  };
  const lines = [];
  for (const row of table.querySelectorAll("tr")) {
    const cells = [...row.children].map((c) => escape(c.dataset.csv ?? c.textContent ?? ""));
    lines.push(cells.join(","));
  }
  return lines.join("\r\n") + "\r\n";
}

function exportCsv(id) {
  const text = tableCsv($(id));
  const stamp = fmtTime(new Date()).replace(/[ :]/g, "-");
  const link = html("a", { download: `metering-${id}-${stamp}.csv` });
  link.href = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
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
  drawFilters(directory);
  drawGrouped(state.data.grouped, directory, group);
  suggest(recent.data, state.data.grouped, group);
  drawDrill(state.data.level, state.data.drill, directory);
  drawRefused(state.data.refusalSummary, state.data.refusalPage, directory);
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
  document.body.dataset.end = range.end ?? "";
}

/** What the end-user, tag and tag-key inputs suggest: what the recent requests and the
 * spend-by-end-user table hold. */
function suggest(events, grouped, group) {
  const endUsers = events.map((e) => e.end_user);
  if (group === "end_user" && !grouped.error) endUsers.push(...grouped.rows.map((r) => r.end_user));
  fillList("end-users", endUsers.filter((v) => v !== null && v !== undefined));
  const pairs = events.flatMap((e) => Object.entries(e.tags ?? {}));
  fillList("tag-pairs", pairs.map(([k, v]) => `${k}:${v}`));
  fillList("tag-keys", pairs.map(([k]) => k));
}

// --- the refresh cycle ---------------------------------------------------------------------------

/** A report that may be refused (a 400 for a view too large, say): its error instead of it, so
 * the panel says why and the rest of the page still draws. A refused key (401) stays fatal. */
async function orError(promise) {
  try {
    return await promise;
  } catch (error) {
    if (!(error instanceof ApiError) || error.status === 401) throw error;
    return { error };
  }
}

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
    const level = drillLevel();
    const filters = filterParams();
    const who = whoParams(); // refusals are kept by team, user, token and model only
    const noGroup = Promise.resolve({ rows: [], total: { cost: "0" }, row_count: 0 });
    const [byTime, byModel, byToken, recent, budgets, limits, refusals, drill, refusalSummary, refusalPage, alerts, grouped] =
      await Promise.all([
        orError(spend(range, `${unit},${group}`)),
        spend(range, "model"),
        spend(range, "token"),
        api(`/v1/usage?${query({ limit: RECENT, ...(range.end ? { start: range.start, end: range.end } : {}), ...filters })}`),
        budgetRows(directory),
        limitRows(directory),
        limitRefusals(),
        spend(range, level, { labels: "true" }),
        api(`/v1/refusals/summary?${query({ start: range.start, end: range.end, group_by: "reason", ...who })}`),
        api(`/v1/refusals?${query({ start: range.start, end: range.end, limit: REFUSALS_SHOWN, labels: "true", ...who })}`),
        api(`/v1/alerts?${query({ limit: RECENT_ALERTS })}`),
        isAttribution(group) ? orError(spend(range, group, { limit: GROUPED_ROWS })) : noGroup,
      ]);
    if (generation !== state.generation) return; // a newer refresh has started
    state.data = {
      range, group, directory, byTime, byModel, byToken, recent, budgets, limits, refusals,
      level, drill, refusalSummary, refusalPage, alerts, grouped,
    };
    draw();
    status(`updated ${fmtTime(new Date(), { seconds: true, date: false })} (${state.prefs.tz === "local" ? "local time" : "UTC"})`);
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
    if (saved.range === "custom" ? validSpan(saved.from, saved.to) : saved.range in RANGES) {
      Object.assign(state.prefs, { range: saved.range, from: saved.from ?? null, to: saved.to ?? null });
    }
    state.prefs.group = validGroup(saved.group) ?? state.prefs.group;
    if ([0, 10, 30, 60].includes(Number(saved.refresh))) state.prefs.refresh = Number(saved.refresh);
    if (["utc", "local"].includes(saved.tz)) state.prefs.tz = saved.tz;
  } catch {
    // unreadable preferences: keep the defaults
  }
  readUrl(); // a shared link's view wins over this tab's last one
  $("tz").value = state.prefs.tz;
  showRange();
  showGroup();
  $("refresh-every").value = String(state.prefs.refresh);
}

/** The range controls as the preferences say: the select, and the dates of a custom range. */
function showRange() {
  $("range").value = state.prefs.range;
  $("custom-range").hidden = state.prefs.range !== "custom";
  $("range-from").value = state.prefs.from ?? "";
  $("range-to").value = state.prefs.to ?? "";
  const today = new Date().toISOString().slice(0, 10);
  $("range-from").max = today;
  $("range-to").max = today;
}

/** A range chosen: a named one, or custom dates (the last 7 UTC days until both are chosen). */
function chooseRange(name) {
  if (name === "custom") {
    let from = $("range-from").value || state.prefs.from;
    let to = $("range-to").value || state.prefs.to;
    if (!from || !to) {
      const today = new Date();
      to = today.toISOString().slice(0, 10);
      from = new Date(today.getTime() - 6 * DAY_MS).toISOString().slice(0, 10);
    }
    if (!validSpan(from, to)) {
      status(`a custom range runs from a day to the same or a later one, at most ${MAX_CUSTOM_DAYS} days: not ${from} to ${to}`, "error");
      showRange();
      return;
    }
    Object.assign(state.prefs, { range: "custom", from, to });
  } else {
    state.prefs.range = name;
  }
  showRange();
  savePrefs();
  changed();
}

function groupBy(group) {
  state.prefs.group = group;
  savePrefs();
  changed();
}

/** The tag filter input's key:value, added to the filters (all must match). */
function addTag(input) {
  const text = input.value.trim();
  if (!text) return;
  const tag = validTag(text);
  if (tag === null) {
    status(`a tag filter is key:value (the key, a colon, its value), not ${JSON.stringify(text)}`, "error");
    return;
  }
  input.value = "";
  if (state.filters.tags.includes(tag) || state.filters.tags.length >= MAX_TAG_FILTERS) return;
  state.filters.tags = [...state.filters.tags, tag];
  changed();
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
  $("range").addEventListener("change", (event) => chooseRange(event.target.value));
  for (const id of ["range-from", "range-to"]) {
    $(id).addEventListener("change", () => chooseRange("custom"));
  }
  for (const [id, pref] of [["refresh-every", "refresh"], ["tz", "tz"]]) {
    $(id).addEventListener("change", (event) => {
      state.prefs[pref] = pref === "refresh" ? Number(event.target.value) : event.target.value;
      savePrefs();
      changed();
    });
  }
  for (const name of Object.keys(FILTERS)) {
    $(`filter-${name}`).addEventListener("change", (event) => {
      const value = event.target.value || null;
      const f = state.filters;
      const directory = state.directory;
      if (name === "team") Object.assign(f, { team: value, user: null, token: null });
      else if (name === "user") Object.assign(f, { user: value, token: null, team: value ? teamOfUser(directory, value) ?? f.team : f.team });
      else if (name === "token") {
        const user = value ? userOfToken(directory, value) : null;
        Object.assign(f, { token: value, user: user ?? f.user, team: user ? teamOfUser(directory, user) ?? f.team : f.team });
      } else f.model = value;
      changed();
    });
  }
  $("group").addEventListener("change", (event) => {
    const byTag = event.target.value === "tag";
    $("group-tag-label").hidden = !byTag;
    const group = byTag ? validGroup(`tag:${$("group-tag").value.trim()}`) : event.target.value;
    if (group === null) {
      $("group-tag").focus(); // by a tag: which key? The choice is made when one is typed.
      return;
    }
    groupBy(group);
  });
  $("group-tag").addEventListener("change", (event) => {
    const group = validGroup(`tag:${event.target.value.trim()}`);
    if (group !== null && group !== state.prefs.group) groupBy(group);
  });
  $("filter-end-user").addEventListener("change", (event) => {
    const value = event.target.value.trim() || null;
    if (value === state.filters.end_user) return;
    state.filters.end_user = value;
    changed();
  });
  $("filter-tag").addEventListener("keydown", (event) => {
    if (event.key === "Enter") addTag(event.target);
  });
  $("filter-tag").addEventListener("change", (event) => addTag(event.target));
  $("filters-clear").addEventListener("click", () => {
    Object.assign(state.filters, { team: null, user: null, token: null, model: null, end_user: null, tags: [] });
    changed();
  });
  for (const button of document.querySelectorAll("button.csv")) {
    button.addEventListener("click", () => exportCsv(button.dataset.table));
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

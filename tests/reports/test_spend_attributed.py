"""GET /v1/spend by end user and by tag: every grouping and filter equals the ledger's own sums
(events written through the ledger's writer, some folded into the rollups and some still
pending, adjustments among them), JSON and CSV, over whole days and over partial days at the
range's edges; requests without an end user or tag land in the null row; a user sees its own
spend only; bad parameters and too wide a grouping are 400s."""

import asyncio
import contextlib
import csv
import dataclasses
import io
import json
import random
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from metering import migrate
from metering.db import Database
from metering.ledger import rollup, writer
from metering.ledger.event import ADJUSTMENT, Event
from metering.reports import spend as spend_module
from metering.reports.attributed import Attributes, parse_tags
from tests.budgets.conftest import new_pg_database

END_USERS = ("cust-a", "cust-b", "cust:c", None)
TAGS = (
    {},
    {"project": "alpha"},
    {"feature": "chat", "project": "beta"},
    {"feature": "search"},
    {"feature": "chat", "project": "alpha"},
    {"project": "a:b"},
)
ROUTES = (("gpt-sim", "sim-openai"), ("glm-5", "sim-genesis"), ("gpt-sim", "sim-exascale"))
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")
MONEY = ("cost", "uncharged", "adjustments")
PLAIN = {"team": "team_id", "user": "user_id", "token": "token_id", "model": "model"}
PLAIN |= {"provider": "provider", "end_user": "end_user"}


def rfc(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def make_event(rng: random.Random, who: tuple, created: datetime, **values) -> Event:
    team_id, user_id, token_id = who
    model, provider = rng.choice(ROUTES)
    prompt, completion = rng.randrange(1, 5000), rng.randrange(0, 2000)
    cached = rng.randrange(0, prompt) if rng.random() < 0.3 else 0
    tags = rng.choice(TAGS)
    event = {
        "id": f"req_{uuid.uuid4().hex}",
        "created_at": created,
        "started_at": created - timedelta(seconds=1),
        "token_id": token_id,
        "user_id": user_id,
        "team_id": team_id,
        "model": model,
        "provider": provider,
        "upstream_model": model,
        "upstream_id": None,
        "stream": False,
        "status": "ok",
        "http_status": 200,
        "finish_reason": "stop",
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cached_tokens": cached,
        "text_tokens": None,
        "reasoning_tokens": rng.choice([None, completion // 3]),
        "audio_tokens": None,
        "image_tokens": None,
        "video_tokens": None,
        "accepted_prediction_tokens": None,
        "rejected_prediction_tokens": None,
        "usage_source": "reported",
        "usage_anomaly": None,
        "input_price": 150_000,
        "cached_price": 75_000,
        "output_price": 600_000,
        "cost": (prompt - cached) * 150_000 + cached * 75_000 + completion * 600_000,
        "uncharged": rng.choice([0, 0, 0, 12_345]),
        "ttft_ms": 10,
        "latency_ms": 100,
        "error": None,
        "end_user": rng.choice(END_USERS),
        "tags": json.dumps(tags, separators=(",", ":"), sort_keys=True),
    }
    return Event(**{**event, **values})


def adjustment(rng: random.Random, of: Event) -> Event:
    """A correction of `of`'s charge, attributed as it was, a little later."""
    amount = rng.choice([-1, 1]) * rng.randrange(1, of.cost + 2)
    return Event(
        **{
            **{name: getattr(of, name) for name in Event.__dataclass_fields__},
            "id": f"adj_{uuid.uuid4().hex}",
            "created_at": of.created_at + timedelta(seconds=1),
            "kind": ADJUSTMENT,
            "corrects_event_id": of.id,
            "reason": "test",
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "total_tokens": 0,
            "cached_tokens": 0,
            "reasoning_tokens": None,
            "cost": amount,
            "uncharged": 0,
        }
    )


@pytest.fixture(scope="module")
def traffic(api):
    """Events over three days and a bit of a past day of this run's own: the first two thirds
    folded into the rollups, the rest left pending."""
    rng = random.Random()
    base = datetime(2023, 1, 1, tzinfo=UTC) + timedelta(days=rng.randrange(360))
    people, keys = [], {}
    for _ in range(2):
        team = api.team()
        for _ in range(2):
            user = api.user(team["id"])
            token = api.token(user["id"])
            keys[user["id"]] = token["token"]
            people += [(team["id"], user["id"], token["id"]), (team["id"], user["id"], None)]
    events: list[Event] = []
    for i in range(360):
        created = base + timedelta(seconds=rng.randrange(3 * 86400 + 7 * 3600))
        if i % 23 == 0:
            created = created.replace(hour=0, minute=0, second=0, microsecond=0)
        events.append(make_event(rng, rng.choice(people), created))
    events += [adjustment(rng, e) for e in rng.sample(events, 20)]
    # End users with adjustments only: one whose adjustments cancel out (no row of a report)
    # and one whose do not (a row without a request).
    for end_user, amounts in (("cust-idle", (7, -7)), ("cust-credit", (-5,))):
        of = dataclasses.replace(rng.choice(events[:360]), end_user=end_user)
        events += [dataclasses.replace(adjustment(rng, of), cost=amount) for amount in amounts]
    rng.shuffle(events)

    async def write() -> None:
        db = Database(api.settings.database_url, pool_size=2)
        try:
            many = events[:-1]
            cut = len(many) * 2 // 3
            for start in range(0, len(many), 25):
                async with db.transaction() as session:
                    await writer.append_many(session, many[start : start + 25])
                if start + 25 == cut - cut % 25:
                    await rollup.fold(db)
            async with db.transaction() as session:
                await writer.append(session, events[-1])  # one alone, as a settle writes it
        finally:
            await db.dispose()

    events.append(make_event(rng, people[0], base + timedelta(hours=30), end_user="cust-a"))
    asyncio.run(write())
    return api, base, events, people, keys


def key_of(event: Event, key: str):
    if key == "day":
        return event.created_at.astimezone(UTC).strftime("%Y-%m-%d")
    if key == "hour":
        return event.created_at.astimezone(UTC).strftime("%Y-%m-%dT%H:00:00Z")
    if key.startswith("tag:"):
        return json.loads(event.tags).get(key[4:])
    return getattr(event, PLAIN[key])


def matches(event: Event, start, end, filters: dict, tags: list[str]) -> bool:
    if not start <= event.created_at < end:
        return False
    if any(getattr(event, k) != v for k, v in filters.items()):
        return False
    pairs = json.loads(event.tags)
    return all(pairs.get(t.partition(":")[0]) == t.partition(":")[2] for t in tags)


def expected(events, keys, start, end, filters=None, tags=()) -> dict:
    out: dict = defaultdict(lambda: dict.fromkeys(SUMS + MONEY, 0))
    for e in events:
        if not matches(e, start, end, filters or {}, list(tags)):
            continue
        sums = out[tuple(key_of(e, k) for k in keys)]
        adjusting = e.kind == ADJUSTMENT
        sums["requests"] += 0 if adjusting else 1
        sums["prompt_tokens"] += e.prompt_tokens
        sums["cached_tokens"] += e.cached_tokens
        sums["completion_tokens"] += e.completion_tokens
        sums["reasoning_tokens"] += e.reasoning_tokens or 0
        sums["cost"] += e.cost
        sums["uncharged"] += e.uncharged
        sums["adjustments"] += e.cost if adjusting else 0
    return {k: v for k, v in out.items() if v["requests"] or v["adjustments"]}


def row_name(key: str) -> str:
    return key if key.startswith("tag:") or key in ("day", "hour") else PLAIN[key]


def reported(rows, keys) -> dict:
    out = {}
    for row in rows:
        key = tuple(row[row_name(k)] or None for k in keys)
        assert key not in out, key
        sums = {m: int(row[m]) for m in SUMS}
        sums |= {m: int(Decimal(row[m]) * 10**12) for m in MONEY}
        out[key] = sums
    return out


def spend(api, keys, start, end, filters=None, tags=(), fmt="json", key=None):
    params = {"start": rfc(start), "end": rfc(end), "group_by": ",".join(keys), "limit": 100_000}
    params |= {"format": fmt, **(filters or {})}
    params = [*params.items(), *(("tag", t) for t in tags)]
    response = api.request("GET", "/v1/spend", params=params, key=key)
    assert response.status_code == 200, response.text
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(response.text)))
        assert list(rows[0])[: len(keys)] == [row_name(k) for k in keys] if rows else True
        return rows
    body = response.json()
    assert body["group_by"] == keys
    return body["rows"]


GROUPINGS = [
    ["end_user"],
    ["tag:project"],
    ["end_user", "day"],
    ["day", "tag:feature"],
    ["tag:project", "model"],
    ["team", "tag:feature", "provider"],
    ["end_user", "token"],
    ["user", "end_user", "team"],
    ["end_user", "model"],  # the ledger: no rollup has the model of an end user's spend
    ["end_user", "tag:project"],  # the ledger
    ["tag:project", "tag:feature"],  # the ledger
    ["end_user", "hour"],  # the ledger
    ["token", "day"],
]
FILTERS = [
    ({}, ()),
    ({"end_user": "cust-a"}, ()),
    ({"end_user": "cust:c"}, ()),
    ({}, ("project:alpha",)),
    ({}, ("project:a:b",)),
    ({}, ("project:alpha", "feature:chat")),
    ({"end_user": "cust-b"}, ("feature:chat",)),
    ({"model": "gpt-sim"}, ("project:beta",)),
]


def ranges(base: datetime) -> list[tuple[datetime, datetime]]:
    return [
        (base, base + timedelta(days=4)),  # whole days
        (base + timedelta(hours=2, minutes=17), base + timedelta(days=2, hours=5, seconds=3)),
        (base + timedelta(hours=26), base + timedelta(hours=27, minutes=30)),  # within a day
    ]


@pytest.mark.parametrize(("filters", "tags"), FILTERS, ids=lambda v: repr(v))
def test_every_grouping_and_filter_equals_the_ledgers_sums(traffic, filters, tags):
    api, base, events, people, _ = traffic
    team = {"team_id": people[0][0]}
    for start, end in ranges(base):
        for keys in GROUPINGS:
            for scope in ({}, team):
                wanted = expected(events, keys, start, end, {**filters, **scope}, tags)
                got = reported(spend(api, keys, start, end, {**filters, **scope}, tags), keys)
                assert got == wanted, (keys, filters, tags, start, end)


def test_pages_carry_the_whole_reports_row_count_and_totals(traffic):
    """Pages smaller than the report (on PostgreSQL, its count and totals found apart from the
    page): every page carries the whole report's row count and totals, and the pages walked
    in order are the report, end users with adjustments only counted as the ledger's sums say."""
    api, base, events, people, _ = traffic
    keyed = [["end_user"], ["tag:project"], ["end_user", "day"], ["user", "end_user", "team"]]
    for start, end in ranges(base)[:2]:
        for keys in keyed:
            wanted = expected(events, keys, start, end)
            totals = {m: sum(v[m] for v in wanted.values()) for m in SUMS + MONEY}
            rows, page = [], 1
            while page is not None:
                params = {"start": rfc(start), "end": rfc(end), "group_by": ",".join(keys)}
                response = api.request(
                    "GET", "/v1/spend", params={**params, "limit": 2, "page": page}
                )
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["row_count"] == len(wanted), (keys, start, end)
                got = reported([body["total"]], [])[()]
                assert got == totals, (keys, start, end)
                assert len(body["rows"]) <= 2
                rows += body["rows"]
                page = body["next_page"]
            assert reported(rows, keys) == wanted, (keys, start, end)
    whole = expected(events, ["end_user"], base, base + timedelta(days=4))
    assert ("cust-idle",) not in whole and whole[("cust-credit",)]["requests"] == 0


def test_csv_carries_the_new_keys_and_equals_the_json(traffic):
    api, base, events, people, _ = traffic
    start, end = ranges(base)[1]
    for keys in (["end_user", "day"], ["tag:project", "model"], ["end_user", "tag:feature"]):
        rows = spend(api, keys, start, end, fmt="csv")
        assert reported(rows, keys) == expected(events, keys, start, end)
        assert reported(rows, keys) == reported(spend(api, keys, start, end), keys)


def test_requests_without_an_end_user_or_the_tag_land_in_the_null_row(traffic):
    api, base, events, people, _ = traffic
    start, end = base, base + timedelta(days=4)
    rows = spend(api, ["end_user"], start, end, {"team_id": people[0][0]})
    nulls = [r for r in rows if r["end_user"] is None]
    wanted = expected(events, ["end_user"], start, end, {"team_id": people[0][0]})
    assert len(nulls) == 1 and nulls[0]["requests"] == wanted[(None,)]["requests"] > 0
    rows = spend(api, ["tag:project"], start, end)
    [null] = [r for r in rows if r["tag:project"] is None]
    assert null["requests"] == expected(events, ["tag:project"], start, end)[(None,)]["requests"]
    assert {r["tag:project"] for r in rows} == {None, "alpha", "beta", "a:b"}


def test_a_user_sees_its_own_spend_by_end_user_and_tag_only(traffic):
    api, base, events, people, keys = traffic
    start, end = ranges(base)[1]
    user_id = people[0][1]
    for group in (["end_user"], ["tag:project", "user"]):
        mine = reported(spend(api, group, start, end, key=keys[user_id]), group)
        assert mine == expected(events, group, start, end, {"user_id": user_id})
    other = api.request(
        "GET",
        "/v1/spend",
        key=keys[user_id],
        params={"group_by": "end_user", "user_id": people[2][1]},
    )
    assert other.status_code == 403


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"tag": "nocolon"}, "tag"),
        ({"tag": ":value"}, "tag"),
        ({"tag": "k" * 65 + ":v"}, "tag"),
        ({"tag": "k:" + "v" * 513}, "tag"),
        ({"tag": [f"k{i}:v" for i in range(17)]}, "tag"),
        ({"tag": "k:v\x00"}, "tag"),
        ({"group_by": "tag:"}, "group_by"),
        ({"group_by": "tag:" + "k" * 65}, "group_by"),
        ({"group_by": "customer"}, "group_by"),
        ({"end_user": "e" * 257}, "end_user"),
        ({"end_user": "a\x01b"}, "end_user"),
    ],
)
def test_bad_parameters_are_400s_naming_them(api, params, param):
    response = api.request("GET", "/v1/spend", params=params)
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_a_grouping_too_wide_is_refused(traffic):
    api, base, events, people, _ = traffic
    params = {"start": "2019-01-01T00:00:00Z", "end": rfc(base + timedelta(days=4))}
    for group_by in ("end_user,hour", "tag:project,hour", "tag:feature,tag:project,hour"):
        response = api.request("GET", "/v1/spend", params={**params, "group_by": group_by})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("report_too_large", "group_by")
    narrow = {**params, "group_by": "end_user,day", "team_id": people[0][0]}
    assert api.request("GET", "/v1/spend", params=narrow).status_code == 200


# --- the report's statement on a database of its own: nothing folds but the test -----------

DIRECT = [
    ["end_user"],
    ["tag:project", "day"],
    ["tag:project", "hour"],  # spend_hourly_tag, whole hours
    ["end_user", "team", "day"],
    ["tag:feature", "model"],
    ["end_user", "tag:project"],
]
DIRECT_FILTERS = [({}, ()), ({"end_user": "cust-a"}, ()), ({}, ("project:alpha",))]


async def _direct_report(db: Database, keys, start, end, filters, tags) -> dict:
    sql_keys, grouped = spend_module.keys_of(spend_module.parse_group_by(",".join(keys)))
    attrs = Attributes(grouped.tag_keys, filters.get("end_user"), parse_tags(list(tags)))
    plain = {k: v for k, v in filters.items() if k != "end_user"}
    query = spend_module.spend_query(db.dialect, sql_keys, plain, start, end, attrs)
    async with db.sessions() as session:
        rows = (await session.execute(query)).mappings().all()
    return {tuple(row[k] for k in sql_keys): {m: int(row[m]) for m in SUMS + MONEY} for row in rows}


async def _assert_exact(db: Database, events, base: datetime, edges: bool = True) -> None:
    """Every DIRECT report equals the events' sums over three whole days and, with `edges`,
    over a range with partial days at both ends (read from the ledger there)."""
    spans = [(base, base + timedelta(days=3))]
    if edges:
        spans.append((base + timedelta(hours=5), base + timedelta(days=2)))
    for start, end in spans:
        for keys in DIRECT:
            for filters, tags in DIRECT_FILTERS:
                got = await _direct_report(db, keys, start, end, filters, tags)
                assert got == expected(events, keys, start, end, filters, tags), (keys, filters)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_reports_are_exact_while_pending_and_after_each_fold(backend, tmp_path):
    """The rollups alone, the pending increments alone, and both: the same sums."""
    rng = random.Random(11)
    base = datetime(2024, 5, 6, tzinfo=UTC)
    people = [("team_a", "usr_a", "tok_a"), ("team_a", "usr_a", None), ("team_b", "usr_b", "tok_b")]
    events = [
        make_event(rng, rng.choice(people), base + timedelta(seconds=rng.randrange(3 * 86400)))
        for _ in range(150)
    ]
    events += [adjustment(rng, e) for e in events[:12]]
    rng.shuffle(events)

    async def run(url: str) -> None:
        db = Database(url, pool_size=2)
        try:
            half = len(events) // 2
            async with db.transaction() as session:
                await writer.append_many(session, events[:half])
            # The partial days come from the ledger whatever is folded: checked once, below.
            await _assert_exact(db, events[:half], base, edges=False)  # all pending
            await rollup.fold(db)
            await _assert_exact(db, events[:half], base, edges=False)  # all folded
            for event in events[half:]:
                async with db.transaction() as session:
                    await writer.append(session, event)
            await _assert_exact(db, events, base)  # both
            await rollup.fold(db)
            await _assert_exact(db, events, base)
        finally:
            await db.dispose()

    with contextlib.ExitStack() as stack:
        if backend == "postgresql":
            url = stack.enter_context(new_pg_database())
        else:
            url = f"sqlite:///{tmp_path / 'attributed.db'}"
        migrate.upgrade(url)
        asyncio.run(run(url))


def test_spend_by_end_user_and_tag_through_the_proxy_equals_the_ledger(api):
    """Requests through the proxy with the `openai` SDK (the end user's header, `metadata`):
    the report by end user and by tag equals the ledger's events, on the settle path each
    database takes."""
    team, user, token = api.principal()
    client = api.openai(token["token"])
    calls = [
        ("alice", {"project": "p1"}),
        ("alice", {"project": "p2", "feature": "chat"}),
        ("bob", None),
        (None, {"project": "p1"}),
        (None, None),
    ]
    for end_user, metadata in calls:
        client.chat.completions.create(
            model="gpt-sim",
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-metering-end-user": end_user} if end_user else None,
            **({"metadata": metadata} if metadata else {}),
        )
    events = api.events(token_id=token["id"])
    assert sorted(
        (e["end_user"] or "", json.dumps(e["tags"], sort_keys=True)) for e in events
    ) == sorted((e or "", json.dumps(m or {}, sort_keys=True)) for e, m in calls)
    scope = {"token_id": token["id"]}
    for group, of in (("end_user", lambda e: e["end_user"]), ("tag:project", None)):
        if of is None:
            of = lambda e: e["tags"].get("project")  # noqa: E731
        wanted: dict = defaultdict(lambda: [0, Decimal(0)])
        for e in events:
            wanted[of(e)][0] += 1
            wanted[of(e)][1] += Decimal(e["cost"])
        for fmt in ("json", "csv"):
            params = {**scope, "group_by": group, "format": fmt}
            response = api.request("GET", "/v1/spend", params=params)
            assert response.status_code == 200, response.text
            if fmt == "json":
                rows = response.json()["rows"]
            else:
                rows = list(csv.DictReader(io.StringIO(response.text)))
            got = {(r[group] or None): [int(r["requests"]), Decimal(r["cost"])] for r in rows}
            assert got == {k: v for k, v in wanted.items()}, (group, fmt)
    both = api.ok("GET", "/v1/spend", params={**scope, "end_user": "alice", "tag": ["project:p1"]})
    assert both["total"]["requests"] == 1
    mine = api.ok(
        "GET", "/v1/spend", key=token["token"], params={"group_by": "end_user,tag:feature"}
    )
    assert {(r["end_user"], r["tag:feature"]) for r in mine["rows"]} == {
        ("alice", None),
        ("alice", "chat"),
        ("bob", None),
        (None, None),
    }


def test_a_report_by_tag_reads_whole_hours_from_the_hourly_tag_rollup():
    """A rolling range by one tag key (at most by team) reads the events of its partial hours
    only: its whole hours come from spend_hourly_tag; by user, the edge days from the events."""
    start = datetime(2024, 5, 6, 7, 30, tzinfo=UTC)
    end = start + timedelta(days=3)
    by_tag = Attributes(("project",))

    def tables(keys, filters=None, attrs=by_tag) -> set[str]:
        query = spend_module.spend_query("postgresql", keys, filters or {}, start, end, attrs)
        return set(str(query.compile()).split())

    for keys, filters in ((["tag_0"], {}), (["team_id", "tag_0"], {}), (["tag_0", "hour"], {})):
        assert "spend_hourly_tag" in tables(keys, filters), keys
    filtered = Attributes((), None, (("project", "alpha"),))
    assert "spend_hourly_tag" in tables(["team_id"], {"team_id": "team_a"}, filtered)
    assert "spend_hourly_tag" not in tables(["user_id", "tag_0"])
    assert "spend_hourly_tag" not in tables(["tag_0"], {"model": "gpt-sim"})

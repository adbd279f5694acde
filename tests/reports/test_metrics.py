"""GET /metrics: after known traffic the counters equal it, in one process and across the
workers of `metering serve --workers 2`; METERING_METRICS_KEY guards it when set, and only
behind it are the series that name a team, user or token."""

import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import free_port, metering_server
from tests.conftest import ADMIN_KEY, Api, catalog_for
from tests.reports.test_spend import own_pg  # noqa: F401 (a fixture)

SIM_KEYS = {"SIM_OPENAI_KEY": "sim-key", "SIM_EXASCALE_KEY": "sim-key"}
KINDS = ("prompt", "cached", "completion", "reasoning")
# The labels of the open scrape: routes, kinds and reasons; `scope` is token, user or team.
AGGREGATE_LABELS = {"model", "provider", "status", "kind", "scope", "reason", "path", "phase", "le"}


def scrape(url: str, key: str | None = None) -> dict:
    """Every sample of one scrape: {(name, sorted labels): value}."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    # A new connection each time: with several workers, any of them may answer.
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def traffic(api: Api, token: str) -> None:
    """3 plain and 2 streamed completions on two models."""
    client = api.openai(token)
    messages = [{"role": "user", "content": "count the metrics"}]
    for _ in range(3):
        client.chat.completions.create(model="gpt-sim", messages=messages)
    for _ in range(2):
        for _ in client.chat.completions.create(
            model="minimax-m2.1",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        ):
            pass


def assert_counts_equal_the_ledger(api: Api, before: dict, after: dict, token_id: str) -> None:
    events = api.events(token_id=token_id)
    assert len(events) == 5
    for model, provider, n in (("gpt-sim", "sim-openai", 3), ("minimax-m2.1", "sim-exascale", 2)):
        route = {"model": model, "provider": provider}
        mine = [e for e in events if e["model"] == model]
        assert delta(before, after, "metering_requests_total", **route, status="ok") == n
        tokens = {
            "prompt": sum(e["prompt_tokens"] for e in mine),
            "cached": sum(e["prompt_tokens_details"]["cached_tokens"] for e in mine),
            "completion": sum(e["completion_tokens"] for e in mine),
            "reasoning": sum(e["completion_tokens_details"]["reasoning_tokens"] or 0 for e in mine),
        }
        for kind in KINDS:
            got = delta(before, after, "metering_tokens_total", **route, kind=kind)
            assert got == tokens[kind], (model, kind)
        cost = sum(Decimal(e["cost"]) for e in mine)
        got = delta(before, after, "metering_cost_usd_total", **route)
        assert got == pytest.approx(float(cost), rel=1e-9)
        for histogram in (
            "metering_upstream_latency_seconds",
            "metering_time_to_first_token_seconds",
        ):
            assert delta(before, after, f"{histogram}_count", **route) == n, histogram
        latency = sum(e["latency_ms"] for e in mine) / 1000
        got = delta(before, after, "metering_upstream_latency_seconds_sum", **route)
        assert got == pytest.approx(latency, rel=1e-9)


def test_counters_equal_the_traffic(api):
    _, _, token = api.principal()
    before = scrape(api.url)
    traffic(api, token["token"])
    # The proxy's own time: once before each upstream call and once for each settle, in the
    # millisecond buckets.
    after = scrape(api.url)
    for phase in ("before_upstream", "settle"):
        assert delta(before, after, "metering_proxy_added_seconds_count", phase=phase) == 5
        assert delta(before, after, "metering_proxy_added_seconds_sum", phase=phase) > 0
    assert ("metering_proxy_added_seconds_bucket", (("le", "0.001"), ("phase", "settle"))) in after
    after = scrape(api.url)
    assert_counts_equal_the_ledger(api, before, after, token["id"])


def test_budget_rejections_count_by_scope(api):
    _, _, token = api.principal(user_limit="0.000001")
    before = scrape(api.url)
    response = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={
            "model": "gpt-sim",
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": "too dear"}],
        },
    )
    assert response.status_code == 402
    assert response.headers["x-budget-scope"] == "user"
    after = scrape(api.url)
    assert delta(before, after, "metering_budget_rejections_total", scope="user") == 1
    assert delta(before, after, "metering_budget_rejections_total", scope="token") == 0


def test_open_holds_is_read_from_the_database(tmp_path, sim):
    """On a database of its own: no hold, then the hold of a request under way, then none
    once it is settled."""
    url = f"sqlite:///{tmp_path / 'metering.db'}"
    migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
    server = metering_server(settings, parse_catalog(catalog_for(sim), environ=SIM_KEYS))
    try:
        api = Api(server.url, "sqlite", settings)
        _, _, token = api.principal()
        assert scrape(api.url)[("metering_open_holds", ())] == 0
        body = {
            "model": "gpt-sim",
            "stream": True,
            "messages": [
                {"role": "user", "content": "sim:tokens=20 sim:chunks=20 sim:delay_ms=50"}
            ],
        }
        headers = {"authorization": f"Bearer {token['token']}"}
        with httpx.stream(
            "POST", f"{api.url}/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as response:
            chunks = response.iter_bytes()  # kept: a generator collected closes the stream
            next(chunks)  # under way: its hold is written
            assert scrape(api.url)[("metering_open_holds", ())] == 1
            for _ in chunks:
                pass
        deadline = time.monotonic() + 10
        while scrape(api.url)[("metering_open_holds", ())] != 0:
            assert time.monotonic() < deadline, "the hold was never released"
            time.sleep(0.05)
        assert len(api.events(token_id=token["id"])) == 1
    finally:
        server.stop()


def test_a_metrics_key_is_required_when_set(api, sim):
    settings = Settings(
        database_url=api.settings.database_url,
        admin_key=ADMIN_KEY,
        metrics_key="scrape-me",
        _env_file=None,
    )
    catalog = parse_catalog(catalog_for(sim), environ=SIM_KEYS)
    server = metering_server(settings, catalog, run_jobs=False)
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "scrape-me"}):
            response = httpx.get(f"{server.url}/metrics", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert "metering_open_holds" in str(scrape(server.url, key="scrape-me"))
    finally:
        server.stop()


def test_only_the_keyed_scrape_names_teams_users_and_tokens(tmp_path, sim):
    """Two replicas on one database after the same traffic: the open one (no key) shows
    aggregates only; the one with METERING_METRICS_KEY also each budget's use, by subject."""
    url = f"sqlite:///{tmp_path / 'metering.db'}"
    migrate.upgrade(url)
    catalog = parse_catalog(catalog_for(sim), environ=SIM_KEYS)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
    keyed_settings = settings.model_copy(update={"metrics_key": "scrape-me"})
    open_server = metering_server(settings, catalog)
    keyed_server = metering_server(keyed_settings, catalog, run_jobs=False)
    try:
        api = Api(open_server.url, "sqlite", settings)
        team, user, token = api.principal(token_limit="1", user_limit="2", team_limit="4")
        before = scrape(open_server.url)
        traffic(api, token["token"])
        spent = sum(Decimal(e["cost"]) for e in api.events(token_id=token["id"]))
        ids = (team["id"], user["id"], token["id"])

        text = httpx.get(f"{open_server.url}/metrics", timeout=10).text
        assert [i for i in ids if i in text] == []
        samples = scrape(open_server.url)
        assert delta(before, samples, "metering_requests_total", model="gpt-sim", status="ok") == 3
        assert {name for name, _ in samples if name.startswith("metering_budget_used")} == set()
        names = {k for n, labels in samples if n.startswith("metering_") for k, _ in labels}
        assert names <= AGGREGATE_LABELS

        keyed = scrape(keyed_server.url, key="scrape-me")
        used = {
            dict(labels)["subject_id"]: v
            for (name, labels), v in keyed.items()
            if name == "metering_budget_used_ratio"
        }
        assert used == {
            token["id"]: pytest.approx(float(spent / 1)),
            user["id"]: pytest.approx(float(spent / 2)),
            team["id"]: pytest.approx(float(spent / 4)),
        }
    finally:
        keyed_server.stop()
        open_server.stop()


# --- several workers ----------------------------------------------------------------------


def to_toml(catalog: dict) -> str:
    lines = []
    for name, provider in catalog["providers"].items():
        lines.append(f"[providers.{json.dumps(name)}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in provider.items()]
    for model in catalog["models"]:
        lines.append("[[models]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in model.items()]
    return "\n".join(lines) + "\n"


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def multiproc_dir(pid: int) -> Path | None:
    """The PROMETHEUS_MULTIPROC_DIR `metering serve` gave its workers."""
    for child in children(pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return Path(entry.split(b"=", 1)[1].decode())
    return None


@pytest.fixture
def two_workers(own_pg, sim, tmp_path):  # noqa: F811 (own_pg is the imported fixture)
    config = tmp_path / "metering.toml"
    config.write_text(to_toml(catalog_for(sim)))
    port = free_port()
    env = {
        **os.environ,
        **SIM_KEYS,
        "METERING_DATABASE_URL": own_pg,
        "METERING_ADMIN_KEY": ADMIN_KEY,
        "METERING_CONFIG": str(config),
        "METERING_DB_POOL_SIZE": "4",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    command = [sys.executable, "-m", "metering.cli", "serve", "--port", str(port)]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (open while the server runs)
    process = subprocess.Popen(
        [*command, "--workers", "2", "--log-level", "warning"],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "metering serve --workers 2 did not start"
        time.sleep(0.2)
    settings = Settings(database_url=own_pg, admin_key=ADMIN_KEY, _env_file=None)
    yield Api(url, "postgresql", settings), process
    process.terminate()
    process.wait(timeout=20)
    log.close()


def test_two_workers_report_the_sum_of_both(two_workers):
    api, process = two_workers
    directory = multiproc_dir(process.pid)
    assert directory is not None and directory.is_dir()
    _, _, token = api.principal()
    before = scrape(api.url)
    # Each SDK call opens a new connection, which either worker may accept; on a busy machine
    # one can win many in a row: keep going until both have counted some (60 s at most).
    rounds, deadline = 0, time.monotonic() + 60
    while True:
        traffic(api, token["token"])
        rounds += 1
        pids = {p.stem.split("_")[-1] for p in directory.glob("counter_*.db")}
        if len(pids) >= 2 or time.monotonic() > deadline:
            break
    assert len(pids) >= 2, "one worker served everything: nothing to sum"
    scrapes = [scrape(api.url) for _ in range(8)]
    events = api.events(token_id=token["id"])
    assert len(events) == 5 * rounds
    for after in scrapes:
        for model, n in (("gpt-sim", 3), ("minimax-m2.1", 2)):
            got = delta(before, after, "metering_requests_total", model=model, status="ok")
            assert got == n * rounds
        prompt = sum(e["prompt_tokens"] for e in events)
        assert delta(before, after, "metering_tokens_total", kind="prompt") == prompt
    process.terminate()
    process.wait(timeout=20)
    assert not directory.exists(), "the metrics directory outlived metering serve"

"""Prometheus for real: the alert rules checked and unit-tested by Debian's `promtool` (series over
time, dashboards/prometheus/metering-alerts.test.yml), and Debian's `prometheus` scraping a live
server every second, with the rules loaded: the series the rules and the monitoring page name
are there, with their labels, and the rules evaluate without error."""

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from metering.settings import Settings, parse_catalog
from metering.testing import free_port, metering_server
from tests.conftest import ADMIN_KEY, Api, catalog_for

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "prometheus"
METRICS_KEY = "scrape-" + "k" * 24
SIM_KEYS = {"SIM_OPENAI_KEY": "sim-key", "SIM_EXASCALE_KEY": "sim-key"}
# Each series the rules or docs/operator/monitoring.md name, with the labels it must carry.
SERIES = {
    "metering_requests_total": {"model", "provider", "status"},
    "metering_tokens_total": {"model", "provider", "kind"},
    "metering_cost_usd_total": {"model", "provider"},
    "metering_upstream_latency_seconds_bucket": {"model", "provider", "le"},
    "metering_time_to_first_token_seconds_bucket": {"model", "provider", "le"},
    "metering_proxy_added_seconds_bucket": {"phase", "le"},
    "metering_reservations_total": {"path"},
    "metering_budget_rejections_total": {"scope"},
    "metering_open_holds": set(),
    "metering_budget_used_ratio": {"scope", "subject_id"},
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], cwd=RULES, capture_output=True, text=True, timeout=60
    )


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    checked = promtool("check", "rules", "metering-alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 2 rules found" in checked.stdout
    tested = promtool("test", "rules", "metering-alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert of the rules has a case in the unit tests.
    alerts = {
        r["alert"]
        for g in yaml.safe_load((RULES / "metering-alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    cases = yaml.safe_load((RULES / "metering-alerts.test.yml").read_text())["tests"]
    tested_alerts = {c["alertname"] for t in cases for c in t["alert_rule_test"]}
    assert alerts == tested_alerts


@pytest.fixture
def scraped(api, sim, tmp_path):
    """A server with the metrics key, some traffic and a refusal, and a Prometheus scraping it
    every second with the rules loaded; yields the Prometheus URL."""
    settings = Settings(
        database_url=api.settings.database_url,
        admin_key=ADMIN_KEY,
        metrics_key=METRICS_KEY,
        _env_file=None,
    )
    server = metering_server(settings, parse_catalog(catalog_for(sim), environ=SIM_KEYS))
    local = Api(server.url, api.backend, settings)
    _, _, token = local.principal(token_limit="0.01")
    client = local.openai(token["token"])
    messages = [{"role": "user", "content": "scrape me"}]
    client.chat.completions.create(model="gpt-sim", messages=messages)
    for _ in client.chat.completions.create(model="gpt-sim", messages=messages, stream=True):
        pass
    refused = local.openai(local.principal(token_limit="0.000000000001")[2]["token"])
    with pytest.raises(Exception, match="402"):
        refused.chat.completions.create(model="gpt-sim", messages=messages)
    shutil.copy(RULES / "metering-alerts.yml", tmp_path / "metering-alerts.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["metering-alerts.yml"],
        "scrape_configs": [
            {
                "job_name": "metering",
                "static_configs": [{"targets": [server.url.removeprefix("http://")]}],
                "authorization": {"credentials": METRICS_KEY},
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        server.stop()


class Starting(Exception):
    """Prometheus listens, but answers 503 until its storage is ready."""


def query(prometheus: str, promql: str) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=5)
    if response.status_code == 503:
        raise Starting(response.text)
    assert response.status_code == 200, response.text
    return response.json()["data"]["result"]


def test_prometheus_scrapes_the_series_the_rules_and_docs_name(scraped):
    deadline = time.monotonic() + 60
    found: dict[str, list[dict]] = {}
    while time.monotonic() < deadline:
        try:
            found = {name: query(scraped, name) for name in SERIES}
        except (httpx.TransportError, Starting):
            found = {}  # Prometheus still starting
        if found and all(found.values()):
            break
        time.sleep(0.5)
    missing = [name for name in SERIES if not found.get(name)]
    assert not missing, missing
    for name, labels in SERIES.items():
        for result in found[name]:
            assert labels <= set(result["metric"]), (name, result["metric"])
    assert query(scraped, 'up{job="metering"}')[0]["value"][1] == "1"
    requests = query(scraped, 'sum(metering_requests_total{model="gpt-sim"})')
    assert float(requests[0]["value"][1]) >= 2
    rejected = query(scraped, 'metering_budget_rejections_total{scope="token"}')
    assert float(rejected[0]["value"][1]) >= 1
    # The rules are loaded and evaluate against the scraped series without error.
    rules = httpx.get(f"{scraped}/api/v1/rules", timeout=5).json()["data"]["groups"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        r.get("lastEvaluation", "").startswith("0001") for g in rules for r in g["rules"]
    ):
        time.sleep(0.5)
        rules = httpx.get(f"{scraped}/api/v1/rules", timeout=5).json()["data"]["groups"]
    states = {r["name"]: r["health"] for g in rules for r in g["rules"]}
    assert states == {"MeteringBudgetAbove80Percent": "ok", "MeteringBudgetExhausted": "ok"}

"""`metering demo`'s traffic: varied enough that every panel shows something, sent through the
real proxy; the command itself serves the page and says where it is."""

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from decimal import Decimal

import httpx
import pytest

from metering.demo import (
    DEMO_EMAIL,
    DEMO_TEAM,
    DEMO_TEAMS,
    DEMO_TOKEN_CALLS,
    DEMO_TOKENS,
    Admin,
    admin_client,
    local_url,
    main,
)
from metering.testing import free_port
from tests.demo_site import ADMIN_KEY


def test_the_traffic_answers_with_each_kind_of_outcome(site):
    assert site.statuses[200] >= 20
    assert {400, 402, 403, 429, 502} <= set(site.statuses)


def test_the_traffic_covers_every_panel(site):
    def groups(key: str) -> set:
        return {row[f"{key}_id" if key == "team" else key] for row in spend(key)}

    def spend(group_by: str) -> list[dict]:
        return site.get("/v1/spend", group_by=group_by)["rows"]

    names = {t["id"]: t["name"] for t in site.get("/v1/teams")["data"]}
    # The site is shared by the session's tests, which may add teams of their own: the demo's
    # traffic covers at least its own teams, models, providers and users.
    assert {names[t] for t in groups("team")} >= set(DEMO_TEAMS)
    assert groups("model") >= {"gpt-sim", "minimax-m2.1", "minimax-m2.5"}
    assert groups("provider") >= {"sim-openai", "sim-exascale", "sim-genesis"}
    demo_teams = {t for t, name in names.items() if name in DEMO_TEAMS}
    users = site.get("/v1/users")["data"]
    demo_users = {u["id"] for u in users if u["team_id"] in demo_teams}
    assert len(demo_users & {r["user_id"] for r in spend("user")}) == 4
    tokens = {
        t["id"]: t["name"]
        for u in site.get("/v1/users")["data"]
        for t in site.get(f"/v1/users/{u['id']}/tokens", include_revoked="true")["data"]
    }
    assert {tokens[r["token_id"]] for r in spend("token")} >= set(DEMO_TOKENS)
    events = site.get("/v1/usage", limit=200)["data"]
    assert {e["stream"] for e in events} == {True, False}
    assert any(e["completion_tokens_details"]["reasoning_tokens"] for e in events)
    assert any(e["prompt_tokens_details"]["cached_tokens"] for e in events)
    assert {"ok", "upstream_error", "stream_error"} <= {e["status"] for e in events}
    assert {"reported", "estimated"} <= {e["usage_source"] for e in events}


def test_a_budget_ends_near_its_limit(site):
    alice = next(u for u in site.get("/v1/users")["data"] if u["email"] == "alice@demo.example")
    [notebook] = [
        t for t in site.get(f"/v1/users/{alice['id']}/tokens")["data"] if t["name"] == "notebook"
    ]
    budget = site.get(f"/v1/tokens/{notebook['id']}/budget")
    used = Decimal(budget["spent"]) / Decimal(budget["credit_limit"])
    assert Decimal("0.75") <= used < 1


def test_sending_it_again_reuses_teams_and_users(site, monkeypatch, capsys):
    before = {
        "teams": len(site.get("/v1/teams")["data"]),
        "users": len(site.get("/v1/users")["data"]),
    }
    monkeypatch.setenv("METERING_ADMIN_KEY", ADMIN_KEY)
    assert main(["--url", site.url]) == 0
    assert f'"dashboard": "{site.url}/dashboard"' in capsys.readouterr().out
    assert len(site.get("/v1/teams")["data"]) == before["teams"]
    assert len(site.get("/v1/users")["data"]) == before["users"]
    for user in site.get("/v1/users")["data"]:
        active = [t["name"] for t in site.get(f"/v1/users/{user['id']}/tokens")["data"]]
        demo = [n for n in active if n in DEMO_TOKENS]
        assert len(demo) == len(set(demo))  # the earlier token of each name was revoked


def test_a_server_bound_to_every_address_is_reached_on_loopback():
    assert local_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert local_url("::", 9000) == "http://127.0.0.1:9000"
    assert local_url("10.1.2.3", 8080) == "http://10.1.2.3:8080"


def test_the_demo_token_is_made_with_the_admin_api_and_replaces_the_last(site):
    with admin_client(site.url, ADMIN_KEY) as http:
        first = Admin(http).demo_token()
        second = Admin(http).demo_token()
    [team] = [t for t in site.get("/v1/teams")["data"] if t["name"] == DEMO_TEAM]
    [user] = [u for u in site.get("/v1/users")["data"] if u["email"] == DEMO_EMAIL]
    assert (team["reset_interval"], team["credit_limit"]) == ("monthly", None)
    assert (user["team_id"], user["name"], user["credit_limit"]) == (team["id"], "Demo User", None)
    active = site.get(f"/v1/users/{user['id']}/tokens")["data"]
    assert [(t["name"], t["prefix"]) for t in active] == [("demo", second[:12])]
    assert site.http.get("/v1/me", headers={"authorization": f"Bearer {first}"}).status_code == 401
    me = site.get("/v1/me", key=second)
    assert (me["kind"], me["user_id"]) == ("api_token", user["id"])


@pytest.mark.e2e  # starts a `metering demo` process
def test_metering_demo_serves_the_page_and_sends_its_traffic(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "METERING_DATABASE_URL": f"sqlite:///{tmp_path / 'demo.db'}",
        "METERING_ADMIN_KEY": "demo-test-admin",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "metering.cli", "demo", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = read_until(process, re.compile(r"demo traffic failed|  502  .*\n"), timeout=60)
        assert f"http://127.0.0.1:{port}/dashboard" in output
        assert "demo traffic sent" in output, output
        # The SDK example names the interpreter that has the openai package, and runs as printed.
        example = re.search(r"\n  (\S+) -c '(from openai.*?)'\n", output, re.S)
        assert example.group(1) == sys.executable
        ran = subprocess.run(
            [example.group(1), "-c", example.group(2)], capture_output=True, text=True, timeout=60
        )
        assert ran.returncode == 0 and "ChatCompletion(" in ran.stdout, ran.stderr
        assert "Ctrl-C stops the demo" in output
        # Each deliberate failure of the traffic is explained.
        for status in ("400", "402", "403", "429", "502"):
            assert re.search(rf"\n  {status}  \w", output), (status, output)
        page = httpx.get(f"http://127.0.0.1:{port}/dashboard")
        assert page.status_code == 200 and "metering" in page.text
        totals = httpx.get(
            f"http://127.0.0.1:{port}/v1/spend",
            headers={"authorization": "Bearer demo-test-admin"},
        ).json()["total"]
        assert totals["requests"] >= 20 and Decimal(totals["cost"]) > 0
        token = re.search(r"demo token\s+(mtr_\S+)", output).group(1)
        own = httpx.get(
            f"http://127.0.0.1:{port}/v1/spend", headers={"authorization": f"Bearer {token}"}
        ).json()["total"]
        # The printed token shows something too: its traffic, and the example run above.
        assert own["requests"] == len(DEMO_TOKEN_CALLS) + 1
    finally:
        process.terminate()
        process.wait(timeout=15)


def read_until(process: subprocess.Popen, pattern: re.Pattern, timeout: float) -> str:
    """The process's output up to the first line matching pattern (read by a thread)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stdout], daemon=True
    ).start()
    output = ""
    deadline = time.monotonic() + timeout
    while not pattern.search(output):
        assert time.monotonic() < deadline, f"timed out; output so far:\n{output}"
        assert process.poll() is None, f"exited {process.returncode}:\n{output}"
        with contextlib.suppress(queue.Empty):
            output += lines.get(timeout=0.5)
    return output

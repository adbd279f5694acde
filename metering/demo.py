"""`metering demo`: the proxy on the embedded database, a simulated upstream, a demo token, and
a few seconds of varied traffic so that every dashboard panel has something to show.

Teams, users and tokens, the demo token's too, are made with the admin API over HTTP and the
traffic goes through the real proxy, so it can also be sent to a running server: `python -m metering.demo --url URL` (what the
docker-compose `demo` profile does).
"""

import argparse
import importlib.util
import json
import logging
import os
import secrets
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import uvicorn
from sqlalchemy import create_engine, pool, text

from metering import migrate
from metering.app import create_app
from metering.db import sync_url
from metering.money import format_usd, parse_usd, usd_to_pico
from metering.server import server_config
from metering.settings import Settings, parse_catalog
from metering.sim.app import SimServer

DEMO_TEAM, DEMO_EMAIL = "demo-team", "demo@example.com"


def demo_catalog(sim: SimServer) -> dict:
    return {
        "providers": {
            "sim-openai": {
                "base_url": sim.base_url("openai"),
                "dialect": "openai",
                "api_key": "sim",
            },
            "sim-exascale": {
                "base_url": sim.base_url("exascale"),
                "dialect": "exascale",
                "api_key": "sim",
            },
            "sim-genesis": {
                "base_url": sim.base_url("genesis"),
                "dialect": "genesis",
                "api_key": "sim",
            },
        },
        "models": [
            {
                "name": "gpt-sim",
                "provider": "sim-openai",
                "upstream_model": "sim/gpt",
                "input_usd_per_mtok": "0.15",
                "output_usd_per_mtok": "0.60",
                "cached_input_usd_per_mtok": "0.075",
                "max_output_tokens": 4096,
            },
            {
                "name": "minimax-m2.1",
                "provider": "sim-exascale",
                "upstream_model": "MiniMaxAI/MiniMax-M2.1",
                "input_usd_per_mtok": "0.30",
                "output_usd_per_mtok": "1.20",
                "max_output_tokens": 16384,
            },
            {
                "name": "minimax-m2.5",
                "provider": "sim-genesis",
                "upstream_model": "MiniMax-M2.5",
                "input_usd_per_mtok": "0.27",
                "output_usd_per_mtok": "0.95",
                "max_output_tokens": 16384,
            },
        ],
    }


# --- demo traffic ----------------------------------------------------------------------------

# Teams and users made (or found again) by name; limits are decimal strings, as in the API.
DEMO_TEAMS = {
    "demo-platform": ("25.00", "monthly"),
    "demo-research": ("10.00", "weekly"),
    "demo-support": ("0.50", "daily"),
}
DEMO_USERS = {
    "alice@demo.example": ("Alice", "demo-platform", None, "never"),
    "bob@demo.example": ("Bob", "demo-platform", None, "never"),
    "carol@demo.example": ("Carol", "demo-research", "5.00", "monthly"),
    "dave@demo.example": ("Dave", "demo-support", "0.25", "12h"),
}
# Fresh tokens on every run (the earlier ones of the same name are revoked). "notebook" has a
# small limit that the traffic brings close to, then past (one 402).
DEMO_TOKENS = {
    "ci-bot": ("alice@demo.example", None, "never"),
    "notebook": ("alice@demo.example", "0.010", "daily"),
    "backend": ("bob@demo.example", None, "never"),
    "eval-runner": ("carol@demo.example", "1.00", "monthly"),
    "helpdesk": ("dave@demo.example", None, "never"),
    "scripts": ("bob@demo.example", None, "never"),
}
# Limits beyond credit on a demo token: its traffic gets one 429 (the third request of the
# minute) and one 403 (a model outside its list).
DEMO_TOKEN_LIMITS = {"scripts": {"rpm_limit": 2, "allowed_models": ["gpt-*"]}}
# A long system prompt, so that prompts have tokens for the upstream to report as cached.
LONG_CONTEXT = " ".join(
    "The ledger records every request with its tokens, its price and its cost." for _ in range(60)
)


@dataclass(frozen=True)
class Call:
    """One chat completion of the demo traffic."""

    token: str
    model: str
    directives: str
    stream: bool = False
    max_tokens: int | None = None
    context: bool = False  # send LONG_CONTEXT as a system message
    end_user: str | None = None  # x-metering-end-user: the helpdesk's own customer
    tags: str | None = None  # x-metering-tags, a JSON object


CHAT, EMAIL = '{"channel":"chat"}', '{"channel":"email"}'


def demo_calls() -> list[Call]:
    """Several teams, users, models and providers; streamed and not; reasoning and cached
    tokens; a budget brought near its limit; a rate limit and a model allow-list that refuse;
    a few failures of each kind."""
    calls = [
        *(
            Call("ci-bot", "gpt-sim", f"sim:tokens={n} sim:cached=512", context=True)
            for n in (300, 420, 510)
        ),
        Call(
            "ci-bot",
            "gpt-sim",
            "sim:tokens=350 sim:cached=512 sim:chunks=6 sim:delay_ms=40",
            stream=True,
            context=True,
        ),
        Call("notebook", "minimax-m2.1", "sim:tokens=1800 sim:reasoning=600", max_tokens=1800),
        Call("notebook", "minimax-m2.1", "sim:tokens=1800 sim:reasoning=500", True, 1800),
        Call("notebook", "minimax-m2.1", "sim:tokens=1800", max_tokens=1800),
        Call("notebook", "minimax-m2.1", "sim:tokens=1800 sim:chunks=8", True, 1800),
        Call("notebook", "minimax-m2.1", "sim:tokens=1800", max_tokens=1800),  # 402: near limit
        *(Call("backend", "minimax-m2.5", f"sim:tokens={n}") for n in (500, 640, 380)),
        Call("backend", "minimax-m2.5", "sim:tokens=450 sim:chunks=5 sim:delay_ms=60", True),
        Call("backend", "minimax-m2.5", "sim:fault=http500"),  # 502 upstream_error
        *(
            Call("eval-runner", "minimax-m2.1", f"sim:tokens=1200 sim:reasoning={n}", n % 2 == 0)
            for n in (800, 650, 900, 725)
        ),
        Call("eval-runner", "gpt-sim", "sim:tokens=600 sim:cached=700", context=True),
        Call("eval-runner", "gpt-sim", "sim:tokens=400 sim:fault=stream_error", stream=True),
        # The helpdesk answers its own customers: each request names one, and its channel.
        *(
            Call("helpdesk", "gpt-sim", f"sim:tokens={n}", end_user=who, tags=channel)
            for n, who, channel in (
                (60, "cust-ada", CHAT),
                (80, "cust-ben", EMAIL),
                (95, "cust-ada", CHAT),
                (120, "cust-cy", CHAT),
                (70, "cust-ben", EMAIL),
            )
        ),
        Call("helpdesk", "minimax-m2.5", "sim:tokens=200", stream=True, end_user="cust-ada"),
        Call("helpdesk", "gpt-sim", "sim:fault=http400"),  # the upstream's own 400
        Call("scripts", "minimax-m2.5", "sim:tokens=40"),  # 403 model_not_allowed
        *(Call("scripts", "gpt-sim", f"sim:tokens={n}") for n in (40, 55, 30)),  # 200, 200, 429
    ]
    return calls


class Admin:
    """The admin API over HTTP: find-or-create for the demo's teams, users and tokens."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def call(self, method: str, path: str, **kwargs) -> dict:
        response = self.http.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else {}

    def listing(self, path: str) -> list[dict]:
        out: list[dict] = []
        after = None
        while True:
            params = {"limit": 1000, **({"after": after} if after else {})}
            page = self.call("GET", path, params=params)["data"]
            out.extend(page)
            if len(page) < 1000:
                return out
            after = page[-1]["id"]

    def teams(self) -> dict[str, str]:
        found = {t["name"]: t["id"] for t in self.listing("/v1/teams")}
        for name, (limit, interval) in DEMO_TEAMS.items():
            if name not in found:
                body = {"name": name, "credit_limit": limit, "reset_interval": interval}
                found[name] = self.call("POST", "/v1/teams", json=body)["id"]
        return found

    def users(self, teams: dict[str, str]) -> dict[str, str]:
        found = {u["email"]: u["id"] for u in self.listing("/v1/users")}
        for email, (name, team, limit, interval) in DEMO_USERS.items():
            if email not in found:
                body = {
                    "email": email,
                    "name": name,
                    "team_id": teams[team],
                    "credit_limit": limit,
                    "reset_interval": interval,
                }
                found[email] = self.call("POST", "/v1/users", json=body)["id"]
        return found

    def demo_token(self) -> str:
        """The demo team, user and a fresh token (earlier demo tokens are revoked: one is
        enough)."""
        teams = {t["name"]: t["id"] for t in self.listing("/v1/teams")}
        team_id = (
            teams.get(DEMO_TEAM)
            or self.call(
                "POST", "/v1/teams", json={"name": DEMO_TEAM, "reset_interval": "monthly"}
            )["id"]
        )
        users = {u["email"]: u["id"] for u in self.listing("/v1/users")}
        user_id = (
            users.get(DEMO_EMAIL)
            or self.call(
                "POST",
                "/v1/users",
                json={"email": DEMO_EMAIL, "name": "Demo User", "team_id": team_id},
            )["id"]
        )
        for token in self.call("GET", f"/v1/users/{user_id}/tokens")["data"]:
            self.call("DELETE", f"/v1/tokens/{token['id']}")
        return self.call("POST", f"/v1/users/{user_id}/tokens", json={"name": "demo"})["token"]

    def tokens(self, users: dict[str, str]) -> dict[str, str]:
        """A fresh secret per demo token name; the earlier ones of that name are revoked."""
        secrets_by_name = {}
        for name, (email, limit, interval) in DEMO_TOKENS.items():
            user_id = users[email]
            for token in self.call("GET", f"/v1/users/{user_id}/tokens")["data"]:
                if token["name"] == name:
                    self.call("DELETE", f"/v1/tokens/{token['id']}")
            body: dict[str, Any] = {"name": name, "credit_limit": limit, "reset_interval": interval}
            body.update(DEMO_TOKEN_LIMITS.get(name, {}))
            made = self.call("POST", f"/v1/users/{user_id}/tokens", json=body)
            secrets_by_name[name] = made["token"]
        return secrets_by_name


def _send(http: httpx.Client, secret: str, call: Call) -> int:
    messages = [{"role": "user", "content": f"Tell me about metering. {call.directives}"}]
    if call.context:
        messages.insert(0, {"role": "system", "content": LONG_CONTEXT})
    body: dict = {"model": call.model, "messages": messages, "stream": call.stream}
    if call.max_tokens:
        body["max_tokens"] = call.max_tokens
    if call.stream and call.model == "gpt-sim":
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {secret}"}
    if call.end_user:
        headers["x-metering-end-user"] = call.end_user
    if call.tags:
        headers["x-metering-tags"] = call.tags
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        for _ in response.iter_bytes():
            pass  # read the whole answer, as a client would
        return response.status_code


# With the printed demo token too, so that pasting it into the dashboard shows something.
DEMO_TOKEN_CALLS = (
    Call("demo", "gpt-sim", "sim:tokens=120"),
    Call("demo", "minimax-m2.1", "sim:tokens=300 sim:reasoning=120", stream=True),
)


def admin_client(base_url: str, admin_key: str) -> httpx.Client:
    return httpx.Client(
        base_url=base_url, timeout=30, headers={"authorization": f"Bearer {admin_key}"}
    )


def generate_traffic(base_url: str, admin_key: str, demo_token: str | None = None) -> Counter:
    """Sends the demo traffic through the proxy at base_url (and a little with demo_token, if
    given); answers the statuses it got."""
    with admin_client(base_url, admin_key) as http:
        admin = Admin(http)
        teams = admin.teams()
        users = admin.users(teams)
        tokens = admin.tokens(users)
        if demo_token:
            tokens["demo"] = demo_token
        calls = [*demo_calls(), *(DEMO_TOKEN_CALLS if demo_token else ())]
        statuses: Counter = Counter()
        for call in calls:
            statuses[_send(http, tokens[call.token], call)] += 1
    return statuses


def wait_until_ready(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url} did not become ready in {timeout:.0f} s")
        time.sleep(0.2)


def describe(statuses: Counter) -> str:
    counts = ", ".join(f"{n} x {status}" for status, n in sorted(statuses.items()))
    return f"{sum(statuses.values())} requests ({counts})"


# What each deliberate failure of the traffic shows (status -> why it is there).
DELIBERATE = {
    400: "the upstream's own 400 (helpdesk, sim:fault=http400), passed on with its status; "
    "a ledger event at cost 0",
    402: "budget_exceeded: the notebook token's daily limit of "
    f"{format_usd(usd_to_pico(parse_usd(DEMO_TOKENS['notebook'][1])))} USD cannot cover a 5th "
    "request of up to 1,800 tokens; nothing reached the upstream, see GET /v1/refusals",
    403: "model_not_allowed: the scripts token may only use gpt-* (its allowed_models)",
    429: "rate_limit_exceeded: the scripts token's rpm_limit of 2 requests a minute",
    502: "upstream_error: the upstream answered 500 (backend, sim:fault=http500); a ledger "
    "event at cost 0",
}


def explain(statuses: Counter) -> str:
    """One line per deliberate failure the traffic got: what it shows."""
    lines = [
        f"  {status}  {DELIBERATE[status]}" for status in sorted(statuses) if status in DELIBERATE
    ]
    if not lines:
        return ""
    return "the failures are deliberate:\n" + "\n".join(lines)


def python_example() -> str:
    """The interpreter to paste the SDK example with: this one (the venv's, under `make demo`),
    which has the `openai` package when the test extras are installed."""
    python = shlex.quote(sys.executable)
    if importlib.util.find_spec("openai") is None:
        return f"{python} -m pip install openai   # first: no openai package here\n  {python}"
    return python


def metering_command() -> str:
    """The `metering` command of this interpreter's environment (a venv's, not on PATH)."""
    beside = Path(sys.executable).parent / "metering"
    return shlex.quote(str(beside)) if beside.exists() else "metering"


def banner(base: str, token: str, admin: tuple[str, str], url: str) -> str:
    admin_key, whose = admin
    return f"""
metering demo
  database      {url}
  proxy         {base}/v1   (models: gpt-sim, minimax-m2.1, minimax-m2.5, from a simulated upstream)
  dashboard     {base}/dashboard   (open it and paste the admin key or the demo token)
  admin key     {admin_key}   ({whose})
  demo token    {token}

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {token}" -H "Content-Type: application/json" \\
    -d '{{"model": "minimax-m2.1", "messages": [{{"role": "user", "content": "hello"}}]}}'

  {python_example()} -c 'from openai import OpenAI
c = OpenAI(base_url="{base}/v1", api_key="{token}")
print(c.chat.completions.create(model="gpt-sim", messages=[{{"role": "user", "content": "hi"}}]))'

  curl -H "Authorization: Bearer {admin_key}" {base}/v1/usage

  METERING_URL={base} METERING_ADMIN_KEY={admin_key} {metering_command()} teams list

  Ctrl-C stops the demo (the database stays, with its admin key; the next run adds to it).
"""


def demo_in_background(
    server: uvicorn.Server, base_url: str, admin: tuple[str, str], database_url: str
) -> threading.Thread:
    """Once the server is up: makes the demo token, prints the banner (with the admin key and
    where it comes from), sends the demo traffic and says in one line how it went."""
    admin_key, whose = admin

    def run() -> None:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        try:
            with admin_client(base_url, admin_key) as http:
                token = Admin(http).demo_token()
            print(banner(base_url, token, admin, database_url), flush=True)
            statuses = generate_traffic(base_url, admin_key, token)
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"demo traffic failed: {exc}", file=sys.stderr, flush=True)
            return
        print(f"demo traffic sent: {describe(statuses)}", flush=True)
        print(explain(statuses), flush=True)

    thread = threading.Thread(target=run, name="demo-traffic", daemon=True)
    thread.start()
    return thread


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server bound to host."""
    reachable = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{reachable}:{port}"


class DemoSettings(Settings):
    """The demo runs on this machine for a look around: any admin key it is given will do."""

    admin_key_min_chars: ClassVar[int] = 1
    # A webhook receiver on this machine (http://127.0.0.1:...) may be tried with the demo.
    webhooks_allow_loopback: bool = True


# The key_values row that keeps the demo's admin key (beside the signing secret's).
KEPT_KEY = "demo_admin_key"


def kept_admin_key(database_url: str) -> str:
    """The demo's admin key: made at the first demo on this database and kept in it (table
    key_values), so a saved key and a dashboard session outlive a restart. Two demos starting
    at once on one database agree: the first insert wins, both read it."""
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO key_values (key, value) VALUES (:key, :value) "
                    "ON CONFLICT (key) DO NOTHING"
                ),
                {"key": KEPT_KEY, "value": "demo-admin-" + secrets.token_hex(16)},
            )
            kept = conn.execute(
                text("SELECT value FROM key_values WHERE key = :key"), {"key": KEPT_KEY}
            ).scalar_one()
    finally:
        engine.dispose()
    return str(kept)


def run_demo(host: str = "127.0.0.1", port: int = 8080) -> None:
    database_url = DemoSettings().database_url
    migrate.upgrade(database_url)
    given = os.environ.get("METERING_ADMIN_KEY")
    admin_key = given or kept_admin_key(database_url)
    settings = DemoSettings(admin_key=admin_key)
    sim = SimServer().start()
    try:
        catalog = parse_catalog(demo_catalog(sim))
        base = local_url(host, port)
        config = server_config(
            create_app(settings, catalog), settings, host=host, port=port, log_level="warning"
        )
        server = uvicorn.Server(config)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per demo request
        whose = "METERING_ADMIN_KEY" if given else "kept in the database: the same at every start"
        demo_in_background(server, base, (admin_key, whose), settings.database_url)
        server.run()
    finally:
        sim.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m metering.demo --url URL`: the demo traffic, sent to a server already running
    with the demo catalog (the models of demo_catalog), e.g. docker-compose's `demo` profile."""
    parser = argparse.ArgumentParser(prog="python -m metering.demo", description=main.__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the metering server")
    parser.add_argument("--wait-s", type=float, default=120, help="how long to wait for /readyz")
    args = parser.parse_args(argv)
    admin_key = os.environ.get("METERING_ADMIN_KEY")
    if not admin_key:
        print("python -m metering.demo: set METERING_ADMIN_KEY", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    wait_until_ready(base, args.wait_s)
    statuses = generate_traffic(base, admin_key)
    print(json.dumps({"sent": describe(statuses), "dashboard": f"{base}/dashboard"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

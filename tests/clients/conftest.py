"""The client matrix's harness: a server of its own on the simulator's four dialects, and each
client as a process of its own (tests/clients/py/ in .venv-clients, tests/clients/node/ on
Node), driven one JSON line at a time (py/protocol.py, node/protocol.mjs say the protocol)."""

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.proxy.conftest import provider_entry, serving

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
PYTHON = ROOT / ".venv-clients" / "bin" / "python"

# The clients, each a script: the Python ones in the clients' virtualenv, the Node ones on node.
CLIENTS = {
    "openai-python": [str(PYTHON), str(HERE / "py" / "openai_python.py")],
    "langchain-openai": [str(PYTHON), str(HERE / "py" / "langchain_chat.py")],
    "litellm": [str(PYTHON), str(HERE / "py" / "litellm_client.py")],
    "openai-agents": [str(PYTHON), str(HERE / "py" / "agents_sdk.py")],
    "llm": [str(PYTHON), str(HERE / "py" / "llm_cli.py")],
    "openai-node": ["node", str(HERE / "node" / "openai.mjs")],
    "vercel-ai": ["node", str(HERE / "node" / "vercel.mjs")],
}

# One model per dialect: model -> (provider, dialect, upstream model). Prices as the dialect
# tests' (tests/proxy/test_dialects.py).
DIALECTS = {
    "m-openai": ("c-openai", "openai", "MiniMaxAI/MiniMax-M2.5"),
    "m-genesis": ("c-genesis", "genesis", "MiniMax-M2.5"),
    "m-nim": ("c-nim", "nim", "minimaxai/minimax-m2.5"),
    "m-tokenchange": ("c-tokenchange", "tokenchange", "minimax/minimax-m2.5"),
}


def matrix_catalog(sim) -> dict:
    providers, models = {}, []
    for name, (provider, dialect, upstream) in DIALECTS.items():
        extra = {"poll_interval_s": 0.05, "poll_timeout_s": 5} if dialect == "nim" else {}
        providers[provider] = provider_entry(sim.base_url(dialect), dialect, **extra)
        models.append(
            {
                "name": name,
                "provider": provider,
                "upstream_model": upstream,
                "input_usd_per_mtok": "0.30",
                "output_usd_per_mtok": "1.20",
                "max_output_tokens": 16384,
            }
        )
    return {"providers": providers, "models": models}


def llm_config(base_url: str, requested_url: str) -> str:
    """extra-openai-models.yaml as a user writes it: one `metering-<model>` per model, and
    `metering-requested-<model>` on the server that names models as they were requested."""
    return "".join(
        f"- model_id: metering-{prefix}{name}\n  model_name: {name}\n  api_base: {url}/v1\n"
        f"  api_key_name: metering\n"
        for prefix, url in (("", base_url), ("requested-", requested_url))
        for name in DIALECTS
    )


# The longest a client may take over one answer (its retries included).
ANSWER_S = 120


class Client:
    """A client's process: ask() sends one request line and returns its answer line."""

    def __init__(self, name: str, base_url: str, home: Path) -> None:
        self.name = name
        env = {**os.environ, "METERING_BASE_URL": base_url, "LLM_USER_PATH": str(home)}
        for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
            env.pop(proxy, None)
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        # LiteLLM fetches its price list from GitHub when imported (seconds of retries offline):
        # its bundled copy instead.
        env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        self.process = subprocess.Popen(
            CLIENTS[name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            env=env,
            text=True,
            cwd=home,
        )
        ready = self.line("ready")
        assert json.loads(ready) == {"ready": True}, f"{name} did not start: {ready!r}"

    def ask(self, op: str, token: dict, model: str, base_url: str | None = None) -> dict:
        step = {"op": op, "token": token["token"], "model": model}
        if base_url is not None:
            step["base_url"] = base_url
        self.process.stdin.write(json.dumps(step) + "\n")
        self.process.stdin.flush()
        return json.loads(self.line(step["op"]))

    def line(self, what: str) -> str:
        """The next line the client writes; a client silent for ANSWER_S is killed: a hung
        client fails its test, not the run."""
        ready, _, _ = select.select([self.process.stdout], [], [], ANSWER_S)
        if not ready:
            self.process.kill()
            pytest.fail(f"{self.name} did not answer {what} in {ANSWER_S} s")
        line = self.process.stdout.readline()
        assert line, f"{self.name} ended without answering {what}"
        return line

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def proxy(api, sim):
    with serving(api, matrix_catalog(sim)) as own:
        yield own


@pytest.fixture(scope="module")
def requested_proxy(api, sim):
    """A server whose catalog says response_model = "requested": answers name the model as the
    client asked for it, not as the upstream calls it."""
    with serving(api, {**matrix_catalog(sim), "response_model": "requested"}) as own:
        yield own


# The clients with a Responses API model (tests/clients/test_responses.py).
RESPONSES_CLIENTS = ("openai-agents", "vercel-ai")


def started(name: str, proxy, requested_proxy, tmp_path_factory):
    home = tmp_path_factory.mktemp(f"client-{name}")
    (home / "extra-openai-models.yaml").write_text(llm_config(proxy.url, requested_proxy.url))
    one = Client(name, proxy.url, home)
    yield one
    one.close()


@pytest.fixture(scope="module", params=list(CLIENTS))
def client(request, proxy, requested_proxy, tmp_path_factory):
    yield from started(request.param, proxy, requested_proxy, tmp_path_factory)


@pytest.fixture(scope="module", params=RESPONSES_CLIENTS)
def responses_client(request, proxy, requested_proxy, tmp_path_factory):
    yield from started(request.param, proxy, requested_proxy, tmp_path_factory)


def refusals(api, token: dict) -> list[dict]:
    return api.ok("GET", "/v1/refusals", params={"token_id": token["id"], "limit": 1000})["data"]


def refusals_after_marker(api, proxy, token: dict, model: str) -> list[dict]:
    """The token's refusals once a marker request of the test's own (refused too) is among them:
    the refusal log writes in order, so every refusal the client caused is written by then.
    Returns them without the marker's."""
    marker = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {token['token']}"},
        json={"model": model, "messages": [{"role": "user", "content": "marker"}]},
        timeout=30,
    )
    assert marker.status_code in (402, 403, 429), marker.text
    deadline = time.monotonic() + 10
    while True:
        rows = refusals(api, token)
        markers = [r for r in rows if r["id"] == marker.headers["x-request-id"]]
        if markers or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert markers, rows
    return [r for r in rows if r not in markers]

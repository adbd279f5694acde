"""LiteLLM's proxy as a comparison row (`python -m bench.run --litellm`).

It is installed into its own virtualenv under the bench's work folder
(`pip install 'litellm[proxy]'`, once; `--litellm-venv` to use another), and started with one
worker, one model routed to the simulated upstream, a master key (LiteLLM refuses to start
without one; with no database it is the only credential, checked in memory) and no database (so
no virtual keys, no budgets and no spend log: the lightest way LiteLLM proxies a request), and
`LITELLM_LOCAL_MODEL_COST_MAP=True` so it never fetches its price list from the network.
"""

import os
import subprocess
import sys
from pathlib import Path

WORK = Path(os.environ.get("METERING_BENCH_WORK", Path.home() / ".cache" / "metering-bench"))
VENV = WORK / "litellm-venv"
MASTER_KEY = "sk-bench-0123456789abcdef0123456789abcdef"


class Unavailable(RuntimeError):
    """LiteLLM could not be installed or found: the message says why and what to do."""


def ensure(venv: Path = VENV, python: str | None = None) -> Path:
    """The `litellm` command of the virtualenv, installing it there first if it is missing."""
    command = venv / "bin" / "litellm"
    if command.exists():
        return command
    log = venv.parent / "litellm-install.log"
    print(f"installing litellm[proxy] into {venv} (log: {log}) ...", file=sys.stderr)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        steps = (
            [python or sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "pip"), "install", "litellm[proxy]"],
        )
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise Unavailable(
                    f"--litellm: `{' '.join(step)}` failed (see {log}); LiteLLM cannot be "
                    "installed here. Install it yourself into a virtualenv and pass "
                    "--litellm-venv PATH, or run without --litellm."
                )
    if not command.exists():
        raise Unavailable(f"--litellm: {command} missing after installing (see {log})")
    return command


def version(venv: Path = VENV) -> str:
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "unknown"


def config_yaml(model: str, upstream: str, key: str) -> str:
    return f"""\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {upstream}
      api_key: {key}
litellm_settings:
  drop_params: true
  telemetry: false
  json_logs: false
"""


def argv(venv: Path, config: Path, port: int) -> list[str]:
    return [
        str(venv / "bin" / "litellm"),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]


def env(base: dict) -> dict:
    out = {k: v for k, v in base.items() if not k.startswith(("DATABASE_URL", "LITELLM_"))}
    out.update(
        {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_MODE": "PRODUCTION",
            "DISABLE_SCHEMA_UPDATE": "True",
            "TELEMETRY": "False",
            "LITELLM_MASTER_KEY": MASTER_KEY,
        }
    )
    return out

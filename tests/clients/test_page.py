"""The snippets of docs/getting-started/clients.md run as printed, with the clients the matrix
installs: the blocks marked `<!-- not run: the client matrix runs it (make test-clients) -->`
(tests/docs/test_commands.py leaves them to this file), each alone, against a live server on
SQLite with the documented address pointed at it and TOKEN set, as a reader has it; the `yaml`
block is `llm`'s extra-openai-models.yaml, written where LLM_USER_PATH says."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.clients.conftest import CLIENTS, HERE, ROOT
from tests.docs.test_commands import BLOCK, DOCUMENTED_URL

PAGE = ROOT / "docs" / "getting-started" / "clients.md"
MARK = "the client matrix runs it (make test-clients)"
RUNNERS = {
    "python": [CLIENTS["openai-python"][0], "block.py"],
    "js": ["node", "block.mjs"],
    "sh": ["bash", "-e", "block.sh"],
}
FILES = {"python": "block.py", "js": "block.mjs", "sh": "block.sh"}


def marked() -> list[tuple[str, str]]:
    return [(m["kind"], m["body"]) for m in BLOCK.finditer(PAGE.read_text()) if m["why"] == MARK]


def test_every_client_has_its_snippet_marked():
    kinds = [kind for kind, _ in marked()]
    assert kinds.count("python") == 4 and kinds.count("js") == 2 and kinds.count("sh") == 1


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("n", range(len(marked())))
def test_a_snippet_runs_as_printed(api, tmp_path, n):
    kind, body = marked()[n]
    (tmp_path / FILES[kind]).write_text(body.replace(DOCUMENTED_URL, api.url))
    (tmp_path / "node_modules").symlink_to(HERE / "node" / "node_modules")
    (yaml,) = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    (tmp_path / "extra-openai-models.yaml").write_text(yaml.replace(DOCUMENTED_URL, api.url))
    env = {
        **os.environ,
        "TOKEN": api.principal()[2]["token"],
        "LLM_USER_PATH": str(tmp_path),
        "PATH": f"{Path(CLIENTS['openai-python'][0]).parent}{os.pathsep}{os.environ['PATH']}",
        "NO_PROXY": "127.0.0.1,localhost",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    done = subprocess.run(
        RUNNERS[kind], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{kind} block {n}:\n{body}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), body

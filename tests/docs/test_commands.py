"""Every command the documentation shows runs as printed, against a live server.

Pages: README.md and every page of docs/. Each fenced block says what it is by its language:

- `sh`: commands (`curl`, `metering`, `jq`), run in order, page by page, in one bash, twice
  (a reader runs a page again: its names must not collide, its objects must still be there),
  with METERING_URL and ADMIN_KEY set as the walkthrough says, and TEAM_ID, USER_ID, TOKEN_ID
  and TOKEN naming a team, a user of it and an API token of that user, as the pages assume.
  Every `curl` shows the answer's status (`-w ...%{http_code}...`) and gives the status it
  should be after `# -> NNN`; the statuses are checked in order.
- `python`: SDK calls, each block run alone by this interpreter (the one that has `openai`),
  with the same variables, and the documented address (http://127.0.0.1:8080) pointed at the
  live server. A block marked `<!-- needs: litellm -->` on the line before is run by an
  interpreter that has LiteLLM's SDK (LITELLM, in its own virtualenv: not in the project's
  lock), installed once under CACHE, with its price list read locally, never fetched; a page's
  LiteLLM blocks share that interpreter (its import takes seconds), each alone in a fresh
  namespace, against one backend.
- `js`: SDK calls, each block run alone by `node` as an ES module (top-level `await`), with the
  same variables and address, and the `openai` package pinned by tests/docs/node's lock,
  installed once (`npm ci`) under CACHE, keyed by the lock's hash.
- Not commands, never run (NOT_COMMANDS says why): output, placeholders and bodies (`text`,
  `json`), files (`toml`, `yaml`, `sql`).
- A command that cannot run here is marked on the line before its block with
  `<!-- not run: why -->`: it starts a server, builds containers or the virtualenv, or needs a
  production database.

Not run either (OTHER_FILES, and the repository's own files the site shows: BENCHMARKS.md,
CONTRIBUTING.md, CHANGELOG.md): decision records and benchmark figures, whose commands are
benchmark runs of minutes each, and the repository's set-up and test commands (`make ...`),
which would run this suite inside itself.

The pages' blocks run against a server on SQLite, the embedded default a reader starts with:
what they test is the page (the commands, the clients, the statuses it gives); the server's
behaviour on both databases is the rest of the suite's. The walkthrough runs on both.

CACHE (~/.cache/metering-docs, or METERING_DOCS_CACHE) outlives the run: the installs are made
once per machine. An install that fails (no registry, no node) fails the tests that need it.
"""

import fcntl
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ADMIN_KEY
from tests.docs.cli_forks import CLIENT, PYTHON

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOCUMENTED_URL = "http://127.0.0.1:8080"
CACHE = Path(os.environ.get("METERING_DOCS_CACHE", Path.home() / ".cache" / "metering-docs"))
NODE_PROJECT = Path(__file__).resolve().parent / "node"
LITELLM = "1.110.2"

COMMANDS = {"sh", "python", "js"}
NEEDS = {"litellm": "python"}  # what a block may need, and the kind of block that may need it
NOT_COMMANDS = {
    "text": "output, and the variables a reader sets to what their server printed",
    "json": "bodies and answers shown, not sent",
    "toml": "a catalog file",
    "yaml": "a configuration file",
    "sql": "a statement shown, run by the service itself",
}
OTHER_FILES = {
    "docs/decisions/": "decision records: their commands are benchmark runs whose figures they keep",
    "docs/hooks/": "the site's build hooks, not pages",
}

BLOCK = re.compile(
    r"^(?:<!-- (?:not run: (?P<why>.+?)|needs: (?P<needs>[\w-]+)) -->\n)?[ \t]*```(?P<kind>[\w-]*)[^\n]*\n(?P<body>.*?)^[ \t]*```[ \t]*$",
    re.M | re.S,
)
EXPECTED = re.compile(r"# -> (\d{3})")

# `metering` is the CLI forked from a process that has imported it (tests/docs/cli_forks.py):
# the same main() with the command's arguments, environment, directory and standard streams.
# Each curl also writes its status to STATUS_FILE (the first thing its -w format writes, to
# stderr), so the commands stay as a reader pastes them and print what a reader sees.
PRELUDE = r"""
set -e
curl() {
  local args=() format=0 arg
  for arg in "$@"; do
    if [ "$format" = 1 ]; then args+=("%{stderr}STATUS %{http_code}\n%{stdout}$arg"); format=0
    else args+=("$arg"); case "$arg" in -w|--write-out) format=1;; esac
    fi
  done
  command curl "${args[@]}" 2>>"$STATUS_FILE"
}
metering() { "$METERING_CLI_PYTHON" -I -S -c "$METERING_CLI_CLIENT" "$@"; }
"""


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in found if not any(rel(p).startswith(o) for o in OTHER_FILES)]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """(kind, body, why not run) of each fenced block, in order."""
    return [(m["kind"], m["body"], m["why"]) for m in BLOCK.finditer(page.read_text())]


def needs(page: Path) -> list[tuple[str, str]]:
    """(kind, what it needs) of each block marked `<!-- needs: ... -->`."""
    return [(m["kind"], m["needs"]) for m in BLOCK.finditer(page.read_text()) if m["needs"]]


def runnable(page: Path, kind: str, need: str | None = None) -> list[str]:
    return [
        m["body"]
        for m in BLOCK.finditer(page.read_text())
        if m["kind"] == kind and m["why"] is None and m["needs"] == need
    ]


def test_every_block_says_what_it_is():
    unknown = {
        f"{rel(page)}: a block of kind {kind or '(none)'}"
        for page in pages()
        for kind, _, _ in blocks(page)
        if kind not in COMMANDS and kind not in NOT_COMMANDS
    }
    assert unknown == set()


def test_every_block_needs_what_can_be_installed():
    wrong = [
        f"{rel(page)}: a {kind} block needs {need}"
        for page in pages()
        for kind, need in needs(page)
        if NEEDS.get(need) != kind
    ]
    assert wrong == []


def test_every_curl_shows_its_status_and_the_status_it_should_be():
    wrong = []
    for page in pages():
        for body in runnable(page, "sh"):
            calls = len(re.findall(r"(?<![\w-])curl ", body))
            shown = body.count("%{http_code}")
            expected = len(EXPECTED.findall(body))
            if not calls == shown == expected:
                wrong.append(f"{rel(page)}: {calls} curl, {shown} statuses, {expected} `# ->`")
    assert wrong == []


def test_every_block_not_run_says_why():
    for page in pages():
        for _, _, why in blocks(page):
            assert why is None or len(why.split()) >= 3, f"{rel(page)}: not run, {why!r}"


def test_the_walkthrough_has_every_step():
    script = "\n".join(runnable(DOCS / "operator" / "walkthrough.md", "sh"))
    for step in (
        "/v1/teams",
        "/v1/users",
        "/tokens",
        "-X PATCH",
        "# -> 402",
        "group_by=user,day",
        "format=csv",
        "-X DELETE",
    ):
        assert step in script, step


SHELL_PAGES = [rel(p) for p in pages() if runnable(p, "sh")]
PYTHON_PAGES = [rel(p) for p in pages() if runnable(p, "python")]
LITELLM_PAGES = [rel(p) for p in pages() if runnable(p, "python", "litellm")]
JS_PAGES = [rel(p) for p in pages() if runnable(p, "js")]


@contextmanager
def locked(name: str) -> Iterator[None]:
    """One install at a time across this run's workers and other runs on the machine."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def install(what: str, argv: list[str], cwd: Path, log: Path) -> None:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.fail(f"installing {what} failed ({' '.join(argv)}): {error}", pytrace=False)
    with log.open("a") as out:
        out.write(done.stdout + done.stderr)
    if done.returncode != 0:
        pytest.fail(
            f"installing {what} failed ({' '.join(argv)}; a registry must be reachable once):\n"
            f"{done.stdout}{done.stderr}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The node_modules of tests/docs/node's lock, installed once per lock under CACHE."""
    lock = (NODE_PROJECT / "package-lock.json").read_bytes()
    project = CACHE / "node" / hashlib.sha256(lock).hexdigest()[:16]
    modules = project / "node_modules"
    with locked("node"):
        if not (project / "installed").exists():
            project.mkdir(parents=True, exist_ok=True)
            for name in ("package.json", "package-lock.json"):
                (project / name).write_bytes((NODE_PROJECT / name).read_bytes())
            argv = ["npm", "ci", "--prefer-offline", "--no-audit", "--no-fund"]
            install("the Node SDK", argv, project, project / "install.log")
            (project / "installed").touch()
    return modules


@pytest.fixture(scope="session")
def litellm_python() -> Path:
    """An interpreter with LiteLLM's SDK (LITELLM), in its own virtualenv under CACHE."""
    venv = CACHE / f"litellm-{LITELLM}"
    python = venv / "bin" / "python"
    with locked("litellm"):
        if not (venv / "installed").exists():
            uv = str(Path(sys.executable).parent / "uv")
            log = CACHE / f"litellm-{LITELLM}-install.log"
            argv = [uv, "venv", "--clear", "--python", sys.executable, str(venv)]
            install("LiteLLM", argv, CACHE, log)
            argv = [uv, "pip", "install", "--compile-bytecode", "--python", str(python)]
            argv.append(f"litellm=={LITELLM}")
            install("LiteLLM", argv, CACHE, log)
            (venv / "installed").touch()
    return python


@pytest.fixture(scope="session")
def cli_forks(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The process the pages' `metering` commands are forked from, and what the shell needs."""
    path = tmp_path_factory.mktemp("cli") / "forks.sock"
    argv = [sys.executable, "-m", "tests.docs.cli_forks", str(path)]
    server = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        yield {
            "METERING_CLI_FORKS": str(path),
            "METERING_CLI_PYTHON": sys.executable,
            "METERING_CLI_CLIENT": CLIENT,
        }
    finally:
        server.kill()
        server.wait()


def environment(api, tmp_path: Path) -> dict[str, str]:
    """What a reader of the pages has: the server, the admin key, a team, user and token."""
    team, user, token = api.principal()
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "METERING_URL": api.url,
        "ADMIN_KEY": ADMIN_KEY,
        "TEAM_ID": team["id"],
        "USER_ID": user["id"],
        "TOKEN_ID": token["id"],
        "TOKEN": token["token"],
        # The `metering` commands read the service's settings, as on the server's machine.
        "METERING_DATABASE_URL": api.settings.database_url,
        "METERING_ADMIN_KEY": ADMIN_KEY,
        "STATUS_FILE": str(tmp_path / "statuses"),
    }


def run_shell(page: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    script = "\n".join(runnable(ROOT / page, "sh"))
    Path(env["STATUS_FILE"]).write_text("")
    done = subprocess.run(
        ["bash", "-c", PRELUDE + script + '\necho "TEAM_ID=$TEAM_ID"'],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{page}:\n{done.stdout}\n{done.stderr}"
    lines = Path(env["STATUS_FILE"]).read_text().splitlines()
    got = [int(line.split()[1]) for line in lines if line.startswith("STATUS ")]
    expected = [int(code) for code in EXPECTED.findall(script)]
    assert got == expected, f"{page}:\n{done.stdout}"
    return done


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("page", SHELL_PAGES)
def test_the_commands_of_a_page_run_as_printed_twice(api, cli_forks, tmp_path, page):
    env = environment(api, tmp_path) | cli_forks
    for run in ("first", "second"):
        cwd = tmp_path / run
        cwd.mkdir()
        run_shell(page, env, cwd)


def run_blocks(page: str, bodies: list[str], argv: list[str], env: dict[str, str], cwd: Path):
    """Each block alone: `argv` and the block's file, the documented address made the server's."""
    assert bodies, page
    for body in bodies:
        block = cwd / Path(argv[-1]).name
        block.write_text(body.replace(DOCUMENTED_URL, env["METERING_URL"]))
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{page}:\n{body}\n{done.stderr}"


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_the_sdk_calls_of_a_page_run_as_printed(api, cli_forks, tmp_path, page):
    env = environment(api, tmp_path) | cli_forks
    bodies = runnable(ROOT / page, "python")
    # This interpreter, forked from the process that has imported `openai` (cli_forks.py).
    client = [sys.executable, "-I", "-S", "-c", CLIENT, PYTHON]
    run_blocks(page, bodies, [*client, "block.py"], env, tmp_path)


# Importing LiteLLM takes seconds: its blocks run in one interpreter, each alone in a fresh
# namespace (runpy), on one backend (the client is what is tested; the server is the same).
RUN_EACH = (
    "import runpy, sys\nfor block in sys.argv[1:]:\n    runpy.run_path(block, run_name='__main__')"
)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("page", LITELLM_PAGES)
def test_the_litellm_calls_of_a_page_run_as_printed(api, litellm_python, tmp_path, page):
    env = {**environment(api, tmp_path), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    bodies = runnable(ROOT / page, "python", "litellm")
    assert bodies, page
    files = []
    for n, body in enumerate(bodies):
        files.append(tmp_path / f"block{n}.py")
        files[-1].write_text(body.replace(DOCUMENTED_URL, api.url))
    argv = [str(litellm_python), "-c", RUN_EACH, *map(str, files)]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{page}:\n{done.stderr}"


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("page", JS_PAGES)
def test_the_node_calls_of_a_page_run_as_printed(api, node_modules, tmp_path, page):
    env = environment(api, tmp_path)
    (tmp_path / "node_modules").symlink_to(node_modules)
    bodies = runnable(ROOT / page, "js")
    run_blocks(page, bodies, ["node", "block.mjs"], env, tmp_path)


def test_the_walkthrough_does_what_it_says_each_time(api, cli_forks, tmp_path):
    """Run twice: each run makes its own team, spends its token's budget down to a 402, and
    revokes the token; the second run's names do not collide with the first's."""
    env = environment(api, tmp_path) | cli_forks
    teams = []
    for run in ("first", "second"):
        cwd = tmp_path / run
        cwd.mkdir()
        done = run_shell("docs/operator/walkthrough.md", env, cwd)
        team_id = done.stdout.rsplit("TEAM_ID=", 1)[1].strip()
        teams.append(team_id)
        assert api.ok("GET", f"/v1/teams/{team_id}")["name"].startswith("research-")
        refusals = api.ok("GET", "/v1/refusals", params={"team_id": team_id})["data"]
        assert [r["reason"] for r in refusals] == ["budget"]
        spend = api.ok("GET", "/v1/spend", params={"team_id": team_id})
        assert spend["total"]["requests"] == 1
        assert "402" in done.stdout and "budget_exceeded" in done.stdout
    assert len(set(teams)) == 2

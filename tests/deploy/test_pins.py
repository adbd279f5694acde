"""Pinned dependencies. requirements.lock (the runtime dependencies and the build backend: what
the image installs) and requirements-test.lock (those and the test and docs extras: what `make`
installs) pin every dependency pyproject.toml names to one version, with hashes; the Dockerfile
and the Makefile install from them; the running environment is what the lock says. uvicorn, whose
private httptools protocol metering/server.py extends, is pinned exactly and still has the shape
server.py was written against."""

import inspect
import re
import shlex
import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import uvicorn
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUNTIME = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
TEST = [Requirement(r) for r in EXTRAS["test"] + EXTRAS["docs"]]
BUILD = [Requirement(r) for r in PYPROJECT["dependency-groups"]["build"]]
UPDATE = "run `make lock` (docs/development/architecture.md, Dependencies)"


@dataclass(frozen=True)
class Locked:
    version: str
    marker: Marker | None

    def applies(self) -> bool:
        return self.marker is None or self.marker.evaluate()


def read_lock(name: str) -> dict[str, Locked]:
    """A lock in pip's requirements format: `name==version ; marker --hash=... --hash=...`."""
    text = (ROOT / name).read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *hashes = line.split(" --hash=")
        parsed = Requirement(requirement)
        [pin] = parsed.specifier  # one clause
        assert pin.operator == "==" and "*" not in pin.version, f"{name}: {line} is not exact"
        assert hashes and all(h.strip().startswith("sha256:") for h in hashes), (
            f"{name}: {parsed.name} has no hash"
        )
        out[canonicalize_name(parsed.name)] = Locked(pin.version, parsed.marker)
    return out


LOCK = read_lock("requirements.lock")
TEST_LOCK = read_lock("requirements-test.lock")


def missing_or_outside(requirements: list[Requirement], lock: dict[str, Locked]) -> list[str]:
    wrong = []
    for requirement in requirements:
        locked = lock.get(canonicalize_name(requirement.name))
        if locked is None:
            wrong.append(f"{requirement} is not locked")
        elif not requirement.specifier.contains(locked.version, prereleases=True):
            wrong.append(f"{requirement} is locked at {locked.version}")
    return wrong


def test_the_runtime_lock_pins_every_runtime_dependency_and_the_build_backend():
    wrong = missing_or_outside(RUNTIME + BUILD, LOCK)
    assert not wrong, "; ".join([*wrong, UPDATE])


def test_the_test_lock_pins_every_runtime_and_test_dependency():
    wrong = missing_or_outside(RUNTIME + TEST, TEST_LOCK)
    assert not wrong, "; ".join([*wrong, UPDATE])


def test_the_two_locks_agree_on_every_version():
    differ = {
        name: (locked.version, TEST_LOCK[name].version)
        for name, locked in LOCK.items()
        if name in TEST_LOCK and TEST_LOCK[name].version != locked.version
    }
    assert not differ, f"requirements.lock and requirements-test.lock differ: {differ}; {UPDATE}"
    runtime_closure = set(LOCK) - {canonicalize_name(r.name) for r in BUILD}
    assert runtime_closure <= set(TEST_LOCK), UPDATE


def test_the_environment_is_what_the_lock_says():
    drift = []
    for name, locked in TEST_LOCK.items():
        if not locked.applies():
            continue
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "nothing"
        if installed != locked.version:
            drift.append(f"{name}: {installed} installed, {locked.version} locked")
    assert not drift, "; ".join(
        [
            *drift,
            "the environment is not the lock's: `make .venv/bin/metering` installs it "
            "(after `make lock` if pyproject.toml changed)",
        ]
    )


def recipe(makefile: str, target: str) -> tuple[list[str], list[str]]:
    """A Makefile rule's prerequisites and recipe lines."""
    match = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", makefile, re.M)
    assert match, f"no rule for {target}"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def test_make_installs_the_test_lock_then_the_package_alone():
    makefile = (ROOT / "Makefile").read_text()
    prerequisites, lines = recipe(makefile, "$(BIN)/metering")
    assert {"pyproject.toml", "requirements-test.lock"} <= set(prerequisites)
    # uv at its pinned version, then every install by it: the lock (hashes checked), the package.
    assert lines[1] == "$(BIN)/pip install -q uv==$(UV_VERSION)", lines
    assert re.search(r"^UV_VERSION := \d+\.\d+\.\d+$", makefile, re.M)
    assert "UV = $(BIN)/uv pip install -q --python $(BIN)/python\n" in makefile
    installs = [shlex.split(line)[1:] for line in lines if line.startswith("$(UV)")]
    assert installs == [
        ["--require-hashes", "-r", "requirements-test.lock"],
        ["--no-deps", "--no-build-isolation", "-e", "."],
    ]
    assert not [line for line in lines[2:] if "pip install" in line], lines
    _, lock = recipe(makefile, "lock")
    assert any("--group build -o requirements.lock" in line for line in lock)
    assert any(
        "--extra test --extra docs -c requirements.lock -o requirements-test.lock" in line
        for line in lock
    )
    assert "make .venv/bin/metering" in (ROOT / ".ci/run").read_text()


def test_the_image_installs_the_runtime_lock_then_the_package_alone():
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = [
        shlex.split(run)
        for run in re.findall(r"^RUN pip install (.+?)(?: &&.*)?$", dockerfile, re.M)
    ]
    assert installs == [
        ["--require-hashes", "-r", "requirements.lock"],
        ["--no-deps", "--no-build-isolation", "."],
    ]
    assert dockerfile.index("COPY requirements.lock") < dockerfile.index("RUN pip install")


# What metering/server.py's GuardedProtocol and JoinedCycle override or call in uvicorn's
# httptools implementation (signatures without annotations), and the attributes they read or set.
UVICORN = "0.55.0"
SIGNATURES = {
    HttpToolsProtocol: {
        "__init__": "(self, config, server_state, app_state, _loop=None)",
        "connection_made": "(self, transport)",
        "connection_lost": "(self, exc)",
        "data_received": "(self, data)",
        "send_400_response": "(self, msg)",
        "on_message_begin": "(self)",
        "on_headers_complete": "(self)",
        "_start_asgi_task": "(self, cycle, app)",
        "on_message_complete": "(self)",
    },
    RequestResponseCycle: {
        "__init__": (
            "(self, scope, transport, flow, logger, access_logger, access_log, default_headers, "
            "message_event, expect_100_continue, keep_alive, on_response)"
        ),
        "send": "(self, message)",
    },
}
ATTRIBUTES = {
    HttpToolsProtocol: ("app", "loop", "connections", "transport", "url", "headers", "cycle"),
    RequestResponseCycle: (
        "scope",
        "transport",
        "message_event",
        "disconnected",
        "response_started",
        "response_complete",
    ),
}
RECHECK = (
    "uvicorn moved: metering/server.py extends its private httptools protocol and response "
    "cycle. Re-read uvicorn/protocols/http/httptools_impl.py against GuardedProtocol (deadlines "
    "and caps: the parser callbacks it wraps, self.app read by on_headers_complete before it "
    "makes the cycle and passes it to _start_asgi_task, send_400_response) and JoinedCycle (send "
    "writes the status line and headers in one transport.write, then each body part in one); run "
    "tests/resilience and tests/auth; then update the pin in pyproject.toml, `make lock`, and the "
    "record in tests/deploy/test_pins.py"
)


def bare(function) -> str:
    signature = inspect.signature(function)
    parameters = [
        p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def test_uvicorn_is_pinned_exactly_and_installed_at_the_pin():
    [pinned] = [r for r in RUNTIME if canonicalize_name(r.name) == "uvicorn"]
    assert str(pinned.specifier) == f"=={UVICORN}", RECHECK
    assert LOCK["uvicorn"].version == TEST_LOCK["uvicorn"].version == UVICORN, RECHECK
    assert version("uvicorn") == uvicorn.__version__ == UVICORN, RECHECK


def test_uvicorns_private_protocol_has_the_shape_server_py_extends():
    changed = [
        f"{cls.__name__}.{name} is {now}, was {was}"
        for cls, methods in SIGNATURES.items()
        for name, was in methods.items()
        if (now := bare(getattr(cls, name)) if hasattr(cls, name) else "gone") != was
    ]
    changed += [
        f"{cls.__name__} no longer sets self.{name}"
        for cls, names in ATTRIBUTES.items()
        for name in names
        if f"self.{name} = " not in inspect.getsource(cls)
    ]
    changed += [
        f"STATUS_LINE has no {status}"
        for status in (400, 408, 431, 503)
        if status not in httptools_impl.STATUS_LINE
    ]
    assert not changed, "; ".join([*changed, RECHECK])

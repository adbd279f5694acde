"""docker-compose.yml, Dockerfile and .env.example, checked without Docker: what they name
exists, their settings are the service's settings, and they agree with the deployment page
(docs/operator/deployment.md)."""

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from metering.cli import PLACEHOLDER_ADMIN_KEY, placeholder_admin_key
from metering.db import async_url
from metering.demo import demo_catalog
from metering.migrate import alembic_config
from metering.settings import Settings, parse_catalog

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
DEPLOYMENT = (ROOT / "docs" / "operator" / "deployment.md").read_text()
VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    """The variables .env.example sets, and those it shows commented out (`# NAME=value`)."""
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        match = re.match(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if match:
            out[match.group(1)] = match.group(2)
    return out


def set_in_env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}."""

    def one(match: re.Match) -> str:
        name, kind, rest = match.groups()
        if env.get(name):
            return env[name]
        if kind == ":?":
            raise AssertionError(f"{name} is required: {rest}")
        return rest or ""

    return VARIABLE.sub(one, value)


def references(node) -> set[str]:
    if isinstance(node, dict):
        return set().union(*(references(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(references(v) for v in node)) if node else set()
    return {m.group(1) for m in VARIABLE.finditer(str(node))}


def compose_section() -> str:
    start = DEPLOYMENT.index("## docker compose")
    end = DEPLOYMENT.find("\n## ", start + 1)
    return DEPLOYMENT[start : end if end > 0 else None]


def test_the_services_and_their_profiles():
    assert set(SERVICES) == {
        "postgres",
        "metering",
        "grafana-reader",
        "grafana",
        "prometheus",
        "sim",
        "demo-traffic",
    }
    assert {name for name, s in SERVICES.items() if s.get("profiles")} == {"sim", "demo-traffic"}
    assert all(SERVICES[n]["profiles"] == ["demo"] for n in ("sim", "demo-traffic"))
    assert SERVICES["sim"]["command"][:3] == ["python", "-m", "metering.sim"]
    assert SERVICES["demo-traffic"]["command"][:3] == ["python", "-m", "metering.demo"]


def test_every_metering_variable_is_a_setting():
    fields = set(Settings.model_fields)
    named = {n for n in env_example() if n.startswith("METERING_")}
    for service in SERVICES.values():
        named |= {n for n in service.get("environment", {}) if n.startswith("METERING_")}
    named |= {n for n in references(COMPOSE) if n.startswith("METERING_")}
    assert named >= {"METERING_DATABASE_URL", "METERING_ADMIN_KEY", "METERING_CONFIG"}
    unknown = {n for n in named if n.removeprefix("METERING_").lower() not in fields}
    assert unknown == set()


def test_the_env_example_is_valid_settings(monkeypatch):
    monkeypatch.delenv("METERING_DB_POOL_SIZE", raising=False)  # the tests' own (conftest)
    for name, value in set_in_env_example().items():
        if name.startswith("METERING_"):
            monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)
    assert settings.admin_key and settings.db_pool_size == 20


def service_settings(env: dict[str, str]) -> Settings:
    """The metering service's settings as compose gives them (its environment, interpolated)."""
    given = {
        name.removeprefix("METERING_").lower(): interpolate(str(value), env)
        for name, value in SERVICES["metering"]["environment"].items()
    }
    return Settings(_env_file=None, **given)


def test_compose_needs_only_what_env_example_sets():
    env = set_in_env_example()
    assert references(COMPOSE) <= set(env)
    url = make_url(service_settings(env).database_url)
    assert (url.username, url.password, url.host, url.port, url.database) == (
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
        "postgres",
        5432,
        env["POSTGRES_DB"],
    )
    grafana = {k: interpolate(str(v), env) for k, v in SERVICES["grafana"]["environment"].items()}
    reader = {
        k: interpolate(str(v), env) for k, v in SERVICES["grafana-reader"]["environment"].items()
    }
    assert grafana["GRAFANA_DB_USER"] == reader["GRAFANA_DB_USER"] == env["GRAFANA_DB_USER"]
    assert grafana["GRAFANA_DB_PASSWORD"] == reader["GRAFANA_DB_PASSWORD"]
    assert grafana["GRAFANA_DB_NAME"] == reader["PGDATABASE"] == env["POSTGRES_DB"]
    assert grafana["GRAFANA_DB_HOST"] == f"{reader['PGHOST']}:5432"


PASSWORDS = ["p@ss", "a:b", "x/y", "100%", "%25", "a@b:c/d%e f#g?h", "pässwörd", "plain"]


@pytest.mark.parametrize("use", ["engine", "migrations"])
def test_any_database_password_reaches_the_driver_exactly(use):
    for password in PASSWORDS:
        env = {**set_in_env_example(), "POSTGRES_PASSWORD": password}
        url = service_settings(env).database_url
        if use == "engine":
            url = async_url(url)
        else:  # Alembic's config reads it through configparser (% doubled)
            url = alembic_config(url).get_main_option("sqlalchemy.url")
        parsed = make_url(url)
        assert (parsed.username, parsed.password, parsed.host, parsed.database) == (
            env["POSTGRES_USER"],
            password,
            "postgres",
            env["POSTGRES_DB"],
        ), password


def test_the_example_admin_key_is_one_serve_refuses():
    assert env_example()["METERING_ADMIN_KEY"] == PLACEHOLDER_ADMIN_KEY
    assert placeholder_admin_key(set_in_env_example()["METERING_ADMIN_KEY"])


def test_the_service_migrates_serves_and_is_checked_on_readyz():
    metering = SERVICES["metering"]
    command = metering["command"]
    assert command[:2] == ["metering", "serve"]
    port = command[command.index("--port") + 1]
    assert metering["ports"] == [f"{port}:{port}"]
    assert f"127.0.0.1:{port}/readyz" in " ".join(metering["healthcheck"]["test"])
    assert metering["depends_on"]["postgres"]["condition"] == "service_healthy"
    cmd = re.search(r"^CMD (.+)$", DOCKERFILE, re.M).group(1)
    assert yaml.safe_load(cmd) == command
    assert SERVICES["grafana-reader"]["depends_on"]["metering"]["condition"] == "service_healthy"
    demo = SERVICES["demo-traffic"]["command"]
    assert demo[demo.index("--url") + 1] == f"http://metering:{port}"
    config = interpolate(metering["environment"]["METERING_CONFIG"], {})
    mounts = [interpolate(v, set_in_env_example()).split(":") for v in metering["volumes"]]
    assert ["./metering.demo.toml", config, "ro"] in mounts


def test_every_mounted_file_exists():
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = interpolate(volume, set_in_env_example()).split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source}"
            else:
                assert source in COMPOSE["volumes"], f"{name}: named volume {source}"


def test_the_demo_catalog_file_is_the_demos_catalog():
    with open(ROOT / "metering.demo.toml", "rb") as f:
        compose_catalog = parse_catalog(tomllib.load(f), environ={})

    class Sim:
        def base_url(self, dialect):
            return f"http://sim:9000/{dialect}/v1"

    assert compose_catalog == parse_catalog(demo_catalog(Sim()), environ={})
    sim = SERVICES["sim"]["command"]
    assert all(
        p.base_url.startswith(f"http://sim:{sim[sim.index('--port') + 1]}/")
        for p in compose_catalog.providers.values()
    )


def test_the_deployment_table_lists_the_services_and_ports():
    section = compose_section()
    rows = re.findall(r"^\| `([\w-]+)` \| ([^|]*) \| ([^|]*) \|", section, re.M)
    documented = {name: port.strip() for name, port, _ in rows}
    assert set(documented) == set(SERVICES)
    for name, service in SERVICES.items():
        published = [p.split(":")[0] for p in service.get("ports", [])]
        expected = ", ".join(published) if published else "—"
        assert documented[name] == expected, name
    for profile in ("--profile demo", "cp .env.example .env"):
        assert profile in section


def test_the_image_installs_the_package_as_the_deployment_page_says(tmp_path):
    assert "`pip install .`" in DEPLOYMENT
    # The package after its locked dependencies (tests/deploy/test_pins.py), resolving nothing.
    *_, run = re.findall(r"^RUN pip install (.+?)(?: &&.*)?$", DOCKERFILE, re.M)
    assert shlex.split(run) == ["--no-deps", "--no-build-isolation", "."]
    copied = [
        src
        for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M)
        for src in shlex.split(line)[:-1]
    ]
    assert sorted(copied) == [
        "LICENSE",
        "README.md",
        "metering",
        "migrations",
        "pyproject.toml",
        "requirements.lock",
    ]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(copied) & set(ignored)
    # Build from exactly what the image copies (setuptools' build_py, the step that chooses a
    # wheel's files): the page and the migrations ship.
    source = tmp_path / "src"
    for name in copied:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy(path, source / name)
    out = tmp_path / "lib"
    built = subprocess.run(
        [
            sys.executable,
            "-c",
            "from setuptools import setup; setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(out),
        ],
        cwd=source,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    static = ROOT / "metering" / "dashboard" / "static"
    assert {f"metering/dashboard/static/{p.name}" for p in static.iterdir()} <= names
    assert "metering/migrations/env.py" in names
    assert "metering/migrations/script.py.mako" in names
    migrations = {
        f"metering/migrations/versions/{p.name}"
        for p in (ROOT / "migrations/versions").glob("*.py")
    }
    assert migrations <= names
    # Every package of the source tree is in the build (pyproject lists them).
    packages = {
        str(p.parent.relative_to(ROOT)).replace("migrations", "metering/migrations", 1)
        if p.parts[len(ROOT.parts)] == "migrations"
        else str(p.parent.relative_to(ROOT))
        for p in [*ROOT.glob("metering/**/__init__.py"), *ROOT.glob("migrations/**/__init__.py")]
    }
    assert {f"{package}/__init__.py" for package in packages} <= names


def test_prometheus_scrapes_the_service_with_the_key_and_loads_the_rules(tmp_path):
    """The compose Prometheus: its config passes `promtool check config` (run where the paths
    it names exist), scrapes the metering service's port with the metrics key compose hands it
    as a secret, and loads the rules file compose mounts."""
    prometheus = SERVICES["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    config_path = next(k for k, v in mounts.items() if v == "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load((ROOT / config_path).read_text())
    [rules] = config["rule_files"]
    assert (ROOT / next(k for k, v in mounts.items() if v == rules)).is_file()
    [job] = config["scrape_configs"]
    [target] = job["static_configs"][0]["targets"]
    assert target == "metering:" + SERVICES["metering"]["ports"][0].split(":")[1]
    assert job["authorization"]["credentials_file"] == "/run/secrets/metrics_key"
    assert prometheus["secrets"] == ["metrics_key"]
    assert COMPOSE["secrets"]["metrics_key"] == {"environment": "METERING_METRICS_KEY"}
    assert "METERING_METRICS_KEY" in SERVICES["metering"]["environment"]
    # promtool, with the container's paths made local.
    local = dict(config, rule_files=[str(ROOT / "dashboards/prometheus/metering-alerts.yml")])
    (tmp_path / "key").write_text("k")
    local["scrape_configs"][0]["authorization"]["credentials_file"] = str(tmp_path / "key")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(local))
    checked = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

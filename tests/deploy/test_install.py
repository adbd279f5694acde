"""A clean install: building the package the way `pip install .` and `pip install -e .` do
(setuptools' PEP 517 and PEP 660 hooks, on a copy of the source tree, no network, nothing
installed anywhere) prints no packaging warning, and the wheel holds the page, the migrations and
the license, its metadata the version metering/__init__.py gives."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from metering import __version__

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "test-output", "*.db"
)
# The one notice setuptools prints on every editable install that maps a folder to another
# package name (ours: migrations -> metering.migrations); it is not about our configuration.
EDITABLE_NOTICE = "Editable installation."


@pytest.fixture
def source(tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "metering", "migrations"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, copy / name, ignore=LEFT_OUT)
        else:
            shutil.copy(path, copy / name)
    return copy


def build(source: Path, hook: str, out: Path) -> tuple[str, str]:
    out.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "default",
            "-c",
            f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))",
        ],
        cwd=source,
        capture_output=True,
        text=True,
        # Bytecode is written as pip's own build would (a test run may have it off).
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1], done.stdout + done.stderr


def warnings_in(output: str) -> list[str]:
    return [
        line
        for line in output.splitlines()
        if ("warn" in line.lower() or "would be ignored" in line.lower())
        and EDITABLE_NOTICE not in line
    ]


def test_a_wheel_builds_without_packaging_warnings(source, tmp_path):
    name, output = build(source, "build_wheel", tmp_path / "dist")
    assert warnings_in(output) == []
    assert "Package would be ignored" not in output
    names = set(zipfile.ZipFile(tmp_path / "dist" / name).namelist())
    static = {
        f"metering/dashboard/static/{p.name}"
        for p in (ROOT / "metering/dashboard/static").iterdir()
    }
    assert static <= names
    assert "metering/migrations/env.py" in names
    info = f"metering-{__version__}.dist-info"
    assert f"{info}/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(tmp_path / "dist" / name).read(f"{info}/METADATA").decode()
    assert f"\nVersion: {__version__}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata


def test_an_editable_build_has_no_packaging_warnings(source, tmp_path):
    name, output = build(source, "build_editable", tmp_path / "editable")
    assert name.endswith(".whl")
    assert warnings_in(output) == []
    assert "Package would be ignored" not in output

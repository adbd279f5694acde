"""The README is a door, not the house: a pitch, the quickstart, the feature list and links, in
at most 200 lines; the manual is the site (docs/)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_is_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail to docs/"


def test_the_readme_keeps_the_two_command_quickstart():
    text = README.read_text()
    assert "make demo" in text
    assert "make test" in text  # the command CI runs (.ci/run)


def test_every_link_of_the_readme_to_the_repository_is_there():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links to the documentation"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []

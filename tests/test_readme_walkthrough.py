"""README.md's "Operator walkthrough" runs as printed: its `sh` blocks, in order, in one bash
against a live server (METERING_URL and ADMIN_KEY set as the README says), each curl's status
checked against the `# -> NNN` the README gives it. The README cannot drift from the API."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ADMIN_KEY

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Operator walkthrough"
EXPECTED = re.compile(r"# -> (\d{3})")
# Each curl also appends its status to a file: the README's commands stay as a reader pastes
# them, and their output is what the reader sees.
PRELUDE = """
curl() {
  local body; body=$(mktemp)
  command curl -w '%{http_code}\\n' -o "$body" "$@" >> "$STATUS_FILE"
  cat "$body"; rm -f "$body"
}
"""


def walkthrough() -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```sh\n(.*?)```", text[start:end], re.S)


def test_the_walkthrough_has_every_step():
    script = "\n".join(walkthrough())
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


@pytest.mark.skipif(shutil.which("jq") is None, reason="the walkthrough uses jq")
def test_the_walkthrough_runs_as_printed(api, tmp_path):
    blocks = walkthrough()
    expected = [int(code) for block in blocks for code in EXPECTED.findall(block)]
    statuses = tmp_path / "statuses"
    done = subprocess.run(
        ["bash", "-c", PRELUDE + "\n".join(blocks) + '\necho "TEAM_ID=$TEAM_ID"'],
        env={
            **os.environ,
            "METERING_URL": api.url,
            "ADMIN_KEY": ADMIN_KEY,
            "STATUS_FILE": str(statuses),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = [int(line) for line in statuses.read_text().split()]
    assert got == expected, done.stdout
    # What the steps did is there: the 402 was recorded, the token is revoked.
    team_id = done.stdout.rsplit("TEAM_ID=", 1)[1].strip()
    assert api.ok("GET", f"/v1/teams/{team_id}")["name"] == "research"
    refusals = api.ok("GET", "/v1/refusals", params={"team_id": team_id})["data"]
    assert [r["reason"] for r in refusals] == ["budget"]
    spend = api.ok("GET", "/v1/spend", params={"team_id": team_id})
    assert spend["total"]["requests"] == 1
    assert "402" in done.stdout and "budget_exceeded" in done.stdout

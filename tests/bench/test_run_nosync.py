"""`python -m bench.run --nosync` end to end: a second ours on PostgreSQL, on a database whose
commits do not wait for their WAL flush, measured beside ours and checked like it."""

import pytest

from tests.bench.runs import run_bench

pytestmark = pytest.mark.postgres


@pytest.mark.e2e  # starts a bench run: servers and databases
def test_nosync_measures_a_second_ours_on_postgresql_and_checks_its_ledger(tmp_path):
    done, result = run_bench(
        ["--modes", "pg", "--nosync", "--no-sqlite"]
        + ["--kinds", "json", "--concurrency", "1", "--requests", "10", "--rounds", "1"]
        + ["--warmup", "2", "--hot", "0", "--paced", "0"],
        tmp_path / "run.json",
    )
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"pg", "pg-nosync"}
    assert all(row["requests"] == 10 and row["failed"] == 0 for row in rows.values()), rows
    assert result["proxied"] == {"pg": 12, "pg-nosync": 12}
    labels = [text for ok, text in result["checks"]]
    assert all(ok for ok, _ in result["checks"]), labels
    assert any(
        t.startswith("ours on PostgreSQL, no WAL flush wait: 12 ledger events") for t in labels
    )
    assert "ours, PostgreSQL, no WAL flush wait" in done.stdout

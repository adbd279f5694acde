"""The generated sections of BENCHMARKS.md: bench.run and bench.reports each replace the text
between their own markers and nothing else; the reports' whole plans are printed, not written."""

from pathlib import Path

from bench import report, reports

ROOT = Path(__file__).resolve().parents[2]
PLAN = [
    "Aggregate  (cost=1.00..2.00 rows=1 width=8) (actual time=0.100..0.500 rows=1 loops=1)",
    "  ->  Seq Scan on spend_daily_token  (cost=0.00..1.00 rows=9 width=8)",
]


def _timing(rows: int) -> dict:
    return {"median_ms": 12.0, "min_ms": 11.0, "max_ms": 13.5, "rows": rows}


def _result() -> dict:
    return {
        "org": {"tokens": 2, "users": 2, "teams": 1, "models": 1},
        "generated": {"reused": "metering_bench_reports_kept", "rollups": {"spend_hourly": 10}},
        "events": 100,
        "timed": {
            "named": {"total, 30 days": _timing(1)},
            "dashboard": {"dashboard 24 h: by model": _timing(1)},
            "usage": {"first page, 25 rows (the dashboard's)": _timing(25)},
        },
        "total_requests": 100,
        "events_in_window": 100,
        "usage_csv": None,
        "revision": "abc1234",
        "plans": {
            "total, 30 days": {
                "plan": PLAN,
                "seq_scans": ["spend_daily_token"],
                "buffers": "shared hit=3",
                "execution_ms": 0.5,
            }
        },
    }


def test_the_reports_section_names_its_commit_and_holds_the_plans_table_not_the_plans() -> None:
    section = reports.markdown(_result(), "python -m bench.reports", 5)

    assert section.startswith(reports.BEGIN)
    assert section.endswith(reports.END)
    assert " at commit abc1234, PostgreSQL, one `metering serve` process;" in section
    assert "| total, 30 days | 0.5 | shared hit=3 | spend_daily_token |" in section
    assert "Sequential scans: 1 of 1 plans: total, 30 days (spend_daily_token)." in section
    assert PLAN[0] not in section
    assert PLAN[1] not in section
    assert reports.plan_texts(_result()["plans"]) == "\n".join(
        ["total, 30 days:", "", "```", *PLAN, "```"]
    )


def test_the_reports_section_replaces_only_its_own_markers(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    bench_block = f"{report.BEGIN}\n\nrun figures\n{report.END}"
    path.write_text(
        f"# Benchmarks\n\nby hand\n\n{bench_block}\n\n{reports.BEGIN}\n\nold\n{reports.END}\n\n"
        "after, by hand\n"
    )

    reports.write_section(path, f"{reports.BEGIN}\n\nnew\n{reports.END}")

    assert path.read_text() == (
        f"# Benchmarks\n\nby hand\n\n{bench_block}\n\n{reports.BEGIN}\n\nnew\n{reports.END}\n\n"
        "after, by hand\n"
    )


def test_the_run_section_replaces_only_its_own_markers(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    reports_block = f"{reports.BEGIN}\n\nreports\n{reports.END}"
    path.write_text(
        f"# Benchmarks\n\n{report.BEGIN}\n\nold\n{report.END}\n\nby hand\n\n{reports_block}\n"
    )

    report.write_benchmarks(path, "new\n")

    assert path.read_text() == (
        f"# Benchmarks\n\n{report.BEGIN}\n\nnew\n\n{report.END}\n\nby hand\n\n{reports_block}\n"
    )


def test_benchmarks_md_has_each_generated_section_once_in_order() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    markers = [report.BEGIN, report.END, reports.BEGIN, reports.END]

    assert [text.count(m) for m in markers] == [1, 1, 1, 1]
    assert [text.index(m) for m in markers] == sorted(text.index(m) for m in markers)

"""The targets table of `python -m bench.run`: each throughput ratio with its batches' spread."""

import pytest

from bench import report
from bench.run import batch_ratios


def _row(mode: str, rps: float, batches: list[float], **extra) -> dict:
    return {
        "scenario": "matrix",
        "mode": mode,
        "key": mode,
        "stream": False,
        "concurrency": 16,
        "rps": rps,
        "batch_rps": batches,
        **extra,
    }


def test_a_paths_batches_are_compared_with_the_floors_batches_of_the_same_round():
    assert batch_ratios([300.0, 400.0, 350.0], [600.0, 500.0, 700.0]) == [
        pytest.approx(0.5),
        pytest.approx(0.8),
        pytest.approx(0.5),
    ]
    assert batch_ratios([300.0, 400.0], [0.0, 500.0]) == [pytest.approx(0.8)]  # no floor, no ratio


def test_the_throughput_target_shows_its_batch_by_batch_spread():
    floor = _row("floor", 600.0, [500.0, 700.0, 600.0])
    ratios = batch_ratios([330.0, 490.0, 420.0], floor["batch_rps"])
    ours = _row("pg", 414.0, [330.0, 490.0, 420.0], vs_floor=0.69, vs_floor_batches=ratios)
    table = report.targets({}, [floor, ours], {})
    line = next(x for x in table.splitlines() if "non-stream, C=16" in x)
    assert "0.69 (414 vs 600 req/s); batch by batch 0.66 to 0.70" in line, line
    assert line.rstrip(" |").endswith("not met"), line


def test_one_batch_shows_no_spread():
    floor = _row("floor", 600.0, [600.0])
    ours = _row("pg", 450.0, [450.0], vs_floor=0.75, vs_floor_batches=[0.75])
    line = next(
        x for x in report.targets({}, [floor, ours], {}).splitlines() if "non-stream, C=16" in x
    )
    assert "batch by batch" not in line and "0.75 (450 vs 600 req/s)" in line, line

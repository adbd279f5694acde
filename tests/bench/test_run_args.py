"""bench.run's command line: --baseline adds a second ours on PostgreSQL from another checkout
(--nosync and --traced: one on this checkout with commits not waiting, or traces exported),
and is refused where it cannot work."""

from pathlib import Path

import pytest

from bench.run import parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_baseline_adds_the_other_checkouts_row():
    args = parse_args(["--baseline", str(ROOT), "--modes", "floor,pg", "--no-sqlite"])
    assert args.modes == ["floor", "pg", "pg-base"]
    assert args.baseline == ROOT


def test_baseline_must_be_a_checkout_and_is_not_written(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--baseline", str(tmp_path)])
    assert "no checkout of metering" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--baseline", str(ROOT), "--write"])
    assert "not for BENCHMARKS.md" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--modes", "pg-base"])
    assert "needs --baseline" in capsys.readouterr().err


def test_nosync_adds_ours_without_the_flush_wait_and_is_not_written(capsys):
    args = parse_args(["--nosync", "--modes", "floor,pg", "--no-sqlite"])
    assert args.modes == ["floor", "pg", "pg-nosync"]
    with pytest.raises(SystemExit):
        parse_args(["--nosync", "--write"])
    assert "not for BENCHMARKS.md" in capsys.readouterr().err


def test_traced_adds_ours_with_traces_exported():
    args = parse_args(["--traced", "--modes", "floor,pg", "--no-sqlite"])
    assert args.modes == ["floor", "pg", "pg-traced"]

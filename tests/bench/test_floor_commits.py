"""The floor with commits (`python -m bench.floor --commits DSN`, the floor-commits row of
bench.run): a hold committed before the request goes upstream, the event committed before the
client gets the end of the answer, and nothing else. Its row is what the invariants cost any
design, so it must really write both, in that order."""

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from bench.procs import Process, free_port
from bench.run import parse_args, postgres_database
from tests.bench.runs import run_bench
from tests.conftest import PG_ADMIN_DSN

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.postgres


def test_the_floor_with_commits_is_in_every_default_run():
    assert parse_args([]).modes == ["direct", "floor", "floor-commits", "pg", "sqlite"]


@pytest.fixture
def commits_db():
    with postgres_database(PG_ADMIN_DSN) as (_name, url):
        yield url


@contextlib.contextmanager
def floor_process(sim, dsn: str, log_dir: Path, grouped: bool):
    """`python -m bench.floor --commits DSN` (`--grouped`), until the block ends: its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.floor", "--port", str(port)]
    argv += ["--upstream", sim.base_url("openai"), "--key", "sim-key", "--commits", dsn]
    if grouped:
        argv.append("--grouped")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = Process("floor-grouped" if grouped else "floor-commits", argv, env, ROOT, log_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # it has no route to GET: any answer means it is up
            assert process.popen.poll() is None, process.log_tail()
            assert time.monotonic() < deadline, process.log_tail()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{base}/", timeout=2)
                break
            time.sleep(0.1)
        yield base
    finally:
        process.stop()


@pytest.fixture(params=[False, True], ids=["each", "grouped"])
def floor_with_commits(request, sim, commits_db, tmp_path):
    with floor_process(sim, commits_db, tmp_path, grouped=request.param) as base:
        yield base, commits_db


def _rows(dsn: str, request_id: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        holds = conn.execute("SELECT count(*) FROM floor_holds WHERE id = %s", (request_id,))
        held = holds.fetchone()[0]
        events = conn.execute("SELECT count(*) FROM floor_events WHERE id = %s", (request_id,))
        return held, events.fetchone()[0]


def _body(stream: bool, text: str) -> dict:
    return {
        "model": "gpt-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 64,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def test_a_completion_is_held_then_settled_before_its_answer(floor_with_commits):
    base, dsn = floor_with_commits
    answer = httpx.post(
        f"{base}/v1/chat/completions", json=_body(False, "hello sim:tokens=5"), timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["object"] == "chat.completion"
    # The event was committed before the body was sent: it is there the moment the body is.
    assert _rows(dsn, answer.headers["x-request-id"]) == (0, 1)


def test_a_stream_is_held_while_it_runs_and_settled_before_its_last_chunk(floor_with_commits):
    base, dsn = floor_with_commits
    body = _body(True, "hello sim:tokens=6 sim:chunks=6 sim:delay_ms=150")
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200
        request_id = answer.headers["x-request-id"]
        chunks = answer.iter_raw()
        first = next(chunks)
        assert first.startswith(b"data: ")
        # Upstream and not ended: its hold is committed, its event not yet.
        assert _rows(dsn, request_id) == (1, 0)
        rest = b"".join(chunks)
    assert (first + rest).rstrip().endswith(b"data: [DONE]")
    assert _rows(dsn, request_id) == (0, 1)


def test_a_burst_through_the_grouped_floor_shares_statements(sim, commits_db, tmp_path):
    """Sixteen requests at once through the floor with grouped commits: every one held, then
    settled, in fewer statements than requests."""
    with floor_process(sim, commits_db, tmp_path, grouped=True) as base:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                body = _body(False, "hello sim:tokens=5")
                return await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body) for _ in range(16))
                )

        answers = asyncio.run(burst())
        assert [a.status_code for a in answers] == [200] * 16
        ids = [a.headers["x-request-id"] for a in answers]
        assert all(_rows(commits_db, i) == (0, 1) for i in ids)
        # The rows of one statement share its transaction's now(): the events' held_at is
        # their hold's statement, created_at their own. 32 rows, fewer statements (each on
        # its own, as without --grouped, would be 16 + 16).
        with psycopg.connect(commits_db) as conn:
            holds, events = conn.execute(
                "SELECT count(DISTINCT held_at), count(DISTINCT created_at) FROM floor_events"
                " WHERE id = ANY(%s)",
                (ids,),
            ).fetchone()
        assert holds >= 1 and events >= 1 and holds + events < 32, (holds, events)


@pytest.mark.e2e  # starts a bench run: servers and databases
def test_bench_run_measures_the_floor_with_commits_and_checks_its_events(tmp_path):
    done, result = run_bench(
        ["--modes", "direct,floor,floor-commits,floor-grouped,pg"]
        + ["--kinds", "json,stream", "--concurrency", "1", "--requests", "10", "--rounds", "1"]
        + ["--warmup", "2", "--hot", "0", "--paced", "0"],
        tmp_path / "run.json",
    )
    rows = {(row["mode"], row["stream"]): row for row in result["rows"]}
    for mode in ("floor-commits", "floor-grouped"):
        for stream in (False, True):
            row = rows[(mode, stream)]
            assert row["requests"] == 10 and row["failed"] == 0, row
            assert row["pg_cpu_ms"] is not None, row  # its database's backends are sampled
            assert row["added_p50_ms"] is not None
            # One batch a path (--rounds 1): its throughput and its ratio to the floor's batch.
            assert row["batch_rps"] == [pytest.approx(row["rps"])], row
            floor = rows[("floor", stream)]
            assert row["vs_floor_batches"] == [
                pytest.approx(row["batch_rps"][0] / floor["batch_rps"][0])
            ], row
    checks = {text: ok for ok, text in result["checks"] if text.startswith("floor")}
    # 2 × (10 measured + 2 warm-up) answers and the start-up probe's one.
    assert checks == {
        "floor with commits: 25 events for 25 2xx answers, ids equal to the answers' "
        "x-request-id": True,
        "floor with commits: 0 holds left": True,
        "floor with grouped commits: 25 events for 25 2xx answers, ids equal to the answers' "
        "x-request-id": True,
        "floor with grouped commits: 0 holds left": True,
    }, checks
    assert "floor + two commits (hold, event)" in done.stdout
    assert "floor + two commits, in groups" in done.stdout
    assert all(ok for ok, _ in result["checks"]), result["checks"]
    # Pool churn is ours' alone: one entry per kind, not the floor with commits' too.
    churn = next(line for line in done.stdout.splitlines() if "(pool churn)" in line)
    assert churn.count("non-stream C=1:") == 1 and churn.count(" stream C=1:") == 1, churn
    # The C=1 targets give what the two commits alone add, beside ours.
    assert done.stdout.count("; the floor with commits alone: ") == 2, done.stdout

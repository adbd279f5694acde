"""An attempt ends exactly once: settled into one ledger event when it reached an upstream,
released when nothing went out, whoever asks it to end and however often."""

import asyncio
import contextlib
import uuid
from types import SimpleNamespace

from sqlalchemy import select

from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.views import new_budget
from metering.db import Database, utcnow
from metering.ledger.charge import Usage
from metering.ledger.outcome import Outcome
from metering.ledger.tables import LedgerEvent
from metering.models import Budget, Hold
from metering.proxy.attempt import Attempt
from metering.proxy.dialects import dialect_for
from metering.proxy.live import LiveHolds
from metering.proxy.request import validate
from tests.budgets.conftest import fresh_db, fresh_pg, fresh_sqlite  # noqa: F401 - fixtures
from tests.proxy.conftest import hold_spec

# 100 prompt tokens at 150,000 and 20 completion tokens at 600,000 picodollars each.
COST = 100 * 150_000 + 20 * 600_000


def run(database_url: str, scenario) -> dict:
    """Reserve one hold, run `scenario(attempt)`, and say what the database holds after."""

    async def main() -> dict:
        db = Database(database_url, 4)
        try:
            suffix = uuid.uuid4().hex[:12]
            subjects = {
                "token": f"tok_{suffix}",
                "user": f"user_{suffix}",
                "team": f"team_{suffix}",
            }
            async with db.transaction() as session:
                for scope, subject in subjects.items():
                    session.add(new_budget(subject, scope, None, "never", utcnow()))
            spec = hold_spec(subjects)
            runtime = BudgetRuntime(db)
            reservation = await reserve(runtime, spec, ttl_s=60)
            services = SimpleNamespace(
                settings=SimpleNamespace(settle_retry_s=1.0),
                db=db,
                budgets=runtime,
                live_holds=LiveHolds(),
            )
            chat = validate(
                {"model": "gpt-sim", "messages": [{"role": "user", "content": "hi"}]}, 60
            )
            attempt = Attempt(
                services, spec, reservation, chat, None, dialect_for("openai"), t0=0.0
            )
            await scenario(attempt)
            async with db.sessions() as session:
                events = list(await session.scalars(select(LedgerEvent.id)))
                holds = list(await session.scalars(select(Hold.id)))
                budgets = {
                    b.subject_id: (b.spent, b.reserved)
                    for b in await session.scalars(
                        select(Budget).where(Budget.subject_id.in_(subjects.values()))
                    )
                }
            return {
                "hold_id": spec.hold_id,
                "events": events,
                "holds": holds,
                "budgets": sorted(budgets.values()),
                "live": len(services.live_holds),
            }
        finally:
            await db.dispose()

    return asyncio.run(main())


def test_an_attempt_that_reached_an_upstream_settles_once_however_often_it_ends(fresh_db):  # noqa: F811
    async def scenario(attempt: Attempt) -> None:
        async with attempt:
            assert len(attempt.services.live_holds) == 1  # kept alive while it runs
            attempt.outcome = Outcome(
                http_status=200,
                usage=Usage(prompt_tokens=100, completion_tokens=20, total_tokens=120),
            )
        await attempt.end()
        await attempt.end()

    after = run(fresh_db, scenario)
    assert after["events"] == [after["hold_id"]]
    assert after["holds"] == []
    assert after["budgets"] == [(COST, 0)] * 3
    assert after["live"] == 0


def test_an_attempt_with_nothing_sent_releases_its_hold_once(fresh_db):  # noqa: F811
    async def scenario(attempt: Attempt) -> None:
        try:
            async with attempt:
                raise ConnectionRefusedError("no upstream")
        except ConnectionRefusedError:
            pass
        attempt.outcome = Outcome(http_status=200)  # too late: the attempt has ended
        await attempt.end()

    after = run(fresh_db, scenario)
    assert after["events"] == []
    assert after["holds"] == []
    assert after["budgets"] == [(0, 0)] * 3
    assert after["live"] == 0


def test_a_streaming_response_takes_the_end_over_from_the_with(fresh_db):  # noqa: F811
    async def scenario(attempt: Attempt) -> None:
        async with attempt:
            attempt.hand_over()
        # The stream is still being relayed: the hold is live, nothing settled yet.
        assert len(attempt.services.live_holds) == 1
        attempt.outcome = Outcome(
            http_status=200, usage=Usage(prompt_tokens=100, completion_tokens=20, total_tokens=120)
        )
        await attempt.end()

    after = run(fresh_db, scenario)
    assert after["events"] == [after["hold_id"]]
    assert after["budgets"] == [(COST, 0)] * 3
    assert after["live"] == 0


def test_an_attempt_interrupted_after_it_went_out_is_one_estimated_event(fresh_db):  # noqa: F811
    """A bug or a shutdown after the request was handed to the upstream: the upstream may have
    done the work, so it is charged as an estimate, never released unrecorded."""

    async def scenario(attempt: Attempt) -> None:
        try:
            async with attempt:
                attempt.sent = True
                raise RuntimeError("something unexpected")
        except RuntimeError:
            pass

    after = run(fresh_db, scenario)
    assert after["events"] == [after["hold_id"]]
    assert after["holds"] == []
    assert after["live"] == 0
    spent = [s for s, _ in after["budgets"]]
    assert spent[0] > 0 and spent == [spent[0]] * 3
    assert [r for _, r in after["budgets"]] == [0, 0, 0]


def test_an_attempt_cancelled_after_it_went_out_is_one_event_too(fresh_db):  # noqa: F811
    async def scenario(attempt: Attempt) -> None:
        async def forward() -> None:
            async with attempt:
                attempt.sent = True
                await asyncio.Event().wait()  # on the upstream when the server shuts down

        task = asyncio.ensure_future(forward())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    after = run(fresh_db, scenario)
    assert after["events"] == [after["hold_id"]]
    assert after["holds"] == []


def test_an_error_answer_chosen_after_sending_keeps_its_own_outcome(fresh_db):  # noqa: F811
    """A refusal the forwarding code raised (here: the upstream's timeout) was recorded by it;
    the attempt does not replace it with an estimate."""
    from metering.proxy.transport import FailedBeforeAnswer, UpstreamTimeout

    async def scenario(attempt: Attempt) -> None:
        try:
            async with attempt:
                attempt.sent = True
                attempt.outcome = Outcome(status="timeout", billable=False)
                raise FailedBeforeAnswer(UpstreamTimeout("no answer"))
        except FailedBeforeAnswer:
            pass

    after = run(fresh_db, scenario)
    assert after["events"] == [after["hold_id"]]
    assert after["budgets"] == [(0, 0)] * 3


def test_a_connection_that_never_opened_releases_even_though_sending_began(fresh_db):  # noqa: F811
    from metering.proxy.transport import FailedBeforeAnswer, UpstreamFailed

    async def scenario(attempt: Attempt) -> None:
        try:
            async with attempt:
                attempt.sent = True
                raise FailedBeforeAnswer(UpstreamFailed("could not connect"))
        except FailedBeforeAnswer:
            pass

    after = run(fresh_db, scenario)
    assert after["events"] == []
    assert after["budgets"] == [(0, 0)] * 3

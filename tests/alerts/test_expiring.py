"""token.expiring: 7 days and 1 day before a live token's expiry, once per token, threshold and
expiry, however often the job runs."""

import asyncio

from metering.alerts.service import expiring_tokens
from metering.db import Database
from tests.alerts.conftest import alerts


def _run_job(url: str) -> int:
    async def run() -> int:
        db = Database(url, 2)
        try:
            return await expiring_tokens(db)
        finally:
            await db.dispose()

    return asyncio.run(run())


def _token(api, user_id: str, seconds: int) -> dict:
    body = {"name": "soon", "expires_in": seconds}
    return api.ok("POST", f"/v1/users/{user_id}/tokens", 201, json=body)


def test_tokens_near_their_expiry_are_announced_once_per_threshold(alerts_api, alerts_db):
    team = alerts_api.team()
    user = alerts_api.user(team["id"])
    in_three_days = _token(alerts_api, user["id"], 3 * 86400)
    in_an_hour = _token(alerts_api, user["id"], 3600)
    later = _token(alerts_api, user["id"], 30 * 86400)
    revoked = _token(alerts_api, user["id"], 3600)
    alerts_api.ok("DELETE", f"/v1/tokens/{revoked['id']}", 204)

    _run_job(alerts_db)
    _run_job(alerts_db)  # again: nothing new
    found = {
        (e["data"]["subject_id"], e["data"]["days_before"])
        for e in alerts(alerts_api, type="token.expiring")
    }
    mine = {
        (s, d)
        for s, d in found
        if s in {t["id"] for t in (in_three_days, in_an_hour, later, revoked)}
    }
    assert mine == {(in_three_days["id"], 7), (in_an_hour["id"], 7), (in_an_hour["id"], 1)}
    (event,) = [
        e
        for e in alerts(alerts_api, type="token.expiring")
        if e["data"]["subject_id"] == in_an_hour["id"] and e["data"]["days_before"] == 1
    ]
    assert event["data"]["expires_at"] == in_an_hour["expires_at"]
    assert event["data"]["team_id"] == team["id"]
    # The user sees its own token's events.
    own = alerts(alerts_api, key=in_three_days["token"], type="token.expiring")
    assert {e["data"]["subject_id"] for e in own} == {in_three_days["id"], in_an_hour["id"]}

"""Cached credentials: a change to what a credential may do reaches every replica before the
changing call returns, and a replica whose notification channel is cut never serves a revoked
credential from its cache."""

import asyncio
import time

import asyncpg
import psycopg
import pytest

from metering.auth.cache import CredentialCache
from metering.auth.invalidation import Listener
from metering.db import asyncpg_dsn
from tests.auth.conftest import error_code, new_account

pytestmark = pytest.mark.usefixtures("sim")


def _chat_status(server, credential: str) -> int:
    return server.chat(credential).status_code


def _warm(servers, credential: str) -> None:
    """Two requests on every server: the second is served from its cache."""
    for server in servers:
        for _ in range(2):
            assert _chat_status(server, credential) == 200


CHANGES = {
    "token revoked": lambda api, account: api.ok(
        "DELETE", f"/v1/tokens/{account.api_token['id']}", 204
    ),
    "user deleted": lambda api, account: api.ok("DELETE", f"/v1/users/{account.id}", 204),
    "team deleted": lambda api, account: api.ok("DELETE", f"/v1/teams/{account.team['id']}", 204),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_is_seen_by_the_other_replica_on_the_next_request(api, client, replica, change):
    account = new_account(api)
    other = replica()
    credential = account.api_token["token"]
    _warm([client, other], credential)
    CHANGES[change](api, account)
    for server in (other, client):
        response = server.chat(credential)
        assert response.status_code == 401, response.text
        assert error_code(response) == "invalid_api_key"


def test_a_login_session_deleted_with_its_user_stops_on_the_other_replica(api, client, replica):
    account = new_account(api)
    other = replica()
    access = client.tokens(account.email, account.password)["access_token"]
    _warm([client, other], access)
    api.ok("DELETE", f"/v1/users/{account.id}", 204)
    assert other.chat(access).status_code == 401
    assert client.chat(access).status_code == 401


def test_a_password_change_ends_cached_sessions_on_every_replica(api, client, replica):
    account = new_account(api)
    other = replica()
    access = client.tokens(account.email, account.password)["access_token"]
    _warm([client, other], access)
    api.ok("PATCH", f"/v1/users/{account.id}", json={"password": "another-long-password-1"})
    response = other.chat(access)
    assert response.status_code == 401
    assert "password has changed" in response.json()["error"]["message"]


def _pg(api):
    return psycopg.connect(api.settings.database_url, autocommit=True)


def test_the_changing_call_returns_once_every_replica_has_acknowledged(api, client, replica):
    if api.backend != "postgresql":
        pytest.skip("acknowledgements are PostgreSQL's: SQLite serves from one process")
    account = new_account(api)
    replica()
    replica()
    with _pg(api) as conn:
        # A heartbeat may come late on a loaded machine: wait (bounded) for all three.
        deadline = time.monotonic() + 15
        while True:
            live = conn.execute(
                "SELECT count(*) FROM auth_replicas WHERE heartbeat_at > now() - interval '3 s'"
            ).fetchone()[0]
            if live >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert live >= 3  # this server and the two replicas
        api.ok("DELETE", f"/v1/tokens/{account.api_token['id']}", 204)
        seq = int(
            conn.execute("SELECT value FROM key_values WHERE key = 'auth.change_seq'").fetchone()[0]
        )
        behind = conn.execute(
            "SELECT count(*) FROM auth_replicas "
            "WHERE heartbeat_at > now() - interval '3 s' AND acked_seq < %s",
            (seq,),
        ).fetchone()[0]
    # The server that made the change dropped it itself; every other one had acknowledged.
    assert behind <= 1
    assert client.chat(account.api_token["token"]).status_code == 401


def test_a_replica_whose_listener_is_cut_never_serves_a_revoked_token(api, client, replica):
    if api.backend != "postgresql":
        pytest.skip("the notification channel is PostgreSQL's")
    account = new_account(api)
    other = replica()
    credential = account.api_token["token"]
    _warm([client, other], credential)
    with _pg(api) as conn:
        # Both listeners connected (a loaded machine may still be starting the replica's).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            listening = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = 'metering-auth' AND datname = current_database()"
            ).fetchone()[0]
            if listening >= 2:
                break
            time.sleep(0.05)
        cut = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'metering-auth' AND datname = current_database()"
        ).fetchone()[0]
        assert cut >= 2
        api.ok("DELETE", f"/v1/tokens/{account.api_token['id']}", 204)
    for _ in range(5):
        assert other.chat(credential).status_code == 401
    # Still refused once the listeners are back.
    assert client.chat(credential).status_code == 401


def test_an_entry_read_before_a_change_and_stored_after_it_is_refused():
    cache = CredentialCache(10, 60, always_trusted=True)
    epoch = cache.epoch  # a lookup starts
    cache.drop(frozenset({"token:tok_1"}))  # a change lands while it reads
    cache.put("t:1", "principal", frozenset({"token:tok_1"}), epoch)
    assert cache.get("t:1") is None
    cache.put("t:1", "principal", frozenset({"token:tok_1"}), cache.epoch)
    assert cache.get("t:1").value == "principal"


def test_the_cache_is_bounded_and_drops_by_subject():
    cache = CredentialCache(2, 60, always_trusted=True)
    for n in range(3):
        cache.put(f"t:{n}", n, frozenset({f"user:u{n}", "team:t"}), cache.epoch)
    assert len(cache) == 2
    assert cache.get("t:0") is None
    assert cache.get("t:2").value == 2
    cache.drop(frozenset({"team:t"}))
    assert len(cache) == 0


def test_an_untrusted_cache_serves_nothing():
    cache = CredentialCache(10, 60, always_trusted=False)
    cache.put("t:1", "principal", frozenset(), cache.epoch)
    assert cache.get("t:1") is None
    cache.trust_until(float("inf"))
    assert cache.get("t:1").value == "principal"
    cache.distrust()
    assert cache.get("t:1") is None


def test_a_changed_marker_empties_the_cache():
    marker = ["a"]
    cache = CredentialCache(10, 60, always_trusted=True, watch=lambda: marker[0])
    cache.put("t:1", "principal", frozenset(), cache.epoch)
    assert cache.get("t:1").value == "principal"
    marker[0] = "b"
    assert cache.get("t:1") is None


async def _until(condition) -> None:
    for _ in range(2000):
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in 20 s")


async def _lost_notification(url: str) -> tuple[object, int]:
    cache = CredentialCache(10, 60, always_trusted=False)
    listener = Listener(url, cache, interval_s=0.05)
    listener.start()
    try:

        async def trusted() -> bool:
            return cache.trusted()

        await _until(trusted)
        cache.put("t:1", "principal", frozenset({"token:tok_1"}), cache.epoch)
        assert cache.get("t:1").value == "principal"
        # A change committed without its notification reaching this listener.
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            seq = await conn.fetchval(
                "INSERT INTO key_values (key, value) VALUES ('auth.change_seq', '1') "
                "ON CONFLICT (key) DO UPDATE SET value = (key_values.value::bigint + 1)::text "
                "RETURNING value::bigint"
            )

            async def acknowledged() -> bool:
                acked = await conn.fetchval(
                    "SELECT acked_seq FROM auth_replicas WHERE id = $1", listener.replica_id
                )
                return (acked or 0) >= seq

            await _until(acknowledged)
        finally:
            await conn.close()
        return cache.get("t:1"), seq
    finally:
        await listener.stop()


def test_a_lost_notification_empties_the_cache_before_it_is_acknowledged(api):
    if api.backend != "postgresql":
        pytest.skip("the notification channel is PostgreSQL's")
    entry, seq = asyncio.run(_lost_notification(api.settings.database_url))
    assert seq >= 1
    assert entry is None

"""Login throttling per email: a few failures are free, then locks that grow, end by themselves,
and hold across replicas (the count is in the database)."""

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest

from metering.auth import throttle
from metering.auth.throttle import (
    FORGET_AFTER_S,
    FREE_FAILURES,
    LOCK_MAX_S,
    LoginThrottled,
    count_attempt,
    lock_seconds,
)
from tests.auth.conftest import error_code, new_account

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_lock_grows_from_30_seconds_to_15_minutes():
    assert [lock_seconds(n) for n in range(1, 12)] == [0, 0, 0, 0, 30, 60, 120, 240, 480, 900, 900]
    assert lock_seconds(10_000) == LOCK_MAX_S


def test_the_fifth_failure_locks_and_a_locked_email_is_refused_without_counting():
    failures, last, locked = 0, None, None
    for i in range(FREE_FAILURES):
        count = count_attempt(failures, last, locked, T0 + timedelta(seconds=i))
        failures, last, locked = count.failures, T0 + timedelta(seconds=i), count.locked_until
    assert failures == 5
    assert locked == T0 + timedelta(seconds=4 + 30)
    with pytest.raises(LoginThrottled) as refused:
        count_attempt(failures, last, locked, T0 + timedelta(seconds=10))
    assert refused.value.status == 429
    assert refused.value.headers == {"retry-after": "24", "retry-after-ms": "24000"}
    # Once the lock has passed, one more attempt is let through and counted.
    after = count_attempt(failures, last, locked, locked)
    assert after.failures == 6
    assert after.locked_until == locked + timedelta(seconds=60)


def test_failures_are_forgotten_an_hour_after_the_last_one():
    count = count_attempt(9, T0, None, T0 + timedelta(seconds=FORGET_AFTER_S))
    assert count.failures == 1
    assert count.locked_until is None


def test_a_lock_never_outlasts_fifteen_minutes_after_the_last_failure():
    count = count_attempt(40, T0, None, T0 + timedelta(seconds=1))
    assert count.locked_until == T0 + timedelta(seconds=1 + LOCK_MAX_S)


def test_after_five_wrong_passwords_even_the_right_one_gets_429(client, api):
    account = new_account(api)
    for _ in range(FREE_FAILURES):
        response = client.login(account.email, "wrong-password")
        assert response.status_code == 401
        assert error_code(response) == "invalid_api_key"
    response = client.login(account.email, account.password)
    assert response.status_code == 429
    assert error_code(response) == "rate_limited"
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(response.headers["retry-after"]) <= 30
    # Other emails are not affected; nor are the user's API tokens.
    other = new_account(api)
    assert client.login(other.email, other.password).status_code == 200
    assert client.chat(account.api_token["token"]).status_code == 200


def test_unknown_emails_are_throttled_alike(client):
    email = f"nobody-{uuid.uuid4().hex}@example.com"
    codes = [client.login(email, "guess").status_code for _ in range(FREE_FAILURES + 1)]
    assert codes == [401] * FREE_FAILURES + [429]


def test_a_right_password_clears_the_count(client, api):
    account = new_account(api)
    for _ in range(FREE_FAILURES - 1):
        assert client.login(account.email, "wrong-password").status_code == 401
    assert client.login(account.email, account.password).status_code == 200
    for _ in range(FREE_FAILURES - 1):
        assert client.login(account.email, "wrong-password").status_code == 401
    assert client.login(account.email, account.password).status_code == 200


def test_the_lock_ends_by_itself(client, api, monkeypatch, clock):
    monkeypatch.setattr(throttle, "LOCK_BASE_S", 1)
    account = new_account(api)
    for _ in range(FREE_FAILURES):
        assert client.login(account.email, "wrong-password").status_code == 401
    assert client.login(account.email, account.password).status_code == 429
    clock.advance(1.5)
    assert client.login(account.email, account.password).status_code == 200


def test_parallel_guesses_on_two_replicas_get_five_tries_in_all(client, api, replica):
    account = new_account(api)
    servers = [client, replica()]

    def guess(i):
        return servers[i % 2].login(account.email, f"guess-{i}").status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(guess, range(16)))
    assert sorted(codes) == [401] * FREE_FAILURES + [429] * (16 - FREE_FAILURES)

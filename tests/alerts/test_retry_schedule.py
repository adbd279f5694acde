"""The retry schedule: the first retry after the base delay, doubling, capped, then failed once
the retry period is over."""

from datetime import UTC, datetime, timedelta

from metering.alerts.outbox.delivery import Policy, excerpt

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def test_retries_double_from_one_second_up_to_an_hour_for_a_day():
    policy = Policy()
    now, delays = T0, []
    for attempts in range(1, 100):
        at = policy.next_attempt(attempts, T0, now)
        if at is None:
            break
        delays.append((at - now).total_seconds())
        now = at
    assert delays[:13] == [2.0**k for k in range(12)] + [3600.0]
    assert set(delays[12:]) == {3600.0}
    assert now <= T0 + timedelta(days=1) < now + timedelta(hours=1)
    assert len(delays) == 12 + 22  # 4095 s of doubling, then hourly to the end of the day


def test_a_small_base_gives_the_same_shape():
    policy = Policy(base_s=0.05, max_s=0.2, retry_for_s=1)
    assert policy.next_attempt(1, T0, T0) == T0 + timedelta(seconds=0.05)
    assert policy.next_attempt(3, T0, T0) == T0 + timedelta(seconds=0.2)
    assert policy.next_attempt(9, T0, T0 + timedelta(seconds=0.9)) is None


def test_an_answer_is_kept_as_a_short_printable_excerpt():
    kept = excerpt(b"\x00\x1b[31mred\xff" + b"y" * 1000)
    assert len(kept) == 200 and kept.isprintable()

"""The ledger's ids (metering.ids): 32 hex digits after the prefix, the first 12 the creation
time in milliseconds, so that later ids sort after earlier ones; 80 random bits after it."""

import re
import time

from metering.ids import time_ordered
from metering.ledger.external import new_event_id
from metering.requestid import new_request_id

SHAPE = re.compile(r"(req|evt)_([0-9a-f]{12})([0-9a-f]{20})")


def test_an_id_carries_its_creation_time_then_random_bits():
    before = time.time_ns() // 1_000_000
    made = time_ordered("req")
    after = time.time_ns() // 1_000_000
    prefix, millis, rest = SHAPE.fullmatch(made).groups()
    assert prefix == "req"
    assert before <= int(millis, 16) <= after
    assert len(rest) == 20


def test_later_ids_sort_after_earlier_ones():
    made = []
    for _ in range(5):
        made.append(time_ordered("evt"))
        time.sleep(0.002)  # the next millisecond at least
    assert sorted(made) == made
    assert len(set(made)) == len(made)


def test_ids_made_in_the_same_millisecond_differ():
    made = [time_ordered("req") for _ in range(100_000)]
    assert len(set(made)) == len(made)
    # Many share a millisecond: only their random part tells them apart.
    assert len({m[4:16] for m in made}) < len(made)


def test_request_and_event_ids_are_time_ordered():
    state: dict = {}
    new_request_id(state)
    assert SHAPE.fullmatch(state["request_id"]).group(1) == "req"
    assert SHAPE.fullmatch(new_event_id()).group(1) == "evt"

"""The patterns /openapi.json declares are the rules the service checks: what a pattern takes,
the service takes (and, where the pattern is the whole rule, what it refuses, the service
refuses). And what the fuzz runs found, fixed: each as a request against the real server."""

import re
from datetime import UTC, datetime, timedelta, timezone

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from metering.reports.focus import WHOLE_HOUR_PATTERN
from metering.text import problem, stripped_pattern
from metering.timefmt import MOMENT_PATTERN, parse_rfc3339
from tests.fuzz import runner

OFFSETS = st.integers(min_value=-(23 * 60 + 59), max_value=23 * 60 + 59)


def _text(moment: datetime, minutes: int, fraction: bool) -> str:
    """`moment` (UTC) written in the zone `minutes` from UTC, RFC 3339."""
    local = moment.astimezone(timezone(timedelta(minutes=minutes)))
    sign, whole = ("-" if minutes < 0 else "+"), abs(minutes)
    stamp = local.strftime("%Y-%m-%dT%H:%M:%S") + (f".{local.microsecond:06d}" if fraction else "")
    return f"{stamp}{sign}{whole // 60:02d}:{whole % 60:02d}"


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(min_value=datetime(1999, 12, 30), max_value=datetime(3000, 1, 2)),
    OFFSETS,
    st.booleans(),
)
def test_moment_pattern_takes_what_the_parser_takes(moment, minutes, fraction):
    moment = moment.replace(tzinfo=UTC)
    if not fraction:
        moment = moment.replace(microsecond=0)
    text = _text(moment, minutes, fraction)
    try:
        parse_rfc3339(text)
        parsed = True
    except ValueError:
        parsed = False
    declared = re.fullmatch(MOMENT_PATTERN, text) is not None
    if declared:
        assert parsed, text  # never more than the service takes
    inside = datetime(2000, 1, 2, tzinfo=UTC) <= moment < datetime(2999, 12, 31, tzinfo=UTC)
    if inside:
        assert declared == parsed, text  # away from the edge days, exactly its rule


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(min_value=datetime(2000, 1, 2), max_value=datetime(2999, 12, 30)),
    OFFSETS,
    st.sampled_from([0, 0, 1, 59]),
)
def test_whole_hour_pattern_is_a_whole_utc_hour(moment, minutes, off):
    moment = moment.replace(minute=0, second=0, microsecond=0, tzinfo=UTC)
    moment += timedelta(seconds=off)
    text = _text(moment, minutes, fraction=False)
    assert (re.fullmatch(WHOLE_HOUR_PATTERN, text) is not None) == (off == 0), text


class _Stripped(BaseModel):
    model_config = ConfigDict(str_strip_whitespace=True)
    one: str | None = Field(None, min_length=1)
    eight: str | None = Field(None, min_length=8)


SPACES = " \t\n\r\x0b\x0c\x85\xa0\u2003\u3000"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=SPACES + "ab\u00e9", max_size=12))
def test_stripped_pattern_counts_as_the_model_strips(text):
    for field, least in (("one", 1), ("eight", 8)):
        try:
            _Stripped(**{field: text})
            # and RequestBody's own check: no control character but at the ends
            taken = problem(text.strip(" \t\n\r\x0b\x0c")) is None
        except ValidationError:
            taken = False
        assert (re.fullmatch(stripped_pattern(least), text) is not None) == taken, (field, text)


def test_every_data_rule_names_its_param(api):
    """The operations with data rules, as the fuzz run's configuration reads them."""
    schema = runner.document(api.url)
    listed = runner.with_data_rules(schema)
    assert {"create_team_v1_teams_post", "list_usage_v1_usage_get"} <= set(listed)
    for operations in schema["paths"].values():
        for operation in operations.values():
            answer = operation.get("responses", {}).get("400", {})
            for rule in answer.get(runner.DATA_RULES, []):
                assert rule["rule"] and rule["rule"] in answer["description"], operation


@pytest.mark.parametrize("value", [5.0, 5])
def test_a_whole_number_with_a_point_is_an_integer(api, value):
    team = api.ok(
        "POST", "/v1/teams", 201, json={"name": f"w-{value}-{api.backend}", "rpm_limit": value}
    )
    assert team["rpm_limit"] == 5 and type(team["rpm_limit"]) is int
    refused = api.request("PATCH", f"/v1/teams/{team['id']}", json={"rpm_limit": 5.5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "rpm_limit"


def test_a_focus_edge_far_off_is_still_read_as_sent(api):
    """Clamped into the stored years it would be a whole hour; as sent it is not one."""
    for start in ("1500-01-01T00:30:00Z", "6045-11-09T22:06:00,0000-05:06"):
        answer = api.request("GET", "/v1/exports/focus", params={"start": start})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "start"
    whole = api.request("GET", "/v1/exports/focus", params={"start": "2026-01-01T10:30:00+05:30"})
    assert whole.status_code == 200, whole.text


def test_a_chat_request_s_whole_number_with_a_point(api):
    _, _, token = api.principal()
    answer = httpx.post(
        f"{api.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {token['token']}"},
        json={
            "model": "gpt-sim",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5.0,
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["object"] == "chat.completion"


@pytest.mark.parametrize("path", ["/v1/users/", "/v1/teams/", "/v1/tokens/"])
def test_an_empty_id_names_nothing(api, path):
    """Found by the stateful phase: /v1/users/ was redirected to the listing, which answered a
    read of one user with a list."""
    answer = api.request("GET", path, follow_redirects=False)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "not_found"

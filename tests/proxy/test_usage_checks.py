"""Usage is checked before it is charged: an upstream that reports more than the request
allowed, absurd or invalid counts, or usage in a body that is not UTF-8, through the real
server and a simulated upstream told what usage to report (`sim:usage=<JSON>`)."""

import csv
import io
import json
import re
import uuid
from datetime import UTC, datetime

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering.ledger.charge import Allowance, Usage, charge_for
from metering.ledger.event import DETAIL_FIELDS, MAX_UNCHARGED
from metering.money import cost_pico, format_usd
from metering.proxy.estimate import UPPER_BOUND_MARGIN, estimate_prompt_tokens, estimate_text_tokens
from metering.proxy.reported import COUNT_CEILING, usage_from_json
from tests.budgets.conftest import budget, pico, usd

IN, CACHED, OUT = 150_000, 75_000, 600_000  # gpt-sim, micro-USD per 1M tokens = pico per token
LIMIT = "0.001"


def body_of(text: str, *, max_tokens: int = 100, stream: bool = False, **extra) -> bytes:
    body = {
        "model": "gpt-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


def post(api, key: str, raw: bytes) -> httpx.Response:
    return api.request(
        "POST",
        "/v1/chat/completions",
        key=key,
        content=raw,
        headers={"content-type": "application/json"},
    )


def hold_of(raw: bytes, max_tokens: int = 100, choices: int = 1) -> int:
    """What the proxy holds for this body: its prompt bound at the input price, and
    max_tokens per choice at the output price."""
    return (len(raw) + UPPER_BOUND_MARGIN) * max(IN, CACHED) + max_tokens * choices * OUT


def metric(api, name: str, **labels) -> float:
    text = api.request("GET", "/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def only_event(api, token_id: str) -> dict:
    (event,) = api.events(token_id=token_id)
    return event


def test_usage_beyond_the_request_never_takes_a_budget_past_its_limit(api):
    """The issue's case: limits of 0.001 USD at token, user and team, an upstream reporting
    5000 prompt and 5000 completion tokens for max_tokens 100. Each request is charged its
    hold at most; the budgets end at or below their limit; every event says why."""
    team, user, token = api.principal(token_limit=LIMIT, user_limit=LIMIT, team_limit=LIMIT)
    usage = '{"prompt_tokens": 5000, "completion_tokens": 5000, "total_tokens": 10000}'
    reported = 5000 * IN + 5000 * OUT
    anomalies_before = metric(
        api,
        "metering_usage_anomalies_total",
        model="gpt-sim",
        provider="sim-openai",
        reason="prompt_above_bound",
    )
    uncharged_before = metric(
        api, "metering_uncharged_usd_total", model="gpt-sim", provider="sim-openai"
    )
    holds, refused = [], None
    for i in range(40):
        raw = body_of(f"lie {i} {uuid.uuid4().hex} sim:usage={usage}")
        response = post(api, token["token"], raw)
        if response.status_code == 402:
            refused = raw
            break
        assert response.status_code == 200, response.text
        # The client gets the upstream's answer as it came.
        assert response.json()["usage"]["prompt_tokens"] == 5000
        holds.append(hold_of(raw))
        for scope, subject in (("token", token), ("user", user), ("team", team)):
            status = budget(api, scope, subject["id"])
            assert pico(status["spent"]) == sum(holds) <= pico(LIMIT)
            assert pico(status["reserved"]) == 0
    assert refused is not None and holds
    assert sum(holds) + hold_of(refused) > pico(LIMIT)  # refused only when it could not fit

    events = sorted(api.events(token_id=token["id"]), key=lambda e: e["created_at"])
    assert len(events) == len(holds)
    for event, hold in zip(events, holds, strict=True):
        assert event["status"] == "ok"
        assert event["usage_source"] == "reported"
        assert (event["prompt_tokens"], event["completion_tokens"]) == (5000, 5000)
        # Prompt beyond the request's own size comes first; completion beyond max_tokens too.
        assert event["usage_anomaly"] == "prompt_above_bound"
        assert event["cost"] == format_usd(hold)
        assert event["uncharged"] == format_usd(reported - hold)

    # /v1/spend sums what was not charged next to what was.
    spend = api.ok("GET", "/v1/spend", params={"token_id": token["id"]})
    assert spend["total"]["cost"] == format_usd(sum(holds))
    assert spend["total"]["uncharged"] == format_usd(len(holds) * reported - sum(holds))
    # /metrics counts the anomalies and the uncharged USD.
    anomalies = metric(
        api,
        "metering_usage_anomalies_total",
        model="gpt-sim",
        provider="sim-openai",
        reason="prompt_above_bound",
    )
    assert anomalies - anomalies_before == len(holds)
    uncharged = metric(api, "metering_uncharged_usd_total", model="gpt-sim", provider="sim-openai")
    assert uncharged - uncharged_before == pytest.approx(
        float(usd(format_usd(len(holds) * reported - sum(holds)))), rel=1e-9
    )


def test_usage_and_uncharged_in_the_usage_csv_and_reconciliation(api):
    _, _, token = api.principal()
    raw = body_of(
        f"csv {uuid.uuid4().hex} "
        'sim:usage={"prompt_tokens": 20, "completion_tokens": 900, "total_tokens": 920}',
        max_tokens=50,
    )
    assert post(api, token["token"], raw).status_code == 200
    event = only_event(api, token["id"])
    hold, reported = hold_of(raw, 50), 20 * IN + 900 * OUT
    assert event["usage_anomaly"] == "completion_above_max_tokens"
    assert event["completion_tokens"] == 900
    assert (event["cost"], event["uncharged"]) == (format_usd(hold), format_usd(reported - hold))

    response = api.request("GET", "/v1/usage", params={"token_id": token["id"], "format": "csv"})
    (row,) = list(csv.DictReader(io.StringIO(response.text)))
    assert row["usage_anomaly"] == "completion_above_max_tokens"
    assert (row["cost"], row["uncharged"]) == (format_usd(hold), format_usd(reported - hold))

    # The provider bills what it reported: reconciliation compares against cost + uncharged.
    day = datetime.now(UTC).date().isoformat()
    export = (
        "date,provider,model,prompt_tokens,completion_tokens,cost,upstream_id\n"
        f"{day},sim-openai,sim/gpt,20,900,{format_usd(reported)},{event['upstream_id']}\n"
    )
    result = api.ok(
        "POST",
        "/v1/reconciliations",
        201,
        params={"provider": "sim-openai"},
        content=export.encode(),
        headers={"content-type": "text/csv"},
    )
    (found,) = [r for r in result["requests"] if r["upstream_id"] == event["upstream_id"]]
    assert found["status"] == "matched"
    assert found["ledger"]["cost"] == format_usd(reported)
    assert found["uncharged"] == format_usd(reported - hold)
    assert found["anomalous_events"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("digits", [12, 20, 400, 5000])
def test_absurd_counts_are_recorded_at_the_ceiling_and_charged_at_most_the_hold(
    api, stream, digits
):
    """prompt_tokens of 10**12, 10**20, a 401-digit and a 5001-digit number: a 200, one event
    (not `unsettled`), counts at the ceiling, the hold charged, nothing overflows."""
    team, user, token = api.principal(team_limit="1")
    huge = "1" + "0" * digits
    raw = body_of(
        f"huge {uuid.uuid4().hex} "
        f'sim:usage={{"prompt_tokens": {huge}, "completion_tokens": 3, "total_tokens": {huge}}}',
        stream=stream,
    )
    response = post(api, token["token"], raw)
    assert response.status_code == 200, response.text
    event = only_event(api, token["id"])
    hold = hold_of(raw)
    assert event["status"] == "ok"
    assert event["usage_source"] == "reported"
    assert event["usage_anomaly"] == "count_above_ceiling"
    assert event["prompt_tokens"] == COUNT_CEILING
    assert event["total_tokens"] == COUNT_CEILING
    assert event["completion_tokens"] == 3
    assert event["cost"] == format_usd(hold)
    assert event["uncharged"] == format_usd(COUNT_CEILING * IN + 3 * OUT - hold)
    assert pico(budget(api, "team", team["id"])["spent"]) == hold


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_a_negative_count_is_never_recorded_as_reported(api, sim, stream):
    """completion_tokens -500: not 0 "reported" but an estimate, flagged invalid_count."""
    _, _, token = api.principal()
    tag = uuid.uuid4().hex
    text = f'neg {tag} sim:tokens=12 sim:usage={{"prompt_tokens": 30, "completion_tokens": -500}}'
    raw = body_of(text, stream=stream)
    response = post(api, token["token"], raw)
    assert response.status_code == 200, response.text
    event = only_event(api, token["id"])
    (record,) = [r for r in sim.log() if tag in json.dumps(r["received"])]
    assert event["usage_source"] == "estimated"
    assert event["usage_anomaly"] == "invalid_count"
    assert event["prompt_tokens"] == estimate_prompt_tokens(json.loads(raw))
    assert event["completion_tokens"] == estimate_text_tokens(record["content"]) > 0
    assert event["cost"] == format_usd(
        event["prompt_tokens"] * IN + event["completion_tokens"] * OUT
    )
    assert event["uncharged"] == "0"


def test_usage_is_read_from_a_body_that_is_not_utf8(api, sim):
    """A non-streaming answer with two bytes of invalid UTF-8 in its text and a valid usage
    object: the usage is read (before, it was estimated as 11/0)."""
    _, _, token = api.principal()
    tag = uuid.uuid4().hex
    raw = body_of(f"bytes {tag} sim:tokens=7 sim:invalid_utf8=1")
    response = post(api, token["token"], raw)
    assert response.status_code == 200, response.text
    assert b"\xff\xfe" in response.content  # relayed as it came
    (record,) = [r for r in sim.log() if tag in json.dumps(r["received"])]
    event = only_event(api, token["id"])
    assert event["usage_source"] == "reported"
    assert event["usage_anomaly"] is None
    assert event["prompt_tokens"] == record["usage"]["prompt_tokens"]
    assert event["completion_tokens"] == record["usage"]["completion_tokens"] == 7
    assert event["cost"] == format_usd(record["usage"]["prompt_tokens"] * IN + 7 * OUT)


# --- the checking function --------------------------------------------------------------

BIGINT = 2**63 - 1
COUNT = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5)
    | st.sampled_from([0, 1, COUNT_CEILING, COUNT_CEILING + 1, 10**20, 10**400])
)
USAGE = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": COUNT,
        "completion_tokens": COUNT,
        "total_tokens": COUNT,
        "prompt_tokens_details": st.dictionaries(
            st.sampled_from(["cached_tokens", "audio_tokens"]), COUNT
        ),
        "completion_tokens_details": st.dictionaries(
            st.sampled_from(["reasoning_tokens", "audio_tokens", "accepted_prediction_tokens"]),
            COUNT,
        ),
    },
)
PRICE = st.integers(min_value=0, max_value=10**12)  # up to MAX_USD per 1M tokens


@settings(max_examples=500, deadline=None)
@given(
    USAGE,
    st.integers(min_value=0, max_value=10**7),
    st.integers(min_value=1, max_value=10**7),
    st.integers(min_value=1, max_value=128),
    st.tuples(PRICE, PRICE, PRICE),
    st.integers(min_value=0, max_value=3000),
)
def test_any_reported_usage_is_charged_at_most_the_hold_and_fits_the_columns(
    obj, prompt_bound, max_tokens, choices, prices, estimated_completion
):
    input_price, cached_price, output_price = prices
    hold = prompt_bound * max(input_price, cached_price) + max_tokens * choices * output_price
    limits = Allowance(
        prompt_tokens=prompt_bound, completion_tokens=max_tokens * choices, hold=hold
    )
    estimate = Usage(prompt_tokens=7, completion_tokens=estimated_completion, total_tokens=7)
    reported = usage_from_json(obj)
    charge = charge_for(reported, lambda: estimate, limits, prices)

    assert 0 <= charge.cost <= hold
    assert 0 <= charge.uncharged <= MAX_UNCHARGED
    usage = charge.usage
    for name in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"):
        assert 0 <= getattr(usage, name) <= BIGINT
    for name in DETAIL_FIELDS:
        assert getattr(usage, name) is None or 0 <= getattr(usage, name) <= COUNT_CEILING
    full = cost_pico(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, *prices)
    assert charge.cost == min(full, hold)
    assert charge.uncharged == min(full - charge.cost, MAX_UNCHARGED)
    if reported is None or not reported.usable:
        assert charge.source == "estimated" and usage == estimate
        assert charge.anomaly == (reported.anomaly if reported else None) or (
            charge.anomaly == "estimate_above_hold"
        )
    else:
        assert charge.source == "reported"
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            assert getattr(usage, name) <= COUNT_CEILING
        if usage.prompt_tokens > prompt_bound or usage.completion_tokens > max_tokens * choices:
            assert charge.anomaly is not None
    if charge.uncharged:
        assert charge.anomaly is not None  # never an uncharged amount without a reason


def test_each_anomaly_is_named():
    limits = Allowance(prompt_tokens=100, completion_tokens=50, hold=10**12)
    prices = (IN, CACHED, OUT)

    def anomaly(obj):
        return charge_for(usage_from_json(obj), Usage, limits, prices).anomaly

    assert anomaly({"prompt_tokens": 10, "completion_tokens": 5}) is None
    assert anomaly({"prompt_tokens": 101, "completion_tokens": 5}) == "prompt_above_bound"
    assert anomaly({"prompt_tokens": 10, "completion_tokens": 51}) == "completion_above_max_tokens"
    assert anomaly({"prompt_tokens": 10**10, "completion_tokens": 5}) == "count_above_ceiling"
    assert anomaly({"prompt_tokens": 10, "completion_tokens": -1}) == "invalid_count"
    assert anomaly({"prompt_tokens": 10}) == "missing_count"
    assert (
        anomaly(
            {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 11},
            }
        )
        == "cached_above_prompt"
    )
    assert (
        anomaly(
            {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "completion_tokens_details": {"reasoning_tokens": 6},
            }
        )
        == "details_above_completion"
    )
    # No usage reported at all is not an anomaly: the estimate is the normal case then.
    assert anomaly(None) is None
    over = charge_for(
        None, lambda: Usage(prompt_tokens=10, completion_tokens=10**7), limits, prices
    )
    assert over.anomaly == "estimate_above_hold"
    assert (over.cost, over.source) == (10**12, "estimated")

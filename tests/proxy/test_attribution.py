"""End users and tags of proxied requests, end to end: official SDK -> proxy -> simulated
upstream, on both databases.

The end user is x-metering-end-user, else `user`, else `safety_identifier`; the tags are
`metadata` with x-metering-tags on top. Both land on the ledger event (read back through
GET /v1/usage); every bound is a 400 naming its field, before anything is held or sent; and
what each provider receives (the simulator's log) never holds `metadata`, and holds `user` and
`safety_identifier` only where the provider's document takes them."""

import json
from decimal import Decimal

import httpx
import openai
import pytest

from tests.proxy.conftest import serving, sim_log, sim_record, user, wait_events
from tests.proxy.test_dialects import MODELS as DIALECT_MODELS
from tests.proxy.test_dialects import dialect_catalog

END_USER, TAGS = "x-metering-end-user", "x-metering-tags"
# The dialects whose document takes `user` and `safety_identifier` (OpenAI's reference;
# TokenChange passes other OpenAI fields on); Exascale's and Genesis' tables list neither,
# NIM's closed schema has neither.
SENDS_IDENTIFIERS = {"openai", "tokenchange"}


@pytest.fixture
def token(api):
    return api.principal()[2]


def one_event(api, token: dict) -> dict:
    [event] = wait_events(api, token["id"], 1)
    return event


def create(api, token: dict, **kwargs):
    """A gpt-sim completion through the SDK; (the completion, its ledger event)."""
    client = api.openai(token["token"])
    completion = client.chat.completions.create(
        model="gpt-sim", messages=user("Hi sim:tokens=3"), **kwargs
    )
    return completion, one_event(api, token)


# --- the end user -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "end_user"),
    [
        pytest.param({"extra_headers": {END_USER: "cust-h"}}, "cust-h", id="header"),
        pytest.param({"user": "cust-u"}, "cust-u", id="user"),
        pytest.param({"safety_identifier": "cust-s"}, "cust-s", id="safety_identifier"),
        pytest.param(
            {"extra_headers": {END_USER: "cust-h"}, "user": "cust-u", "safety_identifier": "s"},
            "cust-h",
            id="header-over-user-and-safety_identifier",
        ),
        pytest.param(
            {"user": "cust-u", "safety_identifier": "cust-s"}, "cust-u", id="user-over-safety"
        ),
        pytest.param({}, None, id="none"),
    ],
)
def test_the_end_user_is_the_header_else_user_else_safety_identifier(
    api, sim, token, sent, end_user
):
    completion, event = create(api, token, **sent)
    assert event["end_user"] == end_user
    assert event["tags"] == {}
    # OpenAI's document takes both fields: what the client sent goes up as sent, never the
    # header.
    record = sim_record(sim, completion.id)
    received = record["received"]
    for field in ("user", "safety_identifier"):
        assert received.get(field) == sent.get(field)
    assert END_USER not in record["headers"]


def post(api, token: dict, headers: dict, **body) -> httpx.Response:
    """A chat completion with headers as raw bytes (the SDK sends ASCII header values only)."""
    body = {"model": "gpt-sim", "messages": user("Hi sim:tokens=3"), **body}
    return httpx.post(
        f"{api.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}", **headers},
        timeout=30,
    )


def test_a_non_ascii_end_user_header_is_read_as_utf8(api, sim, token):
    response = post(api, token, {END_USER: "Zoë Ångström".encode()})
    assert response.status_code == 200, response.text
    assert one_event(api, token)["end_user"] == "Zoë Ångström"


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("nel\u0085".encode(), id="a-C1-control"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
    ],
)
def test_an_end_user_header_that_is_no_printable_utf8_is_a_400(api, sim, token, value):
    response = post(api, token, {END_USER: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == END_USER
    assert api.events(token_id=token["id"]) == []


def test_the_end_user_filter_of_usage_finds_it(api, sim, token):
    create(api, token, user="cust-filter")
    [event] = api.events(token_id=token["id"], end_user="cust-filter")
    assert event["end_user"] == "cust-filter"
    assert api.events(token_id=token["id"], end_user="someone-else") == []


# --- the tags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "tags"),
    [
        pytest.param({"metadata": {"feature": "search"}}, {"feature": "search"}, id="metadata"),
        pytest.param(
            {"extra_headers": {TAGS: '{"project": "apollo", "env": "prod"}'}},
            {"env": "prod", "project": "apollo"},
            id="header",
        ),
        pytest.param(
            {
                "metadata": {"feature": "search", "env": "dev"},
                "extra_headers": {TAGS: '{"env": "prod", "team": "core"}'},
            },
            {"env": "prod", "feature": "search", "team": "core"},
            id="merged-header-wins",
        ),
        pytest.param({"metadata": {}}, {}, id="empty-metadata"),
    ],
)
def test_tags_are_metadata_with_the_header_on_top(api, sim, token, sent, tags):
    completion, event = create(api, token, **sent)
    assert event["tags"] == tags
    assert event["end_user"] is None
    record = sim_record(sim, completion.id)
    assert "metadata" not in record["received"]
    assert TAGS not in record["headers"]


def test_sixteen_tags_of_the_longest_keys_and_values_are_kept(api, sim, token):
    metadata = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}
    _, event = create(api, token, metadata=metadata, user="u" * 256)
    assert event["tags"] == metadata
    assert event["end_user"] == "u" * 256


# --- every bound: a 400 naming the field, nothing held, sent or charged ------------------------

TOO_MANY = {f"k{i}": "v" for i in range(17)}
SIXTEEN = {f"k{i}": "v" for i in range(16)}


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        pytest.param({"extra_headers": {END_USER: "x" * 257}}, END_USER, id="header-too-long"),
        pytest.param({"extra_headers": {END_USER: ""}}, END_USER, id="header-empty"),
        pytest.param({"extra_headers": {END_USER: "a\tb"}}, END_USER, id="header-with-a-tab"),
        pytest.param(
            {"extra_headers": {END_USER: "x" * 257}, "user": "fine"},
            END_USER,
            id="bad-header-with-good-user",
        ),
        pytest.param({"user": "x" * 257}, "user", id="user-too-long"),
        pytest.param({"user": ""}, "user", id="user-empty"),
        pytest.param({"user": "tab\there"}, "user", id="user-not-printable"),
        pytest.param({"extra_body": {"user": 42}}, "user", id="user-not-a-string"),
        pytest.param({"safety_identifier": "x" * 257}, "safety_identifier", id="safety-too-long"),
        pytest.param({"safety_identifier": "nl\n"}, "safety_identifier", id="safety-not-printable"),
        pytest.param({"metadata": TOO_MANY}, "metadata", id="metadata-17-pairs"),
        pytest.param({"metadata": {"k" * 65: "v"}}, "metadata", id="metadata-65-char-key"),
        pytest.param({"metadata": {"": "v"}}, "metadata", id="metadata-empty-key"),
        pytest.param({"metadata": {"k": "v" * 513}}, "metadata", id="metadata-513-char-value"),
        pytest.param({"extra_body": {"metadata": {"k": 1}}}, "metadata", id="metadata-number"),
        pytest.param({"extra_body": {"metadata": {"k": None}}}, "metadata", id="metadata-null"),
        pytest.param({"extra_body": {"metadata": ["k", "v"]}}, "metadata", id="metadata-array"),
        pytest.param({"extra_headers": {TAGS: "{not json"}}, TAGS, id="header-not-json"),
        pytest.param({"extra_headers": {TAGS: '["a", "b"]'}}, TAGS, id="header-not-an-object"),
        pytest.param({"extra_headers": {TAGS: json.dumps(TOO_MANY)}}, TAGS, id="header-17"),
        pytest.param({"extra_headers": {TAGS: '{"k": "v' + "v" * 512 + '"}'}}, TAGS, id="h-513"),
        pytest.param({"extra_headers": {TAGS: '{"k": true}'}}, TAGS, id="header-boolean"),
        pytest.param(
            {"metadata": SIXTEEN, "extra_headers": {TAGS: '{"extra": "one"}'}},
            TAGS,
            id="merge-past-16",
        ),
    ],
)
def test_each_bound_is_a_400_naming_the_field_before_anything_is_held(api, sim, token, sent, param):
    before = len(sim_log(sim))
    client = api.openai(token["token"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gpt-sim", messages=user("Hi"), **sent)
    error = refused.value.body
    assert refused.value.status_code == 400
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_request",
        param,
        "invalid_request_error",
    )
    assert param in error["message"]
    assert len(sim_log(sim)) == before  # nothing sent upstream
    assert api.events(token_id=token["id"]) == []  # nothing charged
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["spent"]) == Decimal(budget["reserved"]) == 0


def test_sixteen_pairs_merged_from_both_sources_are_taken(api, sim, token):
    # 10 from metadata, 10 from the header, 4 keys in both: 16 tags.
    metadata = {f"k{i}": "body" for i in range(10)}
    header = {f"k{i}": "header" for i in range(6, 16)}
    _, event = create(api, token, metadata=metadata, extra_headers={TAGS: json.dumps(header)})
    assert event["tags"] == {**metadata, **header}
    assert len(event["tags"]) == 16


# --- what each provider receives ---------------------------------------------------------------


@pytest.fixture(scope="module")
def providers(api, sim):
    with serving(api, dialect_catalog(sim)) as own:
        yield own


@pytest.mark.parametrize("model", list(DIALECT_MODELS))
def test_metadata_never_goes_up_and_user_only_where_the_provider_takes_it(
    api, sim, providers, model
):
    dialect = DIALECT_MODELS[model][1]
    token = providers.principal()[2]
    before = len(sim_log(sim))
    providers.openai(token["token"]).chat.completions.create(
        model=model,
        messages=user("Hi sim:tokens=2"),
        user="cust-1",
        safety_identifier="safe-1",
        metadata={"feature": "search"},
        extra_headers={END_USER: "cust-header", TAGS: '{"env": "prod"}'},
    )
    [record] = sim_log(sim)[before:]
    received = record["received"]
    assert record["status"] == 200
    assert "metadata" not in received
    if dialect in SENDS_IDENTIFIERS:
        assert (received["user"], received["safety_identifier"]) == ("cust-1", "safe-1")
    else:
        assert "user" not in received and "safety_identifier" not in received
    assert END_USER not in record["headers"] and TAGS not in record["headers"]
    [event] = wait_events(providers, token["id"], 1)
    assert event["end_user"] == "cust-header"
    assert event["tags"] == {"env": "prod", "feature": "search"}


def test_a_stream_records_end_user_and_tags_and_sends_no_metadata(api, sim, token):
    client = api.openai(token["token"])
    before = len(sim_log(sim))
    stream = client.chat.completions.create(
        model="gpt-sim",
        messages=user("Stream it sim:tokens=5"),
        stream=True,
        stream_options={"include_usage": True},
        safety_identifier="cust-stream",
        metadata={"feature": "chat"},
        extra_headers={TAGS: '{"feature": "stream", "env": "test"}'},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None
    [record] = sim_log(sim)[before:]
    assert record["stream"] is True
    assert "metadata" not in record["received"]
    assert record["received"]["safety_identifier"] == "cust-stream"
    event = one_event(api, token)
    assert (event["stream"], event["end_user"]) == (True, "cust-stream")
    assert event["tags"] == {"env": "test", "feature": "stream"}
    assert event["completion_tokens"] == 5

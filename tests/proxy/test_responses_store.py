"""Stored responses end to end: `store` (true unless said), `responses.retrieve`,
`input_items.list`, `responses.delete`, `previous_response_id` chains charged whole, privacy
across users and teams, `store: false`, retention, and storing turned off."""

import asyncio
from datetime import timedelta

import openai
import pytest

from metering.clock import using
from metering.db import Database
from metering.responses import store
from tests.proxy.conftest import serving
from tests.proxy.test_dialects import dialect_catalog

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def proxy(api, sim):
    with serving(api, dialect_catalog(sim)) as own:
        yield own


def client(proxy, token: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=token["token"], max_retries=0)


def events(proxy, token) -> list[dict]:
    return proxy.ok("GET", "/v1/usage", params={"token_id": token["id"]})["data"]


def test_a_stored_response_is_retrieved_listed_and_deleted(api, proxy):
    _, _, token = api.principal()
    oa = client(proxy, token)
    made = oa.responses.create(
        model="oa-m25",
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "one sim:tokens=4"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": [{"type": "input_text", "text": "three sim:tokens=4"}]},
        ],
    )
    got = oa.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    items = oa.responses.input_items.list(made.id, order="asc")
    assert [item.role for item in items.data] == ["user", "assistant", "user"]
    assert all(item.id for item in items.data)
    page = oa.responses.input_items.list(made.id, order="asc", limit=2)
    assert len(page.data) == 2 and page.has_more
    rest = oa.responses.input_items.list(made.id, order="asc", after=page.data[-1].id)
    assert [item.role for item in rest.data] == ["user"] and not rest.has_more
    assert oa.responses.delete(made.id) is None
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)


def test_previous_response_id_continues_the_conversation_and_charges_all_of_it(api, proxy, sim):
    _, _, token = api.principal()
    oa = client(proxy, token)
    first = oa.responses.create(
        model="oa-m25", instructions="Only the first's.", input="Start sim:tokens=20"
    )
    second = oa.responses.create(
        model="oa-m25", previous_response_id=first.id, input="And then sim:tokens=5"
    )
    third = oa.responses.create(
        model="oa-m25", previous_response_id=second.id, input="Last sim:tokens=5"
    )
    sent = [r for r in sim.log() if r.get("dialect") == "openai"][-1]["received"]["messages"]
    texts = [m["content"] for m in sent]
    assert texts[0] == "Start sim:tokens=20"  # instructions are not carried
    assert texts[1] == first.output_text and texts[3] == second.output_text
    assert texts[-1] == "Last sim:tokens=5" and len(texts) == 5
    by_id = {e["id"]: e for e in events(proxy, token)}
    prompts = [r.usage.input_tokens for r in (first, second, third)]
    assert prompts[0] < prompts[1] < prompts[2]
    assert third.previous_response_id == second.id
    assert sorted(e["prompt_tokens"] for e in by_id.values()) == sorted(prompts)


def test_a_stored_response_is_its_owners_and_the_admins_only(api, proxy):
    team, user, token = api.principal()
    made = client(proxy, token).responses.create(model="oa-m25", input="secret sim:tokens=3")
    # The same user's other token sees it; the admin sees it.
    other_token = api.token(user["id"])
    assert client(proxy, other_token).responses.retrieve(made.id).id == made.id
    assert proxy.ok("GET", f"/v1/responses/{made.id}")["id"] == made.id
    # Another user of the same team, and another team's user: 404, never 403, never the text.
    teammate = api.token(api.user(team["id"])["id"])
    stranger = api.principal()[2]
    for outsider in (teammate, stranger):
        oa = client(proxy, outsider)
        calls = (
            (oa.responses.retrieve, {}),
            (oa.responses.input_items.list, {}),
            (oa.responses.delete, {}),
        )
        for call, kwargs in calls:
            with pytest.raises(openai.NotFoundError) as refused:
                call(made.id, **kwargs)
            assert "secret" not in refused.value.response.text
        with pytest.raises(openai.NotFoundError):
            oa.responses.create(model="oa-m25", previous_response_id=made.id, input="leak?")
    assert events(proxy, stranger) == [] and events(proxy, teammate) == []
    assert client(proxy, token).responses.retrieve(made.id).output_text == made.output_text


def test_store_false_keeps_nothing(api, proxy):
    _, _, token = api.principal()
    oa = client(proxy, token)
    made = oa.responses.create(model="oa-m25", input="forget me sim:tokens=3", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model="oa-m25", previous_response_id=made.id, input="more")
    assert len(events(proxy, token)) == 1


def test_a_streamed_response_is_stored_before_it_completes(api, proxy):
    _, _, token = api.principal()
    oa = client(proxy, token)
    with oa.responses.stream(model="oa-m25", input="stream sim:tokens=6") as stream:
        for event in stream:
            if event.type == "response.completed":
                # Stored before its last event was written: the next turn may follow at once.
                assert oa.responses.retrieve(event.response.id).status == "completed"
        final = stream.get_final_response()
    assert oa.responses.retrieve(final.id).output_text == final.output_text


def test_responses_past_the_retention_are_gone_and_swept(api, proxy, clock):
    _, _, token = api.principal()
    oa = client(proxy, token)
    made = oa.responses.create(model="oa-m25", input="old sim:tokens=3")
    clock.advance(timedelta(days=31))
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model="oa-m25", previous_response_id=made.id, input="more")
    deleted = proxy_sweep(proxy)
    assert deleted >= 1
    clock.reset()
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)


def proxy_sweep(proxy) -> int:
    """The scheduler's sweep, run here at the server's clock."""

    async def run() -> int:
        db = Database(proxy.settings.database_url, pool_size=1)
        try:
            with using(proxy.clock):
                return await store.sweep(db, proxy.settings.responses_retention_days)
        finally:
            await db.dispose()

    return asyncio.run(run())


def test_storing_turned_off_refuses_store_true_and_bounds_hold(api, sim):
    with serving(api, dialect_catalog(sim), responses_store=False) as off:
        _, _, token = off.principal()
        oa = client(off, token)
        with pytest.raises(openai.BadRequestError) as refused:
            oa.responses.create(model="oa-m25", input="keep me")
        assert refused.value.body["param"] == "store"
        assert oa.responses.create(model="oa-m25", input="ok", store=False).status == "completed"
    with serving(api, dialect_catalog(sim), responses_max_stored_bytes=2048) as small:
        _, _, token = small.principal()
        oa = client(small, token)
        with pytest.raises(openai.BadRequestError) as refused:
            oa.responses.create(model="oa-m25", input="x" * 5000)
        assert refused.value.body["param"] == "input"
        deep: object = "x"
        for _ in range(40):
            deep = [deep]
        with pytest.raises(openai.BadRequestError):
            oa.responses.create(
                model="oa-m25",
                input=[{"type": "function_call_output", "call_id": "c", "output": deep}],
            )
        assert events(small, token) == []

"""POST /v1/responses: a Responses API request made a chat request (metering.proxy.responses
.request), its stored conversation put before it (previous_response_id), and served by the
chat completion's one path (metering.proxy.service.chat_completion), answered in its terms."""

from collections.abc import Mapping
from typing import Any

import orjson

from metering.auth.principal import Principal
from metering.proxy.request import ChatRequest, parse_json, validate
from metering.proxy.responses.answer import Bridge
from metering.proxy.responses.face import Face
from metering.proxy.responses.request import translate
from metering.proxy.runtime import Answer, ProxyServices
from metering.proxy.service import chat_completion
from metering.responses import store


async def as_responses(
    raw: bytes, state: dict[str, Any], principal: Principal, services: ProxyServices
) -> ChatRequest:
    """The chat request a Responses request is served as; every refusal (a field the bridge
    cannot carry, a conversation not visible, a store past its bounds) before anything is held."""
    settings = services.settings
    bridge_history: list[dict[str, Any]] = []
    body = parse_json(raw)
    chat_body, bridged = translate(body)
    size = len(raw)
    if bridged.store:
        store.check_storable(
            bridged.input_items,
            bridged.instructions,
            settings.responses_max_stored_bytes,
            settings.responses_store,
        )
    if bridged.previous_response_id is not None:
        history = await store.load_chain(
            services.db,
            principal,
            bridged.previous_response_id,
            settings.responses_retention_days,
            settings.responses_max_stored_bytes,
        )
        bridged.continue_from(chat_body, history)
        bridge_history = history
        size += len(orjson.dumps(history))  # the prompt's bound counts the whole conversation
    chat = validate(chat_body, size)
    face = Face(bridged, "resp_" + state["request_id"].partition("_")[2])

    async def save(face: Face) -> None:
        assert face.stored is not None
        await store.save(
            services.db,
            response=face.stored,
            input_items=bridged.input_items,
            instructions=bridged.instructions,
            principal=principal,
        )

    chat.bridge = Bridge(face, save if bridged.store else None)
    chat.bridge.history = bridge_history
    return chat


async def create_response(
    headers: Mapping[str, str],
    state: dict[str, Any],
    raw: bytes,
    principal: Principal,
    services: ProxyServices,
    t0: float,
) -> Answer:
    return await chat_completion(headers, state, raw, principal, services, t0, as_responses)

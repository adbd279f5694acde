"""POST /v1/chat/completions and GET /v1/models: the routes and their OpenAPI declarations.
What a chat completion does is metering.proxy.service's; nearly every one reaches it straight
from metering.proxy.dispatch.DirectChat, ahead of the application's stack, and the route here
serves the rest (a compressed body) and declares the path in /openapi.json."""

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from metering.auth.principal import RULE_ERRORS, SelfPrincipal, UserPrincipal
from metering.budgets.ceilings import END_USER, MAX_COST, RUN, RUN_BUDGET, RUN_PATTERN, TAGS
from metering.container import get_services
from metering.errors import ErrorResponse, error_responses
from metering.ledger.attribution import (
    END_USER_PATTERN,
    MAX_END_USER_CHARS,
    MAX_TAG_KEY_CHARS,
    MAX_TAG_VALUE_CHARS,
    MAX_TAGS,
)
from metering.money import POSITIVE_USD_PATTERN
from metering.proxy import admission, request_schema, service
from metering.proxy.request import read_body
from metering.proxy.responses import request as responses_request
from metering.proxy.responses import service as responses_service
from metering.proxy.runtime import ProxyServices

router = APIRouter(prefix="/v1")

# The container, as the proxy's functions take it.
ProxyServicesDep = Annotated[ProxyServices, Depends(get_services)]

# What one header says of another, what runs are open, the tags header's JSON and the
# provider's own dialect (the document cannot declare them).
CHAT_RULES: dict[str | None, str] = {
    RUN_BUDGET: f"sent with {RUN}, on a run's first request (or a run still open)",
    TAGS: "a JSON object of tags, at most 16 pairs with the body's metadata",
    "metadata": f"at most 16 pairs with {TAGS}",
}
CHAT_RESPONSES = {
    200: {
        "description": "The upstream's answer as it sent it: a chat.completion, or (stream) "
        "server-sent chat.completion.chunk events",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **error_responses(400, 402, 404, 413, 415, 502, 504, *RULE_ERRORS["user"], rules=CHAT_RULES),
    # 403 also model_not_allowed; 429 also rate_limit_exceeded (with retry-after).
    "4XX": {
        "model": ErrorResponse,
        "description": "An upstream's own refusal (e.g. 422), passed on with its status",
    },
}


# What the route reads itself (the body is read raw, within its bound), declared for the
# reader: the request's own headers, and the body's fields the proxy reads beside OpenAI's.
CHAT_OPENAPI = {
    "parameters": [
        {
            "name": MAX_COST,
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": POSITIVE_USD_PATTERN},
            "description": "USD: the most this request may cost (a budget of its own)",
        },
        {
            "name": RUN,
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": RUN_PATTERN},
            "description": "the run the request belongs to (letters, digits and . _ : -)",
        },
        {
            "name": RUN_BUDGET,
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": POSITIVE_USD_PATTERN},
            "description": "USD: with a run's first request, the run's budget",
        },
        {
            "name": END_USER,
            "in": "header",
            "required": False,
            "schema": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_END_USER_CHARS,
                "pattern": END_USER_PATTERN,
            },
            "description": "who the request is made for (UTF-8, 1 to 256 characters, no "
            "control, line-break, zero-width or bidi-control character); recorded as the event's `end_user`, before the body's `user` and "
            "`safety_identifier`; never sent upstream",
        },
        {
            "name": TAGS,
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "a JSON object of tags (at most 16 pairs, keys 1 to 64 characters, "
            "values strings of at most 512), merged over the body's `metadata` key by key; "
            "recorded as the event's `tags`; never sent upstream",
        },
    ],
    "requestBody": {
        "required": True,
        "description": "OpenAI's chat completion request; every field not listed here goes "
        "to the provider as sent, where its dialect takes it",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        **request_schema.FIELDS,
                        "user": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_END_USER_CHARS,
                            "pattern": END_USER_PATTERN,
                            "description": "the end user, when x-metering-end-user is not "
                            "sent; sent upstream only to providers whose API takes it",
                        },
                        "safety_identifier": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_END_USER_CHARS,
                            "pattern": END_USER_PATTERN,
                            "description": "the end user, when neither x-metering-end-user "
                            "nor `user` is sent; sent upstream as `user` is",
                        },
                        "metadata": {
                            "type": "object",
                            "maxProperties": MAX_TAGS,
                            "propertyNames": {
                                "minLength": 1,
                                "maxLength": MAX_TAG_KEY_CHARS,
                                "pattern": "^[^\\x00]*$",
                            },
                            "additionalProperties": {
                                "type": "string",
                                "maxLength": MAX_TAG_VALUE_CHARS,
                                "pattern": "^[^\\x00]*$",
                            },
                            "description": "the request's tags (at most 16 pairs, keys 1 to "
                            "64 characters, values strings of at most 512); never sent upstream",
                        },
                    },
                    "additionalProperties": True,
                    **request_schema.EXCLUSIVE,
                }
            }
        },
    },
}


@router.post("/chat/completions", responses=CHAT_RESPONSES, openapi_extra=CHAT_OPENAPI)
async def chat_completions(
    request: Request,
    principal: UserPrincipal,
    services: ProxyServicesDep,
) -> Response:
    t0 = time.perf_counter()
    raw = await read_body(request, services.settings.max_body_bytes)
    answer = await service.chat_completion(
        request.headers, request.scope["state"], raw, principal, services, t0
    )
    assert isinstance(answer, Response)  # metering.proxy.forward answers with Starlette's
    return answer


# The Responses request's rules no schema can say: what each item, tool and format must be
# to be bridged to a chat model (metering.proxy.responses.request), and what a stored response
# may hold.
RESPONSES_RULES: dict[str | None, str] = {
    **CHAT_RULES,
    "input": "each item a message (role user, assistant, system or developer; content text or "
    "input_text/output_text/refusal parts, input_image with an image_url), a function_call "
    "(call_id, name, arguments) or a function_call_output (call_id, output), or a reasoning "
    "item (left out); stored (store true): at most METERING_RESPONSES_MAX_STORED_BYTES",
    "tools": "function tools only, each with a name (hosted tools are not bridged)",
    "tool_choice": 'auto, none, required or {"type": "function", "name": ...}',
    "text": "format text, json_object, or json_schema with a name and a schema object",
    "store": "true only where METERING_RESPONSES_STORE is on",
    "previous_response_id": "a conversation of at most 1,000 responses and "
    "METERING_RESPONSES_MAX_STORED_BYTES",
}
RESPONSES_RESPONSES = {
    200: {
        "description": "A Response object; or (stream) server-sent Responses events, "
        "`response.created` first and `response.completed`, `response.incomplete` or "
        "`response.failed` last",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **error_responses(
        400, 402, 404, 413, 415, 502, 504, *RULE_ERRORS["user"], rules=RESPONSES_RULES
    ),
    "4XX": {
        "model": ErrorResponse,
        "description": "An upstream's own refusal (e.g. 422), passed on with its status",
    },
}
_CHAT_BODY: dict[str, Any] = CHAT_OPENAPI["requestBody"]["content"]["application/json"][  # type: ignore[index]
    "schema"
]["properties"]
_NULLABLE_OBJECT = {"type": ["object", "null"]}
RESPONSES_OPENAPI = {
    "parameters": CHAT_OPENAPI["parameters"],
    "requestBody": {
        "required": True,
        "description": "OpenAI's Responses API request, bridged to the provider's chat dialect "
        "(docs/api/responses.md); a field the bridge cannot carry (hosted tools, `background`, "
        "`conversation`, `prompt`) is a 400 naming it",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model", "input"],
                    "properties": {
                        "model": request_schema.FIELDS["model"],
                        "input": {
                            "anyOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "minItems": 1,
                                    "maxItems": responses_request.MAX_ITEMS,
                                    "items": {"type": "object"},
                                },
                            ]
                        },
                        "instructions": {"type": ["string", "null"]},
                        "max_output_tokens": request_schema.FIELDS["max_tokens"],
                        "temperature": request_schema.FIELDS["temperature"],
                        "top_p": request_schema.FIELDS["top_p"],
                        "stream": {"type": ["boolean", "null"]},
                        "stream_options": _NULLABLE_OBJECT,
                        "store": {"type": ["boolean", "null"]},
                        "previous_response_id": {
                            "type": ["string", "null"],
                            "minLength": 1,
                        },
                        "tools": {
                            "type": ["array", "null"],
                            "maxItems": responses_request.MAX_TOOLS,
                            "items": {"type": "object"},
                        },
                        "tool_choice": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "object"},
                                {"type": "null"},
                            ]
                        },
                        "parallel_tool_calls": {"type": ["boolean", "null"]},
                        "text": {
                            "type": ["object", "null"],
                            "properties": {"format": _NULLABLE_OBJECT, "verbosity": {}},
                            "additionalProperties": False,
                        },
                        "reasoning": {
                            "type": ["object", "null"],
                            "properties": {
                                "effort": {
                                    "enum": [*sorted(responses_request.EFFORTS), None],
                                },
                                "summary": {},
                                "generate_summary": {},
                            },
                            "additionalProperties": False,
                        },
                        "include": {"type": ["array", "null"]},
                        "prompt_cache_key": {"type": ["string", "null"]},
                        "truncation": {"enum": ["disabled", None]},
                        "service_tier": {},
                        "background": {"enum": [False, None]},
                        "user": _CHAT_BODY["user"],
                        "safety_identifier": _CHAT_BODY["safety_identifier"],
                        "metadata": _CHAT_BODY["metadata"],
                    },
                    "additionalProperties": False,
                }
            }
        },
    },
}


@router.post("/responses", responses=RESPONSES_RESPONSES, openapi_extra=RESPONSES_OPENAPI)
async def create_response(
    request: Request,
    principal: UserPrincipal,
    services: ProxyServicesDep,
) -> Response:
    """A Responses API request, served on the chat completion's path (nearly every one
    reaches it straight from metering.proxy.dispatch)."""
    t0 = time.perf_counter()
    raw = await read_body(request, services.settings.max_body_bytes)
    answer = await responses_service.create_response(
        request.headers, request.scope["state"], raw, principal, services, t0
    )
    assert isinstance(answer, Response)
    return answer


@router.get("/models", responses=error_responses(*RULE_ERRORS["self"]))
async def list_models(principal: SelfPrincipal, services: ProxyServicesDep) -> dict[str, Any]:
    """The catalog's models this credential may call (its allow-lists applied)."""
    catalog = services.catalog
    names = admission.visible_models(principal, sorted(catalog.models))
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": catalog.models[name][0].provider,
            }
            for name in names
        ],
    }

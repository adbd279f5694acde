"""POST /v1/chat/completions and GET /v1/models: the routes and their OpenAPI declarations.
What a chat completion does is metering.proxy.service's; nearly every one reaches it straight
from metering.proxy.dispatch.DirectChat, ahead of the application's stack, and the route here
serves the rest (a compressed body) and declares the path in /openapi.json."""

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from metering.auth.principal import RULE_ERRORS, SelfPrincipal, UserPrincipal
from metering.container import get_services
from metering.errors import ErrorResponse, error_responses
from metering.proxy import admission, service
from metering.proxy.request import read_body
from metering.proxy.runtime import ProxyServices

router = APIRouter(prefix="/v1")

# The container, as the proxy's functions take it.
ProxyServicesDep = Annotated[ProxyServices, Depends(get_services)]

CHAT_RESPONSES = {
    200: {
        "description": "The upstream's answer as it sent it: a chat.completion, or (stream) "
        "server-sent chat.completion.chunk events",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **error_responses(400, 402, 404, 413, 415, 502, 504, *RULE_ERRORS["user"]),
    # 403 also model_not_allowed; 429 also rate_limit_exceeded (with retry-after).
    "4XX": {
        "model": ErrorResponse,
        "description": "An upstream's own refusal (e.g. 422), passed on with its status",
    },
}


@router.post("/chat/completions", responses=CHAT_RESPONSES)
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

"""GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: the stored responses
of the Responses API, to their owner's credentials and the admin (anyone else: 404)."""

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query

from metering.auth.principal import RULE_ERRORS, SelfPrincipal
from metering.container import ServicesDep
from metering.errors import InvalidRequest, error_responses
from metering.responses import store

router = APIRouter(prefix="/v1")

# Any text: an id no response has (too long included) is a 404, as an unknown one is.
ResponseId = Annotated[str, Path(min_length=1, description="the response's id (`resp_...`)")]
ERRORS = error_responses(404, *RULE_ERRORS["self"])


@router.get("/responses/{response_id}", responses=ERRORS)
async def get_response(
    response_id: ResponseId, principal: SelfPrincipal, services: ServicesDep
) -> dict[str, Any]:
    """A stored Response object, as its client got it."""
    row = await store.visible(
        services.db, principal, response_id, services.settings.responses_retention_days
    )
    return json.loads(row.response)


@router.get(
    "/responses/{response_id}/input_items",
    responses=error_responses(
        400, 404, *RULE_ERRORS["self"], rules={"after": "an input item of this response"}
    ),
)
async def list_input_items(
    response_id: ResponseId,
    principal: SelfPrincipal,
    services: ServicesDep,
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, min_length=1, max_length=64),
    order: Literal["asc", "desc"] = Query("desc"),
) -> dict[str, Any]:
    """The stored response's input items (an item's id, then `after` it), OpenAI's list."""
    row = await store.visible(
        services.db, principal, response_id, services.settings.responses_retention_days
    )
    items: list[dict[str, Any]] = json.loads(row.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(
                f"after: no input item {after[:64]!r} in this response", param="after"
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.delete("/responses/{response_id}", responses=ERRORS)
async def delete_response(
    response_id: ResponseId, principal: SelfPrincipal, services: ServicesDep
) -> dict[str, Any]:
    """Forget a stored response (its input items with it)."""
    await store.delete_response(
        services.db, principal, response_id, services.settings.responses_retention_days
    )
    return {"id": response_id, "object": "response", "deleted": True}

"""The live catalog: loaded from the TOML file, reloaded when the file changes, and every price
it has ever had kept in the `prices` table (a change adds a row, never rewrites one).

A request takes its prices from the catalog object current when it starts, so a reload
mid-request does not change what that request is charged.
"""

import hashlib
import logging
from pathlib import Path

from sqlalchemy import select

from metering.db import Database, utcnow
from metering.models import Price
from metering.settings import Catalog, CatalogError, ModelRoute, load_catalog

log = logging.getLogger("metering.catalog")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_price(row: Price, route: ModelRoute) -> bool:
    return (row.input_price, row.cached_price, row.output_price, row.upstream_model) == (
        route.input_micro,
        route.cached_micro,
        route.output_micro,
        route.upstream_model,
    )


async def record_prices(db: Database, catalog: Catalog) -> int:
    """Add a price row for every route whose price is not the one recorded: a route with
    `effective_from` adds a row from then unless that very row is there (a back-dated
    correction, see metering.ledger.prices); any other adds a row from now when its price
    differs from the one in force now."""
    now, added = utcnow(), 0
    async with db.transaction() as session:
        for routes in catalog.models.values():
            for route in routes:
                rows = select(Price).where(
                    Price.model == route.name, Price.provider == route.provider
                )
                if route.effective_from is not None:
                    same = await session.scalars(
                        rows.where(Price.effective_from == route.effective_from)
                    )
                    if any(_same_price(row, route) for row in same):
                        continue
                else:
                    latest = await session.scalar(
                        rows.where(Price.effective_from <= now).order_by(Price.id.desc()).limit(1)
                    )
                    if latest is not None and _same_price(latest, route):
                        continue
                session.add(
                    Price(
                        model=route.name,
                        provider=route.provider,
                        upstream_model=route.upstream_model,
                        input_price=route.input_micro,
                        cached_price=route.cached_micro,
                        output_price=route.output_micro,
                        effective_from=route.effective_from or now,
                    )
                )
                added += 1
    return added


def describe(catalog: Catalog, path: Path | None) -> None:
    """Says in the log which catalog the server starts with, and warns when it has no model
    (every chat request would answer 404 model_not_found)."""
    if path is None:
        log.warning(
            "no catalog: METERING_CONFIG is unset and ./metering.toml does not exist, so no "
            "model can be called (docs/operator/catalog.md)"
        )
        return
    routes = sum(len(r) for r in catalog.models.values())
    if not catalog.models:
        log.warning(
            "catalog %s has no models (%d providers): no model can be called",
            path,
            len(catalog.providers),
        )
        return
    log.info(
        "catalog %s loaded: %d models (%d routes) from %d providers",
        path,
        len(catalog.models),
        routes,
        len(catalog.providers),
    )


class CatalogStore:
    """Holds the current catalog; `reload_if_changed` swaps in a new one when the file changes."""

    def __init__(self, catalog: Catalog, path: Path | None = None) -> None:
        self.current = catalog
        self.path = path
        self._digest = _digest(path) if path is not None and path.exists() else None

    async def reload_if_changed(self, db: Database) -> bool:
        if self.path is None or not self.path.exists():
            return False
        digest = _digest(self.path)
        if digest == self._digest:
            return False
        try:
            catalog = load_catalog(self.path)
        except (CatalogError, ValueError, OSError) as exc:
            # Keep serving with the last good catalog; the operator sees why in the log.
            log.error("catalog %s not reloaded: %s", self.path, exc)
            self._digest = digest
            return False
        await record_prices(db, catalog)
        self.current, self._digest = catalog, digest
        log.info("catalog reloaded from %s", self.path)
        return True

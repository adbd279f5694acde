"""The price history (table `prices`): the price of a model at a provider at any moment.

Rows are only ever added. A row holds from its `effective_from`; of the rows already in effect
at a moment, the one recorded last (highest id) holds. So a correction recorded today with an
`effective_from` in the past replaces, from then on, every price recorded before it, and a
later change recorded after it takes over from its own moment.
"""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.models import Price


@dataclass(frozen=True, slots=True)
class PriceRow:
    id: int
    effective_from: datetime
    upstream_model: str
    prices: tuple[int, int, int]  # input, cached, output: micro-USD per 1M tokens


class PriceBook:
    """The history of some (model, provider) pairs, read once."""

    def __init__(self, rows: dict[tuple[str, str], list[PriceRow]]) -> None:
        self.rows = rows

    @classmethod
    async def load(
        cls, conn: AsyncConnection | AsyncSession, models: set[str] | None
    ) -> "PriceBook":
        """The history of `models` (None: of every model; a row per price change, few)."""
        found: dict[tuple[str, str], list[PriceRow]] = {}
        query = select(Price.__table__).order_by(Price.id)
        if models is not None:
            if not models:
                return cls(found)
            query = query.where(Price.model.in_(sorted(models)))
        for row in await conn.execute(query):
            found.setdefault((row.model, row.provider), []).append(
                PriceRow(
                    row.id,
                    row.effective_from,
                    row.upstream_model,
                    (row.input_price, row.cached_price, row.output_price),
                )
            )
        return cls(found)

    def at(self, model: str, provider: str, moment: datetime) -> PriceRow | None:
        """The row in force at `moment` (None: no price recorded from then or before)."""
        rows = self.rows.get((model, provider), [])
        in_force = [row for row in rows if row.effective_from <= moment]
        return max(in_force, key=lambda row: row.id, default=None)

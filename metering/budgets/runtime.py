"""What the budgets keep for the life of a process: one object, made by create_app's lifespan
and held on Services (`services.budgets`), passed to the functions that need it. No budget
state lives in a module global.

- `settles`: the settle queue (settles, and on PostgreSQL the leased holds, written in groups);
- `admissions`: the rate admission queue (requests with the same limits counted together);
- `exhausted`: the budget.exhausted events already recorded (one write per window, not one per
  refusal);
- `leases`: the credit leases this process admits requests against in memory (none taken
  with `lease_share` 0).
"""

from collections.abc import Callable

from metering.budgets.leases import LeaseBook
from metering.budgets.rates import AdmissionQueue
from metering.budgets.reserve import Exhausted
from metering.budgets.settle_queue import SettleQueue
from metering.db import Database


def _always() -> bool:
    return True


class BudgetRuntime:
    __slots__ = ("db", "settles", "admissions", "exhausted", "leases")

    def __init__(
        self,
        db: Database,
        *,
        lease_share: int = 0,
        hold_ttl_s: int = 900,
        trusted: Callable[[], bool] = _always,
    ) -> None:
        """`lease_share`, `hold_ttl_s`: the lease book's (METERING_LEASE_SHARE and the hold
        TTL); `trusted`: whether this process's credential listener is confirmed (leases are
        admitted against only then)."""
        self.db = db
        self.settles = SettleQueue(db)
        self.admissions = AdmissionQueue(db)
        self.exhausted = Exhausted()
        self.leases = LeaseBook(
            db, self.settles, share=lease_share, ttl_s=hold_ttl_s, trusted=trusted
        )

    def start(self) -> None:
        self.leases.start()

    async def close(self) -> None:
        """At shutdown: the leases nothing is in flight on are given back."""
        await self.leases.close()

"""Credit leases (escrow): a process reserves a slice of a budget's credit with one conditional
write, then admits requests against it in memory, with no lock on the budget's row.

A lease is a row of budget_leases, its amount counted in the budget's `reserved` like a hold.
The process keeps, per lease, what it may still admit against (`amount`) and what its requests
in flight took from it (`inflight`); a request is admitted only if every limited budget it
charges (its token's, its user's, its team's) has a lease with `amount - inflight` covering
its whole hold. Its hold row is still written before anything is forwarded (grouped with the
holds of the requests that arrive together: one INSERT), naming its leases instead of adding
to `reserved`; a hold that names a lease keeps the lease's row from being deleted (a foreign
key). Settling such a hold moves its cost from the lease (and `reserved`) to `spent`. A request
of an end user with a budget (metering.budgets.end_users) is reserved in that budget's row, never
leased, in the transaction that writes its hold (which names its end user's budget too); the
row refusing it sends the request to the database path, its claim given back.

Why a budget never ends a window above its limit: a budget's `spent + reserved` only grows
through conditional writes that check the limit (a hold reserved in the rows, a lease taken or
grown), and a leased request is admitted only against credit its lease already counts in
`reserved`: the process's own view of a lease never exceeds its row (a settle takes its cost
from both; an outcome it cannot be sure of takes the whole hold from the view, as the sweeper
takes it from the row). A limit lowered, a token revoked, a user or team deleted is a
credential change (metering.auth.invalidation): every process drops its leases of those
budgets before it acknowledges the change, and a process whose listener is not confirmed
admits nothing against leases at all. A lease is used only inside the window it was taken in.

Why nothing is lost when a process dies holding a lease: every request it admitted has a hold
row naming the lease, so the sweeper charges it as `unsettled` (from the lease: `reserved` to
`spent`) once it expires; a lease whose process stopped extending it is returned (its amount
taken from `reserved`) once it has expired and no hold names it. A live process extends its
leases' expiry every TTL/3 and admits against a lease only while two thirds of its TTL since
the last extension have not passed.

Slices shrink as a budget nears its limit: a process takes 1/`share` of what is left (neither
spent nor reserved, leases of other processes included), and only when that covers at least
MIN_REQUESTS of the request's hold; otherwise the request takes the database path, so the
last credit is shared by the database's conditional writes. A lease nothing has used for
IDLE_S with nothing in flight is returned.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, bindparam, delete, exists, insert, or_, select, update
from sqlalchemy import exc as sa_exc

from metering.budgets import end_users, settle_pg
from metering.budgets.end_users import EndUserTeams
from metering.budgets.groups import GroupWriter, answer
from metering.budgets.reserve import Claim, HoldSpec, Reservation, hold_json, hold_row
from metering.budgets.settle_queue import SettleQueue
from metering.budgets.views import current_window, load, roll, view
from metering.db import Database, utcnow, write_in_doubt
from metering.models import Budget, BudgetLease, Hold

log = logging.getLogger("metering.budgets")

MIN_REQUESTS = 2  # a slice must cover this many of the request's holds
IDLE_S = 1.0  # an unused lease with nothing in flight is returned after this
TICK_S = 0.25  # how often idle leases are looked for
SCOPES = ("token", "user", "team")


class Lease:
    """This process's side of one lease (id None: a budget without a limit, nothing leased;
    kept so the request's windows are known and a change to the budget is noticed)."""

    __slots__ = (
        "id",
        "subject_id",
        "scope",
        "amount",
        "inflight",
        "usable_until",
        "resets_at",
        "window",
        "last_used",
        "dropped",
    )

    def __init__(
        self,
        lease_id: str | None,
        subject_id: str,
        scope: str,
        amount: int,
        window: tuple[Any, ...],
        resets_at: datetime | None,
        usable_until: float,
    ) -> None:
        self.id: str | None = lease_id
        self.subject_id: str = subject_id
        self.scope: str = scope
        self.amount: int = amount  # what may be admitted in all, at most the row's amount
        self.inflight = 0  # taken by requests not yet ended
        self.window: tuple[Any, ...] = window  # (reset_interval, anchor, window start)
        self.resets_at: datetime | None = resets_at
        self.usable_until: float = usable_until  # monotonic
        self.last_used = time.monotonic()
        self.dropped = False

    def usable(self, mono: float, now: datetime) -> bool:
        return (
            not self.dropped
            and mono < self.usable_until
            and (self.resets_at is None or now < self.resets_at)
        )


_LEASE_AMOUNT = (
    select(BudgetLease.amount).where(BudgetLease.id == bindparam("lease_id")).with_for_update()
)
_DELTA = bindparam("delta", type_=BigInteger)
_GROW = (
    update(Budget.__table__)
    .where(
        Budget.subject_id == bindparam("subject"),
        or_(_DELTA <= 0, Budget.spent + Budget.reserved + _DELTA <= Budget.credit_limit),
    )
    .values(reserved=Budget.reserved + _DELTA)
    .execution_options(synchronize_session=False)
)
_SET_LEASE = (
    update(BudgetLease.__table__)
    .where(BudgetLease.id == bindparam("lease_id"))
    .values(amount=bindparam("amount"), expires_at=bindparam("expires_at"))
)
_NEW_LEASE = insert(BudgetLease.__table__)
_LOCK_BUDGET = (
    select(Budget.subject_id).where(Budget.subject_id == bindparam("subject")).with_for_update()
)
_NAMED = exists().where(
    or_(
        Hold.token_lease == BudgetLease.id,
        Hold.user_lease == BudgetLease.id,
        Hold.team_lease == BudgetLease.id,
    )
)
_RETURN = (
    delete(BudgetLease.__table__)
    .where(BudgetLease.id == bindparam("lease_id"), ~_NAMED)
    .returning(BudgetLease.amount)
)
_SHRINK = (
    update(BudgetLease.__table__)
    .where(BudgetLease.id == bindparam("lease_id"))
    .values(amount=BudgetLease.amount - bindparam("amount"))
)
_UNRESERVE = (
    update(Budget.__table__)
    .where(Budget.subject_id == bindparam("subject"))
    .values(reserved=Budget.reserved - bindparam("amount"))
    .execution_options(synchronize_session=False)
)


async def give_back(db: Database, lease_id: str, subject_id: str) -> bool:
    """Delete a lease no hold names and take its amount from `reserved`; False when a hold
    still names it (or it is gone)."""
    try:
        async with db.begin() as conn:
            await conn.execute(_LOCK_BUDGET, {"subject": subject_id})
            amount = (await conn.execute(_RETURN, {"lease_id": lease_id})).scalar()
            if amount is None:
                return False
            await conn.execute(_UNRESERVE, {"subject": subject_id, "amount": amount})
    except sa_exc.IntegrityError:
        return False  # a hold naming it committed meanwhile: it stays until that one ends
    return True


async def expire_leases(db: Database, batch: int = 500) -> int:
    """Return every expired lease no hold names (its process stopped extending it); run after
    expired holds were charged. Returns how many."""
    async with db.sessions() as session:
        rows = (
            await session.execute(
                select(BudgetLease.id, BudgetLease.subject_id)
                .where(BudgetLease.expires_at <= utcnow())
                .order_by(BudgetLease.expires_at)
                .limit(batch)
            )
        ).all()
    returned = 0
    for lease_id, subject_id in rows:
        returned += await give_back(db, lease_id, subject_id)
    return returned


_INSERT_HOLDS = insert(Hold.__table__)


class HoldWriter:
    """Holds of leased requests, inserted in groups (metering.budgets.groups): one multi-row
    INSERT for the holds that arrive together. On PostgreSQL they join the process's settle
    queue (metering.budgets.settle_queue.SettleQueue), whose one statement per group carries the
    settles and the holds waiting together (one round trip for both); a group that fails is
    written here, as a multi-row INSERT and then, if that fails, one hold at a time."""

    def __init__(self, db: Database, settles: SettleQueue) -> None:
        self.db = db
        self.settles = settles
        self.groups = GroupWriter(self.write, lambda: RuntimeError("hold not written"))

    async def insert(self, row: dict[str, Any]) -> None:
        if self.db.dialect == "postgresql":
            await self.settles.hold(row, self.write)
        else:
            await self.groups.submit(row)

    async def _one(self, rows: list[dict[str, Any]]) -> None:
        # One statement (one multi-row INSERT): atomic on its own, so no BEGIN/COMMIT.
        async with self.db.single() as conn:
            await conn.execute(_INSERT_HOLDS, rows)

    async def _many(self, rows: list[dict[str, Any]]) -> None:
        if self.db.dialect != "postgresql":
            await self._one(rows)
            return
        statement = settle_pg.insert_holds(tuple(rows[0]))
        async with self.db.raw() as conn:
            await conn.execute(statement.sql, *statement.args({"new_holds": hold_json(rows)}))

    async def write(self, batch: list[tuple[dict[str, Any], asyncio.Future[Any]]]) -> None:
        """Write a group of holds on their own and answer each one's future."""
        try:
            await self._many([row for row, _ in batch])
        except Exception:
            pass  # one at a time below: the good ones commit
        else:
            for _, future in batch:
                answer(future)
            return
        ends = await asyncio.gather(*(self._one([row]) for row, _ in batch), return_exceptions=True)
        for (_, future), end in zip(batch, ends, strict=True):
            answer(future, error=end if isinstance(end, BaseException) else None)


class LeaseBook:
    """This process's leases, by budget (subject_id); its leased holds join `settles`, the
    process's settle queue, on PostgreSQL."""

    def __init__(
        self,
        db: Database,
        settles: SettleQueue,
        *,
        share: int,
        ttl_s: int,
        trusted: Callable[[], bool],
    ) -> None:
        self.db = db
        self.share = share
        self.ttl_s = ttl_s
        self.trusted = trusted
        self.owner = f"rep_{uuid.uuid4().hex[:16]}"
        self.leases: dict[str, Lease] = {}
        self.retiring: list[Lease] = []  # dropped while requests were in flight
        # Budgets found too near their limit to lease, until when (monotonic).
        self.too_small: dict[str, float] = {}
        self.holds = HoldWriter(db, settles)
        # Teams whose end users may have budgets: their requests reserve the end user's row.
        self.end_user_teams = EndUserTeams(db)
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task[None] | None = None
        self.admitted = 0  # requests admitted against leases
        self.taken = 0  # leases taken or grown

    @property
    def enabled(self) -> bool:
        return self.share > 0

    # --- changes seen by the credential listener -----------------------------------------

    def drop(self, subjects: frozenset[str] | None) -> None:
        """Stop admitting against the leases of these budgets ("kind:id" subjects; None: all).
        Called before the process acknowledges a change, so the changing call returns only
        once no process admits against what it changed."""
        self.end_user_teams.drop(subjects)
        ids = list(self.leases) if subjects is None else [s.partition(":")[2] for s in subjects]
        if subjects is None:
            self.too_small.clear()
        for subject_id in ids:
            self.too_small.pop(subject_id, None)  # a raised limit may make it leasable again
            lease = self.leases.pop(subject_id, None)
            if lease is not None:
                lease.dropped = True
                if lease.id is not None:
                    self.retiring.append(lease)

    # --- admission ---------------------------------------------------------------------------

    def _claim(self, subjects: list[str], amount: int) -> Claim | None:
        mono, now = time.monotonic(), utcnow()
        taken = []
        for subject in subjects:
            lease = self.leases.get(subject)
            if lease is None or not lease.usable(mono, now):
                return None
            if lease.id is not None and lease.amount - lease.inflight < amount:
                return None
            taken.append(lease)
        for lease in taken:
            if lease.id is not None:
                lease.inflight += amount
            lease.last_used = mono
        return Claim(tuple(taken), amount)

    async def admit(self, spec: HoldSpec) -> Reservation | None:
        """The request's reservation against this process's leases (taking or growing them if
        needed), or None: the database path decides."""
        if not self.enabled or not self.trusted():
            return None
        wanted = spec.max_tokens if spec.max_tokens is not None else spec.model_max_output
        amount = spec.amount(wanted)
        if spec.max_cost is not None and amount > spec.max_cost:
            return None  # to be clamped to (or refused by) its own ceiling: the database path
        billing = spec.billing
        # Its end user's budget, if it has one, is reserved in its row with the hold.
        end_user = billing.end_user is not None and await self.end_user_teams.limited(
            billing.team_id
        )
        subjects = spec.subjects
        claim = self._claim(subjects, amount)
        if claim is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            mono = time.monotonic()
            if any(self.too_small.get(s, 0.0) > mono for s in subjects):
                # Found too small a moment ago: the database path decides, and must see the
                # credit of any slice this process took since (a request that was waiting
                # for the lock) and could not use for this request.
                if any(s in self.leases for s in subjects):
                    async with self._lock:
                        await self._give_up(subjects)
                return None
            async with self._lock:
                claim = self._claim(subjects, amount)  # grown meanwhile by another request
                if claim is None:
                    if any(self.too_small.get(s, 0.0) > mono for s in subjects):
                        # Found too small by the request that held the lock before this one.
                        await self._give_up(subjects)
                        return None
                    if not await self._take(spec, amount):
                        # Too little left to lease: the database path decides, and sees the
                        # credit this process's leases of these budgets were not using.
                        await self._give_up(subjects)
                        return None
                    claim = self._claim(subjects, amount)
                    if claim is None:
                        return None
        leases = {lease.scope: lease.id for lease in claim.leases if lease.id is not None}
        windows = {lease.subject_id: lease.window for lease in claim.leases}
        held_in: str | None = None
        try:
            if end_user:
                held_in = await self._with_end_user(spec, amount, leases, windows)
                if held_in == "":
                    # Its end user cannot cover it: the database path clamps or refuses.
                    claim.end(released=True)
                    return None
            else:
                await self.holds.insert(hold_row(spec, amount, utcnow(), self.ttl_s, leases))
        except sa_exc.IntegrityError:
            # A lease was returned under us (this process stalled past its expiry).
            claim.end(released=True)
            self.drop(frozenset(f"budget:{lease.subject_id}" for lease in claim.leases))
            return None
        except BaseException as exc:
            # Refused by the server, the hold was not written: the claim is given back. Cut
            # short (the connection lost mid-commit), it may have been: taken whole from this
            # process's view, as the sweeper would take it from the row (the proxy has the hold
            # released once the database answers, metering.proxy.live).
            claim.end(released=not write_in_doubt(exc))
            raise
        self.admitted += 1
        # A hold in an end user's row too: the general settle (not the one-statement one).
        plain = spec.rates is None and spec.run is None and held_in is None
        return Reservation(spec.hold_id, amount, wanted, False, windows, claim, plain)

    async def _with_end_user(
        self,
        spec: HoldSpec,
        amount: int,
        leases: dict[str, Any],
        windows: dict[str, Any],
    ) -> str | None:
        """Reserve a leased request's hold in its end user's budget row and write the hold, in
        one transaction: the end user's budget (None: it has none), or "" when its row cannot
        cover the amount (nothing written). The end user's budget is made on first use."""
        billing = spec.billing
        assert billing.end_user is not None
        now = utcnow()
        async with self.db.begin() as conn:
            held_in = await end_users.held_in(conn, billing.team_id, billing.end_user, now)
            if held_in is not None:
                window = await end_users.reserve_in_row(conn, held_in, amount, now)
                if window is None:
                    await conn.rollback()
                    return ""
                windows[held_in] = window
            row = hold_row(spec, amount, now, self.ttl_s, leases, end_user_budget=held_in)
            await conn.execute(_INSERT_HOLDS, row)
        return held_in

    async def _take(self, spec: HoldSpec, amount: int) -> bool:
        """Take or grow a lease on each of the request's limited budgets, in one transaction;
        False when some budget has too little left to lease (the database path decides)."""
        now = utcnow()
        mono = time.monotonic()
        expires_at = now + timedelta(seconds=self.ttl_s)
        scopes = dict(
            zip(
                (spec.billing.token_id, spec.billing.user_id, spec.billing.team_id),
                SCOPES,
                strict=True,
            )
        )
        planned: list[tuple[Any, ...]] = []
        async with self.db.begin() as conn:
            budgets = await load(conn, spec.subjects, lock=True)
            for subject_id in spec.subjects:
                budget = budgets.get(subject_id)
                if budget is None:
                    return False
                standing = view(budget, now)
                await roll(conn, budget, now)
                start, resets_at = current_window(budget, now)
                window = (budget.reset_interval, budget.anchor_at, start)
                current = self.leases.get(subject_id)
                if budget.credit_limit is None:
                    planned.append((subject_id, current, None, 0, None, window, resets_at))
                    continue
                grant = (standing.remaining or 0) // self.share
                if grant < MIN_REQUESTS * amount:
                    await conn.rollback()
                    # Near its limit: its requests take the database path for a while,
                    # without trying to lease first.
                    self.too_small[subject_id] = mono + IDLE_S
                    return False
                if current is not None and current.id is not None and not current.dropped:
                    held = (await conn.execute(_LEASE_AMOUNT, {"lease_id": current.id})).scalar()
                else:
                    current, held = None, None
                # `held` is read only for a current lease.
                kept = current if held is not None else None
                lease_id = kept.id if kept is not None else f"lse_{uuid.uuid4().hex}"
                target = (kept.inflight if kept is not None else 0) + grant
                delta = target - (held or 0)
                grown = await conn.execute(_GROW, {"subject": subject_id, "delta": delta})
                if grown.rowcount != 1:
                    await conn.rollback()
                    return False
                if held is None:
                    row = {
                        "id": lease_id,
                        "subject_id": subject_id,
                        "owner": self.owner,
                        "amount": target,
                        "created_at": now,
                        "expires_at": expires_at,
                    }
                    await conn.execute(_NEW_LEASE, row)
                else:
                    values = {"lease_id": lease_id, "amount": target, "expires_at": expires_at}
                    await conn.execute(_SET_LEASE, values)
                planned.append((subject_id, current, lease_id, delta, held, window, resets_at))
        usable_until = mono + self.ttl_s * 2 / 3
        for subject_id, before, lease_id, delta, held, window, resets_at in planned:
            current = self.leases.get(subject_id)
            if held is not None and lease_id is not None and before is not None:
                # Grown (or shrunk) by delta, in the row and here alike: the view stays within
                # the row. Dropped meanwhile (a change to the budget): it is returned whole
                # once its requests end, so it is not installed again.
                before.amount += delta
                if current is not None and current is before:
                    before.window, before.resets_at = window, resets_at
                    before.usable_until = usable_until
                continue
            if current is not None:
                self.drop(frozenset({f"budget:{subject_id}"}))
            scope = scopes.get(subject_id, "token")
            amount = delta if lease_id is not None else 0
            lease = Lease(lease_id, subject_id, scope, amount, window, resets_at, usable_until)
            self.leases[subject_id] = lease
        self.taken += 1
        return True

    async def _give_up(self, subjects: list[str]) -> None:
        """Stop leasing these budgets: return each lease, or while requests are in flight on
        it, the part they do not hold."""
        mine = [self.leases[s] for s in subjects if s in self.leases]
        self.drop(frozenset(f"budget:{lease.subject_id}" for lease in mine))
        for lease in mine:
            if lease.id is None:
                continue
            if lease.inflight == 0:
                # The upkeep may have given it back while an earlier one was being returned.
                if lease in self.retiring:
                    self.retiring.remove(lease)
                    await give_back(self.db, lease.id, lease.subject_id)
                continue
            free = lease.amount - lease.inflight
            if free <= 0:
                continue
            async with self.db.begin() as conn:
                await conn.execute(_LOCK_BUDGET, {"subject": lease.subject_id})
                await conn.execute(_SHRINK, {"lease_id": lease.id, "amount": free})
                await conn.execute(_UNRESERVE, {"subject": lease.subject_id, "amount": free})
            lease.amount -= free

    # --- upkeep --------------------------------------------------------------------------

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.create_task(self._upkeep())

    async def _upkeep(self) -> None:
        extend_every = self.ttl_s / 3
        extended = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.return_idle()
                if time.monotonic() - extended >= extend_every:
                    await self.extend()
                    extended = time.monotonic()
            except Exception:
                log.warning("lease upkeep failed; retrying", exc_info=True)

    async def return_idle(self, idle_s: float = IDLE_S) -> int:
        """Return the leases nothing is in flight on that were dropped or have been idle."""
        mono = time.monotonic()
        self.too_small = {s: until for s, until in self.too_small.items() if until > mono}
        for subject_id, lease in list(self.leases.items()):
            stale = not lease.usable(mono, utcnow())
            if lease.inflight == 0 and (stale or mono - lease.last_used >= idle_s):
                del self.leases[subject_id]
                lease.dropped = True
                if lease.id is not None:
                    self.retiring.append(lease)
        done: list[Lease] = []
        keep: list[Lease] = []
        for lease in self.retiring:
            (done if lease.inflight <= 0 else keep).append(lease)
        self.retiring = keep
        returned = 0
        for lease in done:
            # A hold still naming it (a settle that failed): the sweeper ends both.
            assert lease.id is not None  # only a lease with a row retires
            returned += await give_back(self.db, lease.id, lease.subject_id)
        return returned

    async def extend(self) -> None:
        """Push the expiry of every lease this process holds out by the TTL."""
        leases = [lease for lease in self.leases.values() if lease.id is not None]
        leases += self.retiring
        if not leases:
            return
        mono = time.monotonic()
        async with self.db.begin() as conn:
            extended = await conn.execute(
                update(BudgetLease.__table__)
                .where(BudgetLease.id.in_([lease.id for lease in leases]))
                .values(expires_at=utcnow() + timedelta(seconds=self.ttl_s))
                .returning(BudgetLease.id)
            )
            alive = set(extended.scalars())
        for lease in leases:
            if lease.id in alive:
                lease.usable_until = mono + self.ttl_s * 2 / 3
            else:  # returned by a sweeper while this process stalled: never admitted against
                lease.dropped = True
                if self.leases.get(lease.subject_id) is lease:
                    del self.leases[lease.subject_id]

    async def close(self) -> None:
        """At shutdown: stop admitting, return what nothing is in flight on."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.drop(None)
        with contextlib.suppress(Exception):
            await self.return_idle()

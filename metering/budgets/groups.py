"""Work written in groups (group commit): the first item starts a write at once, with no added
wait when it is alone; the items that arrive while that write runs form the next one. Each
caller awaits its own item's answer, which the write gives to the item's future.

Used for settles (metering.budgets.settle_queue), leased holds (metering.budgets.leases) and rate
admissions (metering.budgets.rates): one transaction (or one statement) for the requests that
arrive together, instead of one each.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Waiter = tuple[Any, asyncio.Future[Any]]


def answer(
    future: asyncio.Future[Any], result: object = None, error: BaseException | None = None
) -> None:
    """Give a waiter its answer; nothing when it is gone (cancelled): the work still happened,
    or not, as it was recorded."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def write_and_answer(
    batch: list[tuple[Item, asyncio.Future[Any]]], write: Callable[[list[Item]], Awaitable[None]]
) -> None:
    """A group written whole by `write(items)`: every waiter is answered, done or with the
    write's error."""
    try:
        await write([item for item, _ in batch])
    except Exception as exc:
        for _, future in batch:
            answer(future, error=exc)
        return
    for _, future in batch:
        answer(future)


class GroupWriter(Generic[Item]):
    """`write(batch)` writes one group, a list of (item, future), and answers every future. When
    the writer itself is stopped (the loop closing), every waiter left is answered with
    `interrupted()`."""

    def __init__(
        self,
        write: Callable[[list[tuple[Item, asyncio.Future[Any]]]], Awaitable[None]],
        interrupted: Callable[[], Exception],
    ) -> None:
        self._write = write
        self._interrupted = interrupted
        self.pending: list[tuple[Item, asyncio.Future[Any]]] = []
        self.writing: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((item, future))
        if self.writing is None:
            self.writing = loop.create_task(self._write_all())
        return await future

    async def _write_all(self) -> None:
        batch: list[tuple[Item, asyncio.Future[Any]]] = []
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                await self._write(batch)
                batch = []
        except BaseException as exc:  # cancelled with the loop: no waiter is left hanging
            for _, future in batch + self.pending:
                answer(future, error=self._interrupted())
            self.pending = []
            if not isinstance(exc, Exception):
                raise
        finally:
            self.writing = None

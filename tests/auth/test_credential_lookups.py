"""Misses of one credential that arrive together share one database lookup
(CredentialCache.load), but only where the cache would serve the entry that lookup is about to
store: trusted, and no change applied since it began. A failed lookup is shared with nobody."""

import asyncio
from types import SimpleNamespace

import pytest

from metering.auth import service
from metering.auth.cache import CredentialCache
from metering.auth.principal import Principal
from metering.auth.sessions import SessionUser

SUBJECTS = frozenset({"token:tok_1"})


class Lookups:
    """A lookup per call, each ending when the test opens its gate, with the value given."""

    def __init__(self) -> None:
        self.calls = 0
        self.gates: list[asyncio.Event] = []
        self.values: list[object] = []

    def __call__(self, value: object = "principal"):
        async def lookup():
            self.calls += 1
            gate = asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
            if isinstance(value, Exception):
                raise value
            return value, SUBJECTS, None

        return lookup

    async def open_all(self) -> None:
        while any(not gate.is_set() for gate in self.gates):
            for gate in self.gates:
                gate.set()
            await asyncio.sleep(0)


async def _started(lookups: Lookups, n: int) -> None:
    for _ in range(100):
        if lookups.calls >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{lookups.calls} lookups started, {n} expected")


@pytest.mark.anyio
async def test_sixteen_misses_together_make_one_lookup_and_store_it():
    cache = CredentialCache(10, 60, always_trusted=True)
    lookups = Lookups()
    misses = [asyncio.create_task(cache.load("t:1", lookups())) for _ in range(16)]
    await _started(lookups, 1)
    await lookups.open_all()
    assert [await m for m in misses] == [("principal", None)] * 16
    assert (lookups.calls, cache.lookups, cache.joined) == (1, 1, 15)
    assert cache.get("t:1").value == "principal"


@pytest.mark.anyio
async def test_a_miss_after_a_change_looks_again_and_sees_the_change():
    """A revocation applied while a lookup reads: the miss that arrives after it does not take
    that lookup's value (read before the change) but looks for itself."""

    cache = CredentialCache(10, 60, always_trusted=True)
    lookups = Lookups()
    before = asyncio.create_task(cache.load("t:1", lookups("principal")))
    await _started(lookups, 1)
    cache.drop(SUBJECTS)  # the token revoked: the change reaches this replica
    after = asyncio.create_task(cache.load("t:1", lookups(PermissionError("revoked"))))
    await _started(lookups, 2)
    await lookups.open_all()
    assert await before == ("principal", None)  # read before the change: served once
    with pytest.raises(PermissionError):
        await after
    assert cache.get("t:1") is None  # nor stored: it was read in the older epoch


@pytest.mark.anyio
async def test_an_untrusted_cache_shares_no_lookup():
    cache = CredentialCache(10, 60, always_trusted=False)
    lookups = Lookups()
    misses = [asyncio.create_task(cache.load("t:1", lookups())) for _ in range(3)]
    await _started(lookups, 3)
    await lookups.open_all()
    assert [await m for m in misses] == [("principal", None)] * 3
    assert (lookups.calls, cache.joined) == (3, 0)


@pytest.mark.anyio
async def test_a_failed_lookup_is_shared_with_nobody():
    """An unknown token may be created while its first lookup reads: a miss that joined that
    lookup looks for itself when it fails, and only the caller that made it sees its error."""

    cache = CredentialCache(10, 60, always_trusted=True)
    lookups = Lookups()
    first = asyncio.create_task(cache.load("t:1", lookups(LookupError("unknown"))))
    await _started(lookups, 1)
    joined = asyncio.create_task(cache.load("t:1", lookups("created meanwhile")))
    await asyncio.sleep(0)
    assert lookups.calls == 1  # waiting on the first
    await lookups.open_all()
    with pytest.raises(LookupError):
        await first
    await _started(lookups, 2)
    await lookups.open_all()
    assert await joined == ("created meanwhile", None)
    assert cache.joined == 0


@pytest.mark.anyio
async def test_a_cancelled_lookup_leaves_its_joiners_to_look_again():
    cache = CredentialCache(10, 60, always_trusted=True)
    lookups = Lookups()
    first = asyncio.create_task(cache.load("t:1", lookups()))
    await _started(lookups, 1)
    joined = asyncio.create_task(cache.load("t:1", lookups("second")))
    await asyncio.sleep(0)
    first.cancel()  # its client went away
    with pytest.raises(asyncio.CancelledError):
        await first
    await _started(lookups, 2)
    await lookups.open_all()
    assert await joined == ("second", None)
    assert not cache._flights  # nothing left in flight


class _Gated:
    """A database read that counts its calls and ends when the test opens the gate."""

    def __init__(self, value) -> None:
        self.value, self.calls, self.gate = value, 0, asyncio.Event()

    async def __call__(self, *args):
        self.calls += 1
        await self.gate.wait()
        return self.value


def _services(cache: CredentialCache):
    return SimpleNamespace(credentials=SimpleNamespace(cache=cache), db=object())


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["api token", "login session"])
async def test_sixteen_requests_of_one_credential_missing_together_read_it_once(monkeypatch, kind):
    """The authentication paths go through CredentialCache.load: an API token's lookup by its
    digest and an access token's session read, each shared by the misses that wait for it."""
    user = SessionUser("user_1", "team_1")
    if kind == "api token":
        principal = Principal("api_token", user_id="user_1", team_id="team_1", token_id="tok_1")
        read = _Gated((principal, SUBJECTS, None))
        monkeypatch.setattr(service, "_lookup_api_token", read)
        expected = principal

        def authenticate(services):
            return service._api_token_principal(services, "a" * 64)
    else:
        read = _Gated(user)
        monkeypatch.setattr(service.sessions, "user_of", read)
        expected = user

        def authenticate(services):
            return service._session_user(services, "ses_1")

    cache = CredentialCache(10, 60, always_trusted=True)
    services = _services(cache)
    misses = [asyncio.create_task(authenticate(services)) for _ in range(16)]
    for _ in range(100):
        if read.calls:
            break
        await asyncio.sleep(0)
    read.gate.set()
    assert [await m for m in misses] == [expected] * 16
    assert (read.calls, cache.lookups, cache.joined) == (1, 1, 15)
    assert await authenticate(services) == expected  # then served from the cache
    assert read.calls == 1

"""API, access and refresh tokens, and the secret that signs access tokens.

An API token is `mtr_` + 256 random bits; only its SHA-256 is stored (a fast hash is enough for
that much entropy, and it is found by that hash through an index).
An access token is `mat_<session id>.<expiry, unix s>.<HMAC-SHA256 signature>`: its signature
and expiry are checked without the database, then its session (refresh-token chain) is looked up
on every request, so a logout, a detected reuse or a deleted user stops it on every replica.
A team's ingestion key is `mik_` + 256 random bits, stored and found the same way.
A refresh token is `mrt_` + 256 random bits; only its SHA-256 is stored and it is found by that
hash. Every secret comparison goes through hmac.compare_digest.
"""

import asyncio
import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from metering.db import Database
from metering.errors import Unauthorized

API_TOKEN_PREFIX = "mtr_"
ACCESS_PREFIX = "mat_"
REFRESH_PREFIX = "mrt_"
INGEST_PREFIX = "mik_"
SECRET_KEY = "auth.signing_secret"
_KEY_LABEL = b"metering access token v1"


def digest(value: str) -> str:
    """SHA-256 hex of a high-entropy secret: what is stored and looked up, never the secret."""
    return hashlib.sha256(value.encode()).hexdigest()


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_api_token() -> str:
    return API_TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_ingest_key() -> str:
    return INGEST_PREFIX + secrets.token_urlsafe(32)


def new_refresh_token() -> str:
    return REFRESH_PREFIX + secrets.token_urlsafe(32)


def password_stamp(password_hash: str | None) -> str:
    """Changes whenever the password does (argon2 hashes are salted), reveals nothing of it."""
    return digest(f"password-stamp:{password_hash or ''}")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def derive_key(secret: str) -> bytes:
    """The access-token key: the secret itself never signs anything directly."""
    return hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class AccessClaims:
    session_id: str
    expires_at: datetime


class Signer:
    """Signs and reads access tokens with a key derived from METERING_SECRET, or else from a
    secret generated once in the database and shared by every replica."""

    def __init__(self, configured_secret: str | None) -> None:
        self._configured = configured_secret
        self._key: bytes | None = None
        self._lock = asyncio.Lock()

    async def key(self, db: Database) -> bytes:
        if self._key is None:
            async with self._lock:
                if self._key is None:
                    self._key = derive_key(self._configured or await load_or_create_secret(db))
        return self._key

    @staticmethod
    def _sign(key: bytes, body: str) -> str:
        return _b64(hmac.new(key, body.encode(), hashlib.sha256).digest())

    @classmethod
    def issue(cls, key: bytes, session_id: str, expires_at: datetime) -> str:
        body = f"{ACCESS_PREFIX}{session_id}.{int(expires_at.timestamp())}"
        return f"{body}.{cls._sign(key, body)}"

    @classmethod
    def read(cls, key: bytes, token: str) -> AccessClaims:
        """The claims of a token signed with this key (expired or not); 401 for anything else."""
        body, _, signature = token.rpartition(".")
        if not body.startswith(ACCESS_PREFIX) or not hmac.compare_digest(
            cls._sign(key, body).encode(), signature.encode()
        ):
            raise Unauthorized("invalid access token")
        session_id, _, expiry = body[len(ACCESS_PREFIX) :].partition(".")
        try:
            expires_at = datetime.fromtimestamp(int(expiry), UTC)
        except (ValueError, OverflowError, OSError):
            raise Unauthorized("invalid access token") from None
        return AccessClaims(session_id, expires_at)


# The secret is made by the database itself and read through the driver, below SQLAlchemy's
# engine logging, so not even SQL debug logs ever show it.
_CREATE_SECRET = {
    "postgresql": (
        "INSERT INTO key_values (key, value) VALUES ('{key}', "
        "replace(gen_random_uuid()::text || gen_random_uuid()::text || "
        "gen_random_uuid()::text, '-', '')) ON CONFLICT (key) DO NOTHING"
    ),
    "sqlite": (
        "INSERT INTO key_values (key, value) VALUES ('{key}', lower(hex(randomblob(32)))) "
        "ON CONFLICT (key) DO NOTHING"
    ),
}
_READ_SECRET = "SELECT value FROM key_values WHERE key = '{key}'"


async def load_or_create_secret(db: Database) -> str:
    """Replicas starting together race safely: the first insert wins, everyone reads it."""
    create, read = (
        _CREATE_SECRET[db.dialect].format(key=SECRET_KEY),
        _READ_SECRET.format(key=SECRET_KEY),
    )
    async with db.engine.connect() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        value: str | None
        if db.dialect == "postgresql":
            await driver.execute(create)
            value = await driver.fetchval(read)
        else:
            await driver.execute(create)
            await driver.commit()
            cursor = await driver.execute(read)
            row = await cursor.fetchone()
            await cursor.close()
            value = row[0] if row else None
    if not value:
        raise RuntimeError("could not create the signing secret in key_values")
    return value

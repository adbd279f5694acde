"""`metering demo`: the proxy on the embedded database, a simulated upstream, a demo token."""

import asyncio
import os
import secrets

import uvicorn
from sqlalchemy import select, update

from metering import migrate
from metering.app import create_app
from metering.db import Database, utcnow
from metering.identity import service
from metering.models import ApiToken, Team, User
from metering.settings import Settings, parse_catalog
from metering.sim.app import SimServer

DEMO_TEAM, DEMO_EMAIL = "demo-team", "demo@example.com"


def demo_catalog(sim: SimServer) -> dict:
    return {
        "providers": {
            "sim-openai": {
                "base_url": sim.base_url("openai"),
                "dialect": "openai",
                "api_key": "sim",
            },
            "sim-exascale": {
                "base_url": sim.base_url("exascale"),
                "dialect": "exascale",
                "api_key": "sim",
            },
        },
        "models": [
            {
                "name": "gpt-sim",
                "provider": "sim-openai",
                "upstream_model": "sim/gpt",
                "input_usd_per_mtok": "0.15",
                "output_usd_per_mtok": "0.60",
                "cached_input_usd_per_mtok": "0.075",
                "max_output_tokens": 4096,
            },
            {
                "name": "minimax-m2.1",
                "provider": "sim-exascale",
                "upstream_model": "MiniMaxAI/MiniMax-M2.1",
                "input_usd_per_mtok": "0.30",
                "output_usd_per_mtok": "1.20",
                "max_output_tokens": 16384,
            },
        ],
    }


async def demo_token(url: str) -> str:
    """The demo team, user and a fresh token (earlier demo tokens are revoked: one is enough)."""
    db = Database(url)
    try:
        async with db.transaction() as session:
            user = await session.scalar(
                select(User).where(User.email == DEMO_EMAIL, User.deleted_at.is_(None))
            )
            if user is None:
                team = await session.scalar(
                    select(Team).where(Team.name == DEMO_TEAM, Team.deleted_at.is_(None))
                )
                team = team or await service.create_team(session, DEMO_TEAM, None, "monthly")
                user = await service.create_user(
                    session,
                    email=DEMO_EMAIL,
                    name="Demo User",
                    team_id=team.id,
                    password_hash=None,
                    limit=None,
                    interval="never",
                )
            await session.execute(
                update(ApiToken)
                .where(ApiToken.user_id == user.id, ApiToken.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
            _, secret = await service.create_token(
                session, user.id, name="demo", limit=None, interval="never", expires_at=None
            )
        return secret
    finally:
        await db.dispose()


def banner(base: str, token: str, admin_key: str, url: str) -> str:
    return f"""
metering demo
  database      {url}
  proxy         {base}/v1   (models: gpt-sim, minimax-m2.1, served by a simulated upstream)
  admin key     {admin_key}
  demo token    {token}

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {token}" -H "Content-Type: application/json" \\
    -d '{{"model": "minimax-m2.1", "messages": [{{"role": "user", "content": "hello"}}]}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{base}/v1", api_key="{token}")
print(c.chat.completions.create(model="gpt-sim", messages=[{{"role": "user", "content": "hi"}}]))'

  curl -H "Authorization: Bearer {admin_key}" {base}/v1/usage
"""


def run_demo(host: str = "127.0.0.1", port: int = 8080) -> None:
    admin_key = os.environ.get("METERING_ADMIN_KEY") or "demo-admin-" + secrets.token_hex(8)
    settings = Settings(admin_key=admin_key)
    migrate.upgrade(settings.database_url)
    sim = SimServer().start()
    try:
        catalog = parse_catalog(demo_catalog(sim))
        token = asyncio.run(demo_token(settings.database_url))
        print(banner(f"http://{host}:{port}", token, admin_key, settings.database_url), flush=True)
        config = uvicorn.Config(
            create_app(settings, catalog),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
        )
        uvicorn.Server(config).run()
    finally:
        sim.stop()

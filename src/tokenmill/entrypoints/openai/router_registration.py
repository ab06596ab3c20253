"""A replica's side of `tokenmill router`: `tokenmill serve --register-with ROUTER_URL` posts its own URL
to the router's /router/workers at start and again every few seconds (a heartbeat: a router that
restarted, or dropped the replica, learns of it again)."""

from __future__ import annotations

import asyncio
import logging

import httpx

logger = logging.getLogger(__name__)
HEARTBEAT_S = 2.0


async def register_forever(router_url: str, own_url: str, api_key: str | None = None,
                           interval: float = HEARTBEAT_S) -> None:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    warned = False
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            try:
                r = await client.post(f"{router_url.rstrip('/')}/router/workers", json={"url": own_url},
                                      headers=headers)
                r.raise_for_status()
                warned = False
            except httpx.HTTPError as e:
                if not warned:  # once per outage, not every heartbeat
                    logger.warning("could not register with the router at %s: %s", router_url, e)
                    warned = True
            await asyncio.sleep(interval)

"""GET /metrics: the control plane's Prometheus metrics (control/metrics.py).

Served without an API key, like a Prometheus scrape port: a scraper holds no tinker key, and the
page carries no account, run or checkpoint names (labels are op types, lanes and token kinds), so it
tells a caller nothing about anyone's work. An operator who does not want even the totals public
blocks the path at the proxy in front of tinkerd, or passes --no-metrics (404 here).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tinkerd.api.deps import state
from tinkerd.control.metrics import CONTENT_TYPE
from tinkerd.errors import NotFoundError

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = state(request)
    if not st.config.metrics:
        raise NotFoundError("metrics are off on this server (--no-metrics)")
    # Off the event loop: the collectors take the queue's lock.
    return Response(await asyncio.to_thread(st.control.metrics.exposition), media_type=CONTENT_TYPE)

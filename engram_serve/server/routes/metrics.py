"""GET /metrics: the app's Prometheus registry (`server/metrics.py`), in the text format."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..context import AppContext


def register(app: "FastAPI", ctx: "AppContext") -> None:
    from fastapi.responses import Response

    from ..metrics import CONTENT_TYPE

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
             response_class=Response)
    async def metrics_endpoint():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

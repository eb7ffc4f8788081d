"""`ApiKey` (ASGI middleware): with an API key set, every path but /health and /metrics needs
`Authorization: Bearer <key>`; otherwise 401 with an OpenAI error body."""
from __future__ import annotations

import hmac

from .limits import refuse
from .protocol import error_body

OPEN = ("/health", "/metrics")


class ApiKey:
    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in OPEN:
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.key}".encode()):
                return await refuse(receive, send, 401, error_body(
                    "missing or wrong API key (Authorization: Bearer <key>)", None, "invalid_api_key"))
        return await self.app(scope, receive, send)

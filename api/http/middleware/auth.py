"""Optional API key: every path but an explicit allow-list needs `Authorization: Bearer`."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from api.http.errors import Unauthorized

# Probes and scrapers carry no key: these answer without one, and hold nothing secret.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"})


class ApiKeyGuard:
    """Refuses requests without the key with 401 and `WWW-Authenticate: Bearer`.

    A middleware rather than a route dependency, so a route added later cannot forget it.
    The key is compared in constant time and never written to logs or error bodies.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        reason = "missing API key" if not given else "wrong API key"
        await Unauthorized(reason).response(scope["path"])(scope, receive, send)

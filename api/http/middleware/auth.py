"""Optional API keys: every path but an explicit allow-list needs `Authorization: Bearer`;
the routes that change what is served are closed unless an admin key is set, and then open
to it alone."""

from __future__ import annotations

import hmac
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from api.http.errors import Unauthorized, response_for
from api.serving.errors import Forbidden

# Probes and scrapers carry no key: these answer without one, and hold nothing secret.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"})
# Routes that change what is served (and read folders of the server): ADMIN_API_KEY's alone.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# A model's rollout: promote and roll back, and a candidate set or stopped (reading it, GET,
# is no change).
ADMIN_ROLLOUT = re.compile(r"/v1/adapters/[^/]+/(promote|rollback)")
CANDIDATE = re.compile(r"/v1/adapters/[^/]+/candidate")
ADMIN_CLOSED = (
    "changing adapters (loading, unloading, candidates, promotion) is closed: set "
    "ADMIN_API_KEY to open these routes to that key (API_KEY does not open them)"
)


def is_admin_route(path: str, method: str) -> bool:
    """The request changes which adapters are served or how."""
    if path in ADMIN_PATHS or ADMIN_ROLLOUT.fullmatch(path):
        return True
    return method not in ("GET", "HEAD") and CANDIDATE.fullmatch(path) is not None


class ApiKeyGuard:
    """Refuses requests without the right key with 401 and `WWW-Authenticate: Bearer`.

    With `api_key`, every path but OPEN_PATHS needs it (or the admin key); the admin routes
    (`is_admin_route`) need `admin_key`, and without one answer 403 to everybody. A
    middleware rather than a route dependency, so a route added later cannot forget it. Keys
    are compared in constant time and never written to logs or error bodies.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_key: str | None = None) -> None:
        self.app = app
        self._api = _bearer(api_key)
        self._admin = _bearer(admin_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        accepted: list[bytes]
        if is_admin_route(scope["path"], scope["method"]):
            if self._admin is None:
                await response_for(Forbidden(ADMIN_CLOSED), scope["path"])(scope, receive, send)
                return
            accepted = [self._admin]
        elif self._api is not None:
            accepted = [key for key in (self._api, self._admin) if key is not None]
        else:  # no API key: open
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Every key compared, whichever matches, so the time taken tells nothing.
        matches = [hmac.compare_digest(given, key) for key in accepted]
        if any(matches):
            await self.app(scope, receive, send)
            return
        reason = "missing API key" if not given else "wrong API key"
        await response_for(Unauthorized(reason), scope["path"])(scope, receive, send)


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key is not None else None

"""API keys: when any are set, every endpoint but `/health` wants `Authorization: Bearer <key>`.

Keys come from the environment of the router replicas (`RTPD_API_KEYS`, comma-separated: set it where
`make run` / `serve run` runs, or in the KubeRay container's env) and from the config (`router.api_keys`).
Browsers cannot set headers on a WebSocket, so the realtime endpoint also takes the key as the subprotocol
`openai-insecure-api-key.<key>`, as OpenAI's Realtime API does. A wrong or missing key gets 401 with OpenAI
error JSON (HTTP) or a close with code 1008 (WebSocket). Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

API_KEYS_ENV = "RTPD_API_KEYS"
SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
PUBLIC_PATHS = frozenset({"/health"})


class APIKeys:
    def __init__(self, configured: Iterable[str] = ()) -> None:
        from_env = os.environ.get(API_KEYS_ENV, "")
        self.keys = tuple(k for k in {*configured, *(k.strip() for k in from_env.split(","))} if k)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def valid(self, key: str | None) -> bool:
        if not self.enabled:
            return True
        if not key:
            return False
        # Every key is compared (constant time), so the time taken says nothing about which one came close.
        return any([hmac.compare_digest(key.encode(), k.encode()) for k in self.keys])

    @staticmethod
    def key_id(key: str | None) -> str:
        """Who owns a session: a digest of the key (never the key), "" without one."""
        return hashlib.sha256(key.encode()).hexdigest()[:24] if key else ""

    @staticmethod
    def bearer(authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def allows_http(self, path: str, authorization: str | None) -> bool:
        return path in PUBLIC_PATHS or self.valid(self.bearer(authorization))

    def websocket_key(self, authorization: str | None, subprotocols: Iterable[str]) -> str | None:
        """The valid key of a WebSocket handshake (the header's, or the browser's
        `openai-insecure-api-key.<key>` subprotocol); "" when no key is needed; None: refused."""
        if not self.enabled:
            return ""
        if self.valid(key := self.bearer(authorization)):
            return key
        offered = [p[len(SUBPROTOCOL_PREFIX) :] for p in subprotocols if p.startswith(SUBPROTOCOL_PREFIX)]
        return next((key for key in offered if self.valid(key)), None)

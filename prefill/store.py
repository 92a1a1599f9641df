"""Where sessions outlive their prefill replica: each session's journal and its current owner.

A session's KV lives on its owner replica, but its input does not have to: every change a client makes
(created, chunk, message, buffer edit, settings, answer started, claimed, ended) is appended to the session's
journal here before the call is acknowledged (prefill/journal.py). When the owner dies, the replica that the
session's next call reaches replays the journal and prefills the input again: the client sees a delay, and then
the answer it would have had.

The default backend is Ray's own fault-tolerant store, the GCS key-value store: Ray Serve keeps its controller's
checkpoints there, so it lives exactly as long as the application can (and with KubeRay's GCS fault tolerance,
backed by Redis, it survives the head node too). It costs one GCS write (~0.5 ms) per client call and needs no
extra service. `memory` keeps journals in the replica's own process: no failover, for tests and single-replica
development.

Keys (namespace `rtpd_sessions`):
    s/<session>/r/<n>          journal record n (JSON), n counted from 0 without gaps
    s/<session>/owner          the replica that holds it now
    s/<session>/claim/<prev>   who took it over from replica <prev>: written once (put-if-absent), so that two
                               replicas racing to adopt a session from a dead owner agree on one
"""

from __future__ import annotations

import json
from typing import Any, Protocol

NAMESPACE = b"rtpd_sessions"
TIMEOUT_S = 5.0


class SessionStore(Protocol):
    async def append(self, session_id: str, n: int, record: dict[str, Any]) -> None: ...

    async def records(self, session_id: str) -> list[dict[str, Any]]:
        """The journal in order, up to its first gap (a record whose write never finished)."""
        ...

    async def owner(self, session_id: str) -> str | None: ...

    async def set_owner(self, session_id: str, replica: str) -> None: ...

    async def claim(self, session_id: str, previous: str, replica: str) -> str:
        """Take the session over from `previous`; returns who did (`replica`, or whoever claimed it first)."""
        ...

    async def delete(self, session_id: str) -> None: ...


def _record_key(session_id: str, n: int) -> bytes:
    return f"s/{session_id}/r/{n:08d}".encode()


def _in_order(values: dict[int, bytes]) -> list[dict[str, Any]]:
    out = []
    while len(out) in values:
        out.append(json.loads(values[len(out)]))
    return out


class GcsSessionStore:
    """Ray's GCS key-value store (through the worker's own GCS client, asynchronously)."""

    shared = True  # every replica reads the same store

    def __init__(self) -> None:
        from ray._private.worker import global_worker

        self.gcs = global_worker.gcs_client

    async def append(self, session_id: str, n: int, record: dict[str, Any]) -> None:
        await self.gcs.async_internal_kv_put(
            _record_key(session_id, n), json.dumps(record).encode(), True, NAMESPACE, timeout=TIMEOUT_S
        )

    async def records(self, session_id: str) -> list[dict[str, Any]]:
        prefix = f"s/{session_id}/r/".encode()
        keys = await self.gcs.async_internal_kv_keys(prefix, NAMESPACE, timeout=TIMEOUT_S)
        if not keys:
            return []
        values = await self.gcs.async_internal_kv_multi_get(keys, NAMESPACE, timeout=TIMEOUT_S)
        return _in_order({int(k[len(prefix) :]): v for k, v in values.items() if v is not None})

    async def owner(self, session_id: str) -> str | None:
        value = await self.gcs.async_internal_kv_get(f"s/{session_id}/owner".encode(), NAMESPACE, timeout=TIMEOUT_S)
        return value.decode() if value else None

    async def set_owner(self, session_id: str, replica: str) -> None:
        key = f"s/{session_id}/owner".encode()
        await self.gcs.async_internal_kv_put(key, replica.encode(), True, NAMESPACE, timeout=TIMEOUT_S)

    async def claim(self, session_id: str, previous: str, replica: str) -> str:
        key = f"s/{session_id}/claim/{previous}".encode()
        added = await self.gcs.async_internal_kv_put(key, replica.encode(), False, NAMESPACE, timeout=TIMEOUT_S)
        if added:
            return replica
        winner = await self.gcs.async_internal_kv_get(key, NAMESPACE, timeout=TIMEOUT_S)
        return winner.decode() if winner else replica

    async def delete(self, session_id: str) -> None:
        await self.gcs.async_internal_kv_del(f"s/{session_id}/".encode(), True, NAMESPACE, timeout=TIMEOUT_S)


class MemorySessionStore:
    """In this process only: a replica's death takes its sessions with it."""

    shared = False

    def __init__(self) -> None:
        self.journals: dict[str, dict[int, bytes]] = {}
        self.owners: dict[str, str] = {}
        self.claims: dict[tuple[str, str], str] = {}

    async def append(self, session_id: str, n: int, record: dict[str, Any]) -> None:
        self.journals.setdefault(session_id, {})[n] = json.dumps(record).encode()

    async def records(self, session_id: str) -> list[dict[str, Any]]:
        return _in_order(self.journals.get(session_id, {}))

    async def owner(self, session_id: str) -> str | None:
        return self.owners.get(session_id)

    async def set_owner(self, session_id: str, replica: str) -> None:
        self.owners[session_id] = replica

    async def claim(self, session_id: str, previous: str, replica: str) -> str:
        return self.claims.setdefault((session_id, previous), replica)

    async def delete(self, session_id: str) -> None:
        self.journals.pop(session_id, None)
        self.owners.pop(session_id, None)
        for key in [k for k in self.claims if k[0] == session_id]:
            del self.claims[key]


def make_store(backend: str) -> SessionStore:
    return GcsSessionStore() if backend == "gcs" else MemorySessionStore()

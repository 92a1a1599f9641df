"""Which prefill replica holds a session: the one home of the session → replica mapping.

A session id names the replica that created it (`sess_<replica>_<secret>`). When that replica is gone, the
session belongs to the replica its id hashes to among the live ones (rendezvous hashing: every router replica,
and a draining prefill replica handing its sessions over, pick the same one with no shared table).

The Serve request routers of each process register here by deployment name (`POOLS`, router/placement.py), so
that the ingress reads the replicas' last routing stats for admission control and a draining replica sees its
peers, without a call of their own.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.request_router import RunningReplica

POOLS: dict[str, PowerOfTwoChoicesRequestRouter] = {}


def new_session_id(owner: str) -> str:
    """Unguessable, and names its owner replica so every router replica can route to it."""
    return f"sess_{owner}_{secrets.token_urlsafe(18)}"


def owner_of(session_id: str) -> str | None:
    parts = session_id.split("_", 2)
    return parts[1] if len(parts) == 3 and parts[0] == "sess" else None


def rendezvous(key: str, replicas: list[RunningReplica]) -> RunningReplica:
    """The replica `key` hashes to (highest random weight): stable while that replica lives, and only the keys
    of a replica that left move when the set changes."""

    def weight(replica: RunningReplica) -> bytes:
        return hashlib.blake2b(f"{key}/{replica.replica_id.unique_id}".encode(), digest_size=8).digest()

    return max(replicas, key=weight)


def register_pool(deployment: str, router: PowerOfTwoChoicesRequestRouter) -> None:
    """A request router of this process registers its pool. (A function, not the dict, is what router/placement.py's
    classes name: Serve pickles their module by value, and would take the live routers in POOLS with it.)"""
    POOLS[deployment] = router


def pool(deployment: str) -> PowerOfTwoChoicesRequestRouter | None:
    """The request router of `deployment` in this process (None: this process has not called it yet)."""
    return POOLS.get(deployment)


def pool_replicas(deployment: str) -> list[str]:
    """The ids of the running replicas of `deployment` (none: no router for it in this process)."""
    router = pool(deployment)
    return [] if router is None else [r.replica_id.unique_id for r in router.curr_replicas.values()]


def pool_stats(deployment: str) -> list[dict[str, Any]] | None:
    """The routing stats of every running replica of `deployment` (None: no router for it in this process)."""
    router = pool(deployment)
    if router is None:
        return None
    return [dict(r.routing_stats or {}) for r in router.curr_replicas.values()]

"""Session affinity for the prefill pool: a session's requests go to the replica that holds its KV.

A session id names its owner replica (`sess_<replica>_<secret>`), so every router replica routes alike with
no shared table. A replica that drains (scale-down, redeploy) hands its open sessions to another replica,
which then lists the drained owner in its routing stats (`record_routing_stats`), and calls follow it there.
Requests without a session id take Ray Serve's default power-of-two-choices routing. The decode pool has a
router of its own (`DecodeRouter`): each router replica's feed is pinned to the decode replica it reads.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from prefill.session import owner_of


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        session_id = pending_request.kwargs.get("session_id") if pending_request is not None else None
        owner = owner_of(session_id) if isinstance(session_id, str) else None
        if owner is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == owner:
                    return [[replica]]
            # The owner drained and handed its sessions over: the adopter says so in its routing stats.
            for replica in candidate_replicas:
                if owner in (replica.routing_stats or {}).get("adopted_owners", ()):
                    return [[replica]]
        return await super().choose_replicas(candidate_replicas, pending_request)


class DecodeRouter(PowerOfTwoChoicesRequestRouter):
    """The decode pool: a call that names a `replica` (a router's feed, a stop) goes to it; a new request goes
    to the replica with the fewest active streams (each replica reports them in its routing stats), since
    streams outlive the short calls that start them and Serve's own queue lengths do not see them."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replica = pending_request.kwargs.get("replica") if pending_request is not None else None
        if isinstance(replica, str):
            for candidate in candidate_replicas:
                if candidate.replica_id.unique_id == replica:
                    return [[candidate]]
            # Gone: any replica answers that it is not the one (and the caller learns it).
            return [candidate_replicas[:1]]
        if len(candidate_replicas) > 1 and all(r.routing_stats for r in candidate_replicas):
            ranked = sorted(candidate_replicas, key=lambda r: r.routing_stats.get("active_streams", 0))
            return [ranked[:2], ranked[2:]] if len(ranked) > 2 else [ranked]
        return await super().choose_replicas(candidate_replicas, pending_request)

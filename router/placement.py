"""Session affinity for the prefill pool: a session's requests go to the replica that holds its KV.

A session id names its owner replica (`sess_<replica>_<secret>`), so every router replica routes alike with
no shared table. A replica that drains (scale-down, redeploy) hands its open sessions to another replica,
which then lists the drained owner in its routing stats (`record_routing_stats`), and calls follow it there.
Requests without a session id take Ray Serve's default power-of-two-choices routing.
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

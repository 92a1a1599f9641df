"""Request routing for the two pools: session affinity on prefill, stream-aware placement on decode.

A session id names the replica that created it (`sess_<replica>_<secret>`). A call on a session goes to its
current owner: the one in the id, or the one a router learnt (`route_to`, router/sessions/owner.py keeps what replicas
answered), or, when that replica is gone, the replica the session's id hashes to among the live ones
(rendezvous hashing, core/placement.py), which then adopts the session from its journal
(prefill/failover.py). Requests without a session id take Ray Serve's power-of-two
choices.

The decode pool has a router of its own (`DecodeRouter`): a call naming a `replica` (a router's feed, a stop)
goes to it; a new request goes to the replica it `prefer`s if it can (a continuation where its KV is cached),
else to the replica with the fewest active streams, never to one in `avoid` (the replica an answer is being
resumed from). A router with a feed connection open to the replica it would pick places the request itself, by the
same policy (`choose_decode`), and starts it over that connection (decode/wire.py): no Serve call per request.

The speech pool's `SpeechRouter` sends a REST session's audio to the one replica that holds its turn's audio.

Each router registers itself in `POOLS` (core/placement.py) by deployment name, so that the ingress can
read the replicas' last routing stats (their load) for admission control (router/admission/gate.py) without a call
of its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from core.autoscaling import ACTIVE_STREAMS
from core.placement import owner_of, pool, register_pool, rendezvous

DECODE_POOL = "decode"  # the decode deployment's name


class _Registered(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        register_pool(self._deployment_id.name, self)


class SessionAffinityRouter(_Registered):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        session_id = kwargs.get("session_id")
        owner = owner_of(session_id) if isinstance(session_id, str) else None
        for target in (kwargs.get("route_to"), owner):
            for replica in candidate_replicas:
                if target is not None and replica.replica_id.unique_id == target:
                    return [[replica]]
        if owner is not None and candidate_replicas:
            # Gone (died, or drained): the replica this session hashes to adopts it, or holds it already (a
            # draining replica hands each session to exactly this replica), or knows who does.
            return [[rendezvous(session_id, candidate_replicas)]]
        return await super().choose_replicas(candidate_replicas, pending_request)


class DecodeRouter(_Registered):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        replica = kwargs.get("replica")
        if isinstance(replica, str):
            for candidate in candidate_replicas:
                if candidate.replica_id.unique_id == replica:
                    return [[candidate]]
            # Gone: any replica answers that it is not the one (and the caller learns it).
            return [candidate_replicas[:1]]
        preferred, candidates = decode_candidates(candidate_replicas, kwargs.get("avoid") or (), kwargs.get("prefer"))
        if preferred:
            return [preferred, candidates]
        if len(candidates) > 1 and all(r.routing_stats for r in candidates):
            ranked = sorted(candidates, key=lambda r: r.routing_stats.get(ACTIVE_STREAMS, 0))
            return [ranked[:2], ranked[2:]] if len(ranked) > 2 else [ranked]
        return await super().choose_replicas(candidates, pending_request)


class SpeechRouter(_Registered):
    """The speech pool: a call naming a `route_to` replica goes to it (the one a router learnt holds a REST
    session's audio turn, router/sessions/audio.py); other REST session audio calls (`session_id`) to the
    replica the id hashes to among the live ones (speech/sessions.py holds the turn's audio there);
    transcriptions of audio the caller holds (the realtime socket's) take power-of-two choices."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("route_to")
        for replica in candidate_replicas:
            if target is not None and replica.replica_id.unique_id == target:
                return [[replica]]
        session_id = kwargs.get("session_id")
        if isinstance(session_id, str) and candidate_replicas:
            return [[rendezvous(session_id, candidate_replicas)]]
        return await super().choose_replicas(candidate_replicas, pending_request)


def decode_candidates(
    replicas: list[RunningReplica], avoid: Collection[str], prefer: str | None
) -> tuple[list[RunningReplica], list[RunningReplica]]:
    """The decode pool's first rule, for Serve's routing (`DecodeRouter`) and the router's own (`choose_decode`): the
    replicas not avoided (all of them if every one is), split into `prefer` (a continuation where its KV is cached,
    if it runs) and the others."""
    candidates = [r for r in replicas if r.replica_id.unique_id not in avoid] or replicas
    preferred = [r for r in candidates if r.replica_id.unique_id == prefer]
    return preferred, [r for r in candidates if r not in preferred]


def choose_decode(avoid: Collection[str], prefer: str | None, local: Callable[[], dict[str, int]]) -> str | None:
    """The decode replica for a new stream, chosen in this process by `DecodeRouter`'s policy, for a start that goes
    over that replica's feed connection instead of through Serve (decode/wire.py): `prefer` if it runs and is not
    avoided, else the one with the fewest active streams (its last routing stats, or this router's own streams on
    it, `local()`, if more: the stats are a second or two old). None: this process has no view of the pool yet."""
    decode = pool(DECODE_POOL)
    replicas = [] if decode is None else list(decode.curr_replicas.values())
    preferred, candidates = decode_candidates(replicas, avoid, prefer)
    if preferred:
        return preferred[0].replica_id.unique_id
    if len(candidates) <= 1:
        return candidates[0].replica_id.unique_id if candidates else None
    mine = local()
    load = {
        r.replica_id.unique_id: max((r.routing_stats or {}).get(ACTIVE_STREAMS, 0), mine.get(r.replica_id.unique_id, 0))
        for r in candidates
    }
    least = min(load.values())
    return random.choice([replica for replica, n in load.items() if n == least])

"""Sessions changing owner: adopted from a dead replica's journal, or handed over by a draining one.

A call for a session this replica does not hold reaches it because the session's owner is gone from the
routers' view (router/placement.py sends it to the replica the session id hashes to). The session store says
who owns it now (prefill/store.py):
- nobody: there is no such session (404);
- a live replica: it moved there; the router is told where (503 with `owner`) and goes there;
- a dead replica: this one claims the session from it (exactly one replica wins the claim), replays its journal
  (prefill/journal.py) and prefills its input again; an answer that was handed off but not yet read is handed
  off again here, and one a router was streaming is reported here when it ends;
- this replica: a draining replica is handing it over to this one; the call waits for it (bounded), and adopts
  it from the journal itself if the hand-over does not come.

A draining replica (`drain`, from the deployment's graceful shutdown) hands every open session over in
parallel: each to the replica its id hashes to among the others (so that routers find it there at once), in
batches that the adopters take without waiting for the re-prefill, which runs in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Protocol

import ray
from ray import serve

from core import metrics
from core.config import AppConfig
from core.placement import owner_of
from prefill.answer import Answer
from prefill.client import PrefillClient
from prefill.conversation import SessionError
from prefill.journal import Journal, replay
from prefill.session import Session, SessionState
from prefill.session_table import SessionTable
from prefill.store import SessionStore

logger = logging.getLogger(__name__)
ARRIVAL_WAIT_S = 5.0  # how long a call waits for a session being handed over to this replica
DRAIN_HANDOFFS_S = 3.0  # how long a draining replica lets hand-offs in progress finish before handing over
DRAIN_BATCH = 32  # sessions per adoption call


class SessionMoved(SessionError):
    """The session is held by another (live) replica: the router retries there (router/sessions/owner.py)."""

    def __init__(self, session_id: str, owner: str) -> None:
        super().__init__(503, f"session {session_id} is held by another replica; retry there", "session_id")
        self.owner = owner


class AnswerHandOff(Protocol):
    """What an adopted session needs of the hand-offs (prefill/handoff.py `HandOffs`): its answer made again."""

    async def hand_off(self, session: Session, answer: Answer) -> None: ...


class PreemptiveClose(Protocol):
    """What a draining replica needs of the preemptive answers (prefill/preemptive.py `Preemptive`)."""

    def close(self, session: Session) -> None: ...


class Failover:
    """Sessions moving between replicas: located and adopted here, or handed over by this replica's drain."""

    def __init__(
        self,
        table: SessionTable,
        handoffs: AnswerHandOff,
        preemptive: PreemptiveClose,
        store: SessionStore | None,
        replica: str,
        app_name: str,
        deployment: str,
        config: AppConfig,
    ) -> None:
        self.table = table
        self.sessions = table.sessions
        self.handoffs = handoffs
        self.preemptive = preemptive
        self.store = store  # prefill/store.py (None: sessions are not journaled, as in unit tests)
        self.replica, self.app_name, self.deployment = replica, app_name, deployment
        self.config = config
        self._locating: dict[str, asyncio.Lock] = {}  # one adoption per session at a time

    # --- a call for a session held elsewhere -------------------------------------------------------
    async def locate(self, session_id: str) -> None:
        """Make the session held here if its owner is gone (SessionMoved if it lives elsewhere; nothing if
        there is no such session: the call then answers 404)."""
        if self.store is None or owner_of(session_id) is None:
            return
        locks = self._locating
        lock = locks.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:  # one adoption per session, however many of its calls arrive at once
                await self._locate_once(session_id)
        finally:
            if not lock.locked():
                locks.pop(session_id, None)

    async def _locate_once(self, session_id: str) -> None:
        deadline = time.monotonic() + ARRIVAL_WAIT_S
        while session_id not in self.sessions:
            owner = await self.store.owner(session_id)
            if owner is None:
                return  # never existed, or closed and forgotten
            if owner == self.replica:  # being handed over to this replica: wait for it, then take it anyway
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    continue
                await self._adopt_journal(session_id)
            elif await self.alive(owner):
                logger.info("session %s is held by replica %s: the router goes there", session_id, owner)
                raise SessionMoved(session_id, owner)
            else:
                winner = await self.store.claim(session_id, owner, self.replica)
                if winner != self.replica:
                    logger.info("session %s was taken over from %s by %s", session_id, owner, winner)
                    raise SessionMoved(session_id, winner)
                await self._adopt_journal(session_id)
            return

    async def alive(self, replica: str) -> bool:
        """Whether `replica` of this deployment still runs (a dead replica's actor name is released)."""
        name = f"SERVE_REPLICA::{self.app_name}#{self.deployment}#{replica}"
        try:
            await asyncio.to_thread(ray.get_actor, name, namespace="serve")
        except ValueError:
            return False
        return True

    async def _adopt_journal(self, session_id: str) -> None:
        records = await self.store.records(session_id)
        if not records:
            return
        self.adopt(records)
        await self.store.set_owner(session_id, self.replica)
        metrics.inc(metrics.SESSIONS_ADOPTED, 1, "sessions taken over from another replica", why="owner_died")
        logger.info("session %s adopted from its journal (%d records)", session_id, len(records))

    def adopt(self, records: list[dict[str, Any]]) -> Session:
        """The session rebuilt from its journal, held here, its work resumed."""
        session_id = records[0]["id"]
        session = replay(records, self.table.streaming(session_id))
        session.journal = Journal(self.store, session_id, next_n=len(records))
        self.sessions[session_id] = session
        answer = session.answers[-1] if session.answers else None
        if answer is not None and answer.status in ("preparing", "ready"):
            # Its hand-off was made on the old owner, whose KV is gone: make it again here.
            answer.status = "preparing"
            answer.task = asyncio.create_task(self.handoffs.hand_off(session, answer))
        elif answer is not None and answer.status == "streaming":  # its router reports the end here
            answer.claimed_at = answer.alive_at = time.monotonic()
        else:
            asyncio.create_task(self._prefill_again(session))
        return session

    async def _prefill_again(self, session: Session) -> None:
        async with session.lock:  # calls on the session wait for its KV rather than race it
            try:
                await self.table.prefill_stable(session)
            except Exception:
                logger.exception("session %s: prefilling its input again failed", session.id)

    # --- draining -----------------------------------------------------------------------------------
    async def adopt_sessions(self, owner: str, journals: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Take over a draining replica's sessions (their journals). Returns at once: the re-prefill runs in
        the background, and calls on a session wait for it."""
        adopted = []
        for records in journals:
            sid = records[0]["id"]
            if sid in self.sessions:
                continue
            if not getattr(self.store, "shared", False):  # a replica-local store: the journal moves with it
                for n, record in enumerate(records):
                    await self.store.append(sid, n, record)
            await self.store.set_owner(sid, self.replica)
            self.adopt(records)
            adopted.append(sid)
        metrics.inc(metrics.SESSIONS_ADOPTED, len(adopted), "sessions taken over from another replica", why="drain")
        logger.info("adopted %d sessions from draining replica %s", len(adopted), owner)
        return {"adopted": adopted, "by": self.replica}

    async def drain(self) -> None:
        """Before this replica stops, hand every open session to the others, in parallel, within the drain
        timeout. Serve routes nothing new here by now; hand-offs in progress get a moment to finish (an answer
        a router is streaming is reported to its new owner when it ends)."""
        started = time.monotonic()
        deadline = started + self.config.prefill.drain_timeout_s
        while time.monotonic() < min(deadline, started + DRAIN_HANDOFFS_S) and any(
            s.answers and s.answers[-1].status == "preparing" for s in self.sessions.values()
        ):
            await asyncio.sleep(0.1)
        for session in self.sessions.values():  # its adopter makes its preemptive answers from now on
            if session.preempt is not None:
                self.preemptive.close(session)
        open_sessions = [s for s in self.sessions.values() if s.state != SessionState.CLOSED and s.journal is not None]
        if not open_sessions or self.store is None:
            return
        for session in open_sessions:  # pending journal writes land first: none is lost on the way out
            await session.journal.flush()
        journals = await asyncio.gather(*(self.store.records(s.id) for s in open_sessions))
        peers = PrefillClient(serve.get_deployment_handle(self.deployment, self.app_name))
        with contextlib.suppress(Exception):  # a first call gives this process a view of the pool (POOLS)
            await asyncio.wait_for(peers.check_health(), 2.0)
        groups = self._adopters([s.id for s in open_sessions])
        calls = []
        by_id = {j[0]["id"]: j for j in journals if j}
        for adopter, ids in groups.items():
            for i in range(0, len(ids), DRAIN_BATCH):
                batch = [by_id[sid] for sid in ids[i : i + DRAIN_BATCH] if sid in by_id]
                if not batch:
                    continue
                if adopter is not None:  # calls reaching the adopter first wait for the hand-over
                    await asyncio.gather(*(self.store.set_owner(r[0]["id"], adopter) for r in batch))
                # To its adopter (steered by the first session's id and `route_to`), else to any replica.
                steer = batch[0][0]["id"] if adopter else None
                calls.append(
                    peers.adopt_sessions(owner=self.replica, journals=batch, session_id=steer, route_to=adopter)
                )
        left = max(0.1, deadline - time.monotonic())
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), left)
        handed = sum(len(r["adopted"]) for r in results if isinstance(r, dict))
        failed = [r for r in results if not isinstance(r, dict)]
        took = time.monotonic() - started
        logger.info("drained: %d sessions handed over in %.2f s (%d calls failed)", handed, took, len(failed))

    def _adopters(self, session_ids: list[str]) -> dict[str | None, list[str]]:
        """Each session's adopter: the replica its id hashes to among the others (as routers will route it);
        None (any replica) if this process has no view of the pool."""
        from core.placement import pool, rendezvous

        router = pool(self.deployment)
        replicas = router.curr_replicas.values() if router is not None else []
        others = [r for r in replicas if r.replica_id.unique_id != self.replica]
        groups: dict[str | None, list[str]] = {}
        for sid in session_ids:
            adopter = rendezvous(sid, others).replica_id.unique_id if others else None
            groups.setdefault(adopter, []).append(sid)
        return groups

"""Prefill and decode on different Ray nodes (a head and workers started on this machine), NIXL between them;
then the node that runs an answer's decode replica is lost, and the answers and sessions go on.

Run as a script (it owns its Ray cluster); prints one JSON line with what it saw. tests/multinode/ runs it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import httpx
import yaml
from ray import serve
from ray.cluster_utils import Cluster

from serve_app.builder import build_app
from tests.integration.conftest import ROOT, apply_serve_env, for_tests

PORT = 8766
APP = "realtime-pd"
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}  # answers still streaming when the node goes


def decode_replicas() -> dict[str, dict[str, Any]]:
    """Each decode replica's engine figures (its node among them), by replica id."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#decode#"
    ids = [a["name"][len(prefix) :] for a in ray.util.list_named_actors(True) if a["name"].startswith(prefix)]
    handle = serve.get_deployment_handle("decode", APP)
    return {rid: handle.stats.remote(replica=rid).result(timeout_s=60) for rid in ids}


def stream_text(
    base: str, path: str, body: dict[str, Any] | None, out: dict[str, Any], started: threading.Event
) -> None:
    """Read an SSE answer (a chat completion, or a session's /events) to its end: its text and any error."""
    text, errors = [], []
    method = "POST" if body is not None else "GET"
    with httpx.stream(method, f"{base}{path}", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            if frame.get("error"):  # (a session's closing summary carries `"error": null`)
                errors.append(frame["error"])
            for choice in frame.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    text.append(piece)
                    started.set()
    out.update(text="".join(text), errors=errors)
    started.set()


def lose_the_decode_node(cluster: Cluster, base: str) -> dict[str, Any]:
    """Two answers streaming (a chat completion and a session's), the node of the decode replica that runs
    them removed mid-answer; both must end with the uninterrupted answer's text, and the session goes on."""
    messages = [{"role": "user", "content": "Two nodes, one machine, and one of them is lost. " * 20}]
    sessions = f"{base}/v1/streaming_input/sessions"
    sid = httpx.post(sessions, json={"messages": [], **LONG}, timeout=120).json()["session_id"]
    chunk = {"sequence_id": 0, "payload": messages[0]["content"], "end_of_input": True}
    assert httpx.post(f"{sessions}/{sid}/chunks", json=chunk, timeout=120).status_code == 202

    chat, session = {}, {}
    chat_started, session_started = threading.Event(), threading.Event()
    body = {"messages": messages, "stream": True, **LONG}
    events = f"/v1/streaming_input/sessions/{sid}/events"
    readers = [
        threading.Thread(target=stream_text, args=(base, "/v1/chat/completions", body, chat, chat_started)),
        threading.Thread(target=stream_text, args=(base, events, None, session, session_started)),
    ]
    for reader in readers:
        reader.start()
    assert chat_started.wait(300) and session_started.wait(300)
    busy = {rid: s for rid, s in decode_replicas().items() if s.get("num_running", 0) or s.get("num_requests", 0)}
    assert busy, "the answers run on a decode replica"
    victim_replica, victim = max(busy.items(), key=lambda kv: kv[1].get("num_requests", 0))
    node = next(n for n in cluster.list_all_nodes() if n.node_id == victim["node_id"])
    cluster.remove_node(node, allow_graceful=False)  # the raylet and every process of that node
    lost_at = time.monotonic()
    for reader in readers:
        reader.join(600)

    # What each would have had: the same requests again, with no node lost.
    reference = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": False}, timeout=600).json()
    expected = reference["choices"][0]["message"]["content"]
    again = httpx.post(sessions, json={"messages": [], **LONG}, timeout=120).json()["session_id"]
    chunk = {"sequence_id": 0, "payload": messages[0]["content"], "end_of_input": True}
    assert httpx.post(f"{sessions}/{again}/chunks", json=chunk, timeout=120).status_code == 202
    session_expected = httpx.get(f"{sessions}/{again}/result", timeout=600).json()["answer"]["text"]
    # The session goes on: a second turn on the decode replica left.
    chunk = {"sequence_id": 1, "payload": "And once more, briefly.", "end_of_input": True}
    assert httpx.post(f"{sessions}/{sid}/chunks", json=chunk, timeout=120).status_code == 202
    second = httpx.get(f"{sessions}/{sid}/result", timeout=600).json()["answer"]

    def diverges(text: str, expected: str) -> int | None:
        """Where `text` leaves the expected answer (None: it does not)."""
        if text == expected:
            return None
        pairs = enumerate(zip(text, expected, strict=False))
        return next((i for i, (a, b) in pairs if a != b), min(len(text), len(expected)))

    return {
        "lost_node_replica": victim_replica,
        "busy_replicas": sorted(busy),
        "chat_diverges_at": diverges(chat.get("text", ""), expected),
        "session_diverges_at": diverges(session.get("text", ""), session_expected),
        "session_vs_chat_diverges_at": diverges(session_expected, expected),
        "chat_equal": chat.get("text") == expected and not chat.get("errors"),
        "session_equal": session.get("text") == session_expected and not session.get("errors"),
        "answers_done_after_loss_s": round(time.monotonic() - lost_at, 1),
        "second_turn": second["status"],
        "errors": (chat.get("errors") or []) + (session.get("errors") or []),
    }


def main() -> None:
    apply_serve_env()  # as `make run` serves it, with this cluster's own HAProxy (not the test session's)
    # A head (the router, prefill) and two decode workers, each with its own resources, as `ray start` does.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"prefill_pool": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=4, resources={"decode_pool": 1})
    cluster.add_node(num_cpus=4, resources={"decode_pool": 1})
    cluster.wait_for_nodes()
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        # Eager, as every test app (`for_tests`): the resumed answer is compared token for token with an uninterrupted
        # one, as test_decode_death compares 1,200-token eager answers.
        args = for_tests(yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"][0]["args"])
        args.pop("speech", None)  # the P/D path is this test's point; a third engine only slows two cores (~90 s)
        args["prefill"]["deployment"]["ray_actor_options"] = {"num_cpus": 0.5, "resources": {"prefill_pool": 0.5}}
        # One decode replica per decode node.
        args["decode"]["deployment"]["ray_actor_options"] = {"num_cpus": 0.5, "resources": {"decode_pool": 1}}
        args["decode"]["deployment"]["num_replicas"] = 2
        # The ingress (proxy and router) on the head, as configs/config.yaml has it: the node lost is decode's.
        args["router"]["deployment"]["ray_actor_options"] = {"num_cpus": 0.1, "resources": {"prefill_pool": 0.1}}
        # Stopped at once at the end (nothing to drain or hand over here): Serve's shutdown otherwise waits out the
        # router's graceful shutdown (30 s) past its own timeout.
        args["prefill"]["drain_timeout_s"] = 1
        for role in ("router", "prefill", "decode"):
            args[role]["deployment"]["graceful_shutdown_timeout_s"] = 2
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(args), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{PORT}"
        messages = [{"role": "user", "content": "Two nodes, one machine. " * 40}]
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).json()
        prefill = serve.get_deployment_handle("prefill", APP).stats.remote().result()
        decodes = decode_replicas()
        served = [s for s in decodes.values() if s["kv_transfers"]]
        seen = {
            "answer_tokens": answer["choices"][0]["token_ids"],
            "prompt_tokens": answer["usage"]["prompt_tokens"],
            "prefill_node": prefill["node_id"],
            "decode_node": served[0]["node_id"] if served else None,
            "decode_nodes": sorted({s["node_id"] for s in decodes.values()}),
            "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
            "decode_kv_transfers": sum(s["kv_transfers"] for s in decodes.values()),
            "decode_prompt_tokens_computed": sum(s["prompt_tokens_computed_total"] for s in served),
            "block_size": next(iter(decodes.values()))["block_size"],
        }
        seen["decode_node_lost"] = lose_the_decode_node(cluster, base)
        print(json.dumps(seen))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())

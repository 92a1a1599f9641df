"""The P/D path across Ray nodes (a head and two decode workers started on this machine): NIXL between nodes;
then the node running the answers' decode replica is lost, and the answers and the session go on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration


def test_prefill_and_decode_on_different_nodes_and_a_decode_node_lost():
    # Its own Ray cluster, so its own process: the session's single-node cluster stays as it is.
    run = subprocess.run(
        [sys.executable, "-m", "tests.multinode.two_nodes"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"answer_tokens"')]
    assert lines, run.stdout[-2000:] + run.stderr[-4000:]
    seen = json.loads(lines[-1])
    assert len(seen["nodes"]) == 3 and len(seen["decode_nodes"]) == 2
    assert seen["prefill_node"] != seen["decode_node"]
    assert set(seen["nodes"]) == {seen["prefill_node"], *seen["decode_nodes"]}
    assert len(seen["answer_tokens"]) == 12
    assert seen["decode_kv_transfers"] == 1  # the KV crossed nodes over NIXL
    assert seen["prompt_tokens"] > seen["block_size"]
    assert seen["decode_prompt_tokens_computed"] <= seen["block_size"]
    lost = seen["decode_node_lost"]  # both answers resumed on the other node's decode replica, token for token
    assert lost["chat_equal"] and lost["session_equal"] and not lost["errors"], json.dumps(lost)
    assert lost["second_turn"] == "completed", lost

"""Two Ray nodes on this machine, prefill on one and decode on the other, the P/D path with NIXL between them.

Run as a script (it owns its Ray cluster); prints one JSON line with what it saw. tests/multinode/ runs it.
"""

from __future__ import annotations

import json
import sys

import httpx
import yaml
from ray import serve
from ray.cluster_utils import Cluster

from serve_app.builder import build_app
from tests.integration.conftest import ROOT

PORT = 8766


def main() -> None:
    # A head and a worker, each with its own resources, as `ray start --head` / `ray start --address` do.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"prefill_pool": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=4, resources={"decode_pool": 1})
    cluster.wait_for_nodes()
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        args = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"][0]["args"]
        args["prefill"]["deployment"]["ray_actor_options"] = {"num_cpus": 0.5, "resources": {"prefill_pool": 0.5}}
        args["decode"]["deployment"]["ray_actor_options"] = {"num_cpus": 0.5, "resources": {"decode_pool": 0.5}}
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(args), name="realtime-pd", route_prefix="/")
        base = f"http://127.0.0.1:{PORT}"
        messages = [{"role": "user", "content": "Two nodes, one machine. " * 40}]
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).json()
        prefill = serve.get_deployment_handle("prefill", "realtime-pd").stats.remote().result()
        decode = serve.get_deployment_handle("decode", "realtime-pd").stats.remote().result()
        print(
            json.dumps(
                {
                    "answer_tokens": answer["choices"][0]["token_ids"],
                    "prompt_tokens": answer["usage"]["prompt_tokens"],
                    "prefill_node": prefill["node_id"],
                    "decode_node": decode["node_id"],
                    "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
                    "decode_kv_transfers": decode["kv_transfers"],
                    "decode_prompt_tokens_computed": decode["prompt_tokens_computed_total"],
                    "block_size": decode["block_size"],
                }
            )
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())

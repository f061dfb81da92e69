"""Run by test_ray_multi_node.py in its own process (Ray allows one cluster per process):
connect to the cluster at argv[1], generate with TP=2 on the model at argv[2], and print one
JSON line with each worker's node and the generated tokens."""

from __future__ import annotations

import json
import sys
import time

import ray

from shoal import LLM, SamplingParams


def wait_for_nodes(count: int, timeout_s: float = 90.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        if len(alive) >= count or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def worker_node_id(worker: object) -> str:
    return ray.get_runtime_context().get_node_id()


def main(address: str, model: str, prompt: list[int], max_tokens: int) -> None:
    ray.init(address=address, logging_level="WARNING")
    cluster_nodes = wait_for_nodes(2)
    llm = LLM(model, tensor_parallel_size=2, multiprocess=False, ray_address=address)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    result = {
        "cluster_nodes": cluster_nodes,
        "worker_nodes": llm.collective_rpc(worker_node_id),
        "driver_node": ray.get_runtime_context().get_node_id(),
        "token_ids": outputs[0].outputs[0].token_ids,
    }
    llm.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))

"""A Ray job that generates with shoal on the cluster it runs in (see submit_job.sh).

    python cluster/generate_job.py --model /models/Llama-3.1-70B-Instruct \
        --tensor-parallel-size 8 --pipeline-parallel-size 2 "The capital of France is"

Inside a Ray job RAY_ADDRESS names the cluster, so the engine joins it; run by hand on a node of
a cluster it does the same, and on a machine without one it starts a local Ray.
"""

from __future__ import annotations

import argparse

from shoal import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", default=["The capital of France is", "Ray clusters are"])
    parser.add_argument("--model", required=True, help="a Hugging Face folder present on every node")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend="ray",
    )
    outputs = llm.generate(args.prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()

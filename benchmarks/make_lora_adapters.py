"""Write N random LoRA adapters (PEFT layout, every projection, one rank) for a model, so that
shoal and vLLM benchmark the same files:

    python benchmarks/make_lora_adapters.py --model benchmarks/configs/llama-3.1-8b --num 8 --rank 16 --out /tmp/loras
    shoal bench throughput --model ... --num-loras 8 --lora-dir /tmp/loras --max-loras 8 --max-lora-rank 16
    vllm bench throughput --model ... --enable-lora --max-loras 8 --max-lora-rank 16 --lora-path /tmp/loras/adapter_0

(`shoal bench throughput --num-loras N` writes them itself when --lora-dir has none.)
"""

from __future__ import annotations

import argparse

from shoal.config import load_hf_config
from shoal.lora.random_adapters import write_random_adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the base model's folder (its config.json)")
    parser.add_argument("--num", type=int, default=8, help="adapters to write")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True, help="adapters go to OUT/adapter_{i}")
    args = parser.parse_args()
    folders = write_random_adapters(load_hf_config(args.model), args.out, args.num, args.rank, args.dtype, args.model)
    print("\n".join(str(f) for f in folders))


if __name__ == "__main__":
    main()

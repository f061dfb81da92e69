"""The train/inference mismatch of sampled tokens' logprobs: shoal samples completions (with
their logprobs), transformers scores the same sequences, and the script prints the max and mean
|shoal - transformers| over every sampled token (docs/rl.md, "Logprob fidelity").

    python benchmarks/logprob_fidelity.py                      # the demo model, fp32 on CPU
    python benchmarks/logprob_fidelity.py --model PATH --dtype bfloat16 --device cuda

Both sides compute in `--dtype`; transformers runs each sequence alone with eager attention.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.demo_model import ensure_demo_model

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "The derivative of x squared is",
    "Translate 'good morning' into Spanish:",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs-mode", default="raw_logprobs")
    args = parser.parse_args()
    model = args.model or ensure_demo_model()

    llm = LLM(model, dtype=args.dtype, device=args.device, logprobs_mode=args.logprobs_mode, multiprocess=False)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, logprobs=0) for i in range(len(PROMPTS))
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()

    reference = AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, args.dtype), attn_implementation="eager", trust_remote_code=False
    ).to(args.device)
    deltas = []
    with torch.no_grad():
        for out in outputs:
            completion = out.outputs[0]
            sequence = torch.tensor([out.prompt_token_ids + completion.token_ids], device=args.device)
            logprobs = reference(sequence).logits[0].float().log_softmax(-1)  # row p predicts token p + 1
            start = len(out.prompt_token_ids) - 1
            for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
                deltas.append(abs(position[token].logprob - float(logprobs[start + j, token])))
    result = {
        "model": model,
        "dtype": args.dtype,
        "device": args.device,
        "tokens": len(deltas),
        "max_abs_delta": max(deltas),
        "mean_abs_delta": sum(deltas) / len(deltas),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

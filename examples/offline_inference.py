"""Offline batched generation with the demo model (or any Hugging Face folder).

python examples/offline_inference.py [MODEL_DIR]
"""

import sys

from shoal import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "The three primary colors are",
    "def fibonacci(n):",
]


def main() -> None:
    # The engine core starts in its own process, so the LLM is created under the main guard.
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None)
    for output in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32)):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")

    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    reply = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    print(f"chat -> {reply[0].outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()

"""Sampling options: seeds, top-k/top-p/min-p, penalties, n > 1, logprobs and stop strings."""

from shoal import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.95, top_k=50, seed=7, max_tokens=40, logprobs=2, stop=["\n\n"]
    )
    (output,) = llm.generate("Write a haiku about the sea:", params)
    for completion in output.outputs:
        print(f"[{completion.index}] {completion.text!r} ({completion.finish_reason})")
        first = completion.logprobs[0] if completion.logprobs else {}
        print("   first-token logprobs:", {t: round(lp.logprob, 3) for t, lp in first.items()})
    llm.shutdown()


if __name__ == "__main__":
    main()

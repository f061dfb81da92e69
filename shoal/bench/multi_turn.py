"""`shoal bench serve --multi-turn`: chat sessions that reuse their own prefixes, the workload a
prefix cache and a cache-aware router are for.

Every session starts from one system prompt shared by all (`--system-prompt-len` random token
ids) and a user message (`--user-len`); each turn's prompt is the previous prompt, the answer the
server gave (`--output-len` tokens, its token ids read back with `return_token_ids`) and a new
user message. All sessions run at once, their turns one after another, at most
`--max-concurrency` requests in flight over all sessions. Reported: the prefix-cache hit rate
over the run (the server's `shoal:prefix_cache_hits` / `queries`, summed over replicas), time
to first token (mean, p50, p90, p99), and throughput. `--session-header` sends each session's
id (X-Session-Id) for routers that pin sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from shoal.bench.report import environment, summarize


def add_args(parser: Any) -> None:
    group = parser.add_argument_group("multi-turn chat (--multi-turn)")
    group.add_argument(
        "--multi-turn", action="store_true", help="run chat sessions with a shared system prompt and growing turns"
    )
    group.add_argument("--num-sessions", type=int, default=32, help="chat sessions, all running at once")
    group.add_argument("--num-turns", type=int, default=4, help="turns per session")
    group.add_argument(
        "--system-prompt-len", type=int, default=256, help="tokens of the system prompt every session shares"
    )
    group.add_argument("--user-len", type=int, default=32, help="tokens of each user message")
    group.add_argument(
        "--session-header", action="store_true", help="send X-Session-Id with each session's id (routers pin on it)"
    )


@dataclass
class TurnRecord:
    session: int
    turn: int
    prompt_len: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    num_output_tokens: int = 0


def token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Above the first ids, which are special tokens in most vocabularies.
    return [rng.randrange(10, vocab_size) for _ in range(n)]


async def one_turn(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str], record: TurnRecord
) -> list[int]:
    """One streamed completion; returns the answer's token ids."""
    start = time.perf_counter()
    answer: list[int] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return answer
            async for line in response.aiter_lines():
                data = line[len("data:") :].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                for choice in json.loads(data).get("choices") or []:
                    new = choice.get("token_ids") or []
                    if new and record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    answer += new
    except Exception as exc:  # a transport error fails this turn (and its session) only
        record.error = f"{type(exc).__name__}: {exc}"
        return answer
    record.latency_s = time.perf_counter() - start
    record.num_output_tokens = len(answer)
    record.ok = record.ttft_s is not None
    return answer


async def run_sessions(
    args: argparse.Namespace, url: str, model: str, vocab_size: int
) -> tuple[list[TurnRecord], float]:
    import httpx

    rng = random.Random(args.workload_seed)
    system = token_ids(rng, args.system_prompt_len, vocab_size)
    users = [
        [token_ids(rng, args.user_len, vocab_size) for _ in range(args.num_turns)] for _ in range(args.num_sessions)
    ]
    gate = asyncio.Semaphore(args.max_concurrency or args.num_sessions)
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    records: list[TurnRecord] = []

    async def session(i: int, client: Any) -> None:
        headers = {**auth, **({"X-Session-Id": f"session-{i}"} if args.session_header else {})}
        prompt = system + users[i][0]
        for turn in range(args.num_turns):
            record = TurnRecord(i, turn, len(prompt))
            records.append(record)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with gate:
                answer = await one_turn(client, url, body, headers, record)
            if not record.ok or turn + 1 == args.num_turns:
                return
            prompt = prompt + answer + users[i][turn + 1]

    limits = httpx.Limits(max_connections=args.num_sessions, max_keepalive_connections=args.num_sessions)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(session(i, client) for i in range(args.num_sessions)))
        return records, time.perf_counter() - start


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """(queries, hits) in prompt tokens, summed over every series (every replica behind a router)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text

    def total(name: str) -> float:
        pattern = re.compile(rf"^shoal:{name}_total[{{ ]")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if pattern.match(line))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def run(args: argparse.Namespace, url: str, model: str, vocab_size: int) -> dict[str, Any]:
    for name in ("num_sessions", "num_turns", "system_prompt_len", "user_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    queries_before, hits_before = prefix_cache_counters(url)
    records, duration_s = asyncio.run(run_sessions(args, url, model, vocab_size))
    queries, hits = prefix_cache_counters(url)
    done = [r for r in records if r.ok]
    num_queries = queries - queries_before
    later = [r for r in done if r.turn > 0]
    return {
        "benchmark": "serve-multi-turn",
        "environment": environment(),
        "base_url": url,
        "model": model,
        "workload": {
            "num_sessions": args.num_sessions,
            "num_turns": args.num_turns,
            "system_prompt_len": args.system_prompt_len,
            "user_len": args.user_len,
            "output_len": args.output_len,
            "max_concurrency": args.max_concurrency,
            "session_header": args.session_header,
            "seed": args.workload_seed,
        },
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "prefix_cache_hit_rate": (hits - hits_before) / num_queries if num_queries else None,
        "prefix_cache_queries": num_queries,
        "prefix_cache_hits": hits - hits_before,
        "ttft_ms": summarize([r.ttft_s for r in done if r.ttft_s is not None], 1e3),
        "ttft_later_turns_ms": summarize([r.ttft_s for r in later if r.ttft_s is not None], 1e3),
        "latency_ms": summarize([r.latency_s for r in done if r.latency_s is not None], 1e3),
        "requests_per_s": len(done) / duration_s,
        "output_tokens_per_s": sum(r.num_output_tokens for r in done) / duration_s,
        "mean_prompt_len": sum(r.prompt_len for r in done) / max(len(done), 1),
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    rate = report["prefix_cache_hit_rate"]
    ttft, later = report["ttft_ms"], report["ttft_later_turns_ms"]
    workload = report["workload"]
    return [
        f"multi-turn: {workload['num_sessions']} sessions x {workload['num_turns']} turns, system prompt "
        f"{workload['system_prompt_len']}, user {workload['user_len']}, output {workload['output_len']} tokens",
        f"requests: {report['completed']} ok, {report['failed']} failed in {report['duration_s']:.1f} s "
        f"({report['requests_per_s']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tok/s)",
        f"prefix-cache hit rate: {'n/a' if rate is None else f'{100 * rate:.1f} %'} "
        f"({report['prefix_cache_hits']:.0f} of {report['prefix_cache_queries']:.0f} prompt tokens)",
        f"TTFT ms: mean {ttft['mean']:.1f}, p50 {ttft['p50']:.1f}, p90 {ttft['p90']:.1f}, p99 {ttft['p99']:.1f}; "
        f"turns after the first: mean {later['mean']:.1f}, p50 {later['p50']:.1f}",
    ]

"""`shoal serve --num-replicas 2 --routing-policy cache_aware` on the tiny model: a conversation's
later turns go to the replica that cached its earlier ones (known from that replica's KV-cache
events), a session header pins, the greedy tokens are the offline engine's, and a replica killed
mid-run is routed around with the same answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shoal import LLM, SamplingParams
from shoal.routing.replicas import free_port

ENGINE_FLAGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(8 * 1024**2), "--block-size", "8"]
MAX_TOKENS = 4
SYSTEM = list(range(40, 64))  # three blocks


def system_prompt(session: int) -> list[int]:
    """Each conversation's own: a prompt every replica could take from its cache would send
    every new conversation to the first replica while the requests come one at a time."""
    return [t + 7 * session for t in SYSTEM]


def turn_tokens(session: int, turn: int) -> list[int]:
    return [(100 + 37 * session + 11 * turn + i) % 370 + 3 for i in range(12)]


@pytest.fixture(scope="module")
def routed(tiny_checkpoints: dict, tmp_path_factory: pytest.TempPathFactory):
    model = str(tiny_checkpoints["llama"])
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    argv = [sys.executable, "-m", "shoal", "serve", model, "--num-replicas", "2", "--routing-policy", "cache_aware"]
    argv += ["--port", str(port), "--disable-access-log", *ENGINE_FLAGS]
    env = {**os.environ, "SHOAL_CPU_THREADS": "1"}
    with open(log, "wb") as out:
        router = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert router.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url, model, router
    finally:
        router.send_signal(signal.SIGINT)
        try:
            router.wait(timeout=60)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def complete(url: str, model: str, prompt: list[int], session: str | None = None) -> tuple[list[int], str]:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"], answer.headers["x-shoal-replica"]


def replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/router/replicas", timeout=10).json()


def offline(model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model, multiprocess=False, max_model_len=256, block_size=8)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_conversations_follow_their_cache_with_greedy_outputs_unchanged(routed) -> None:
    url, model, _ = routed
    prompts = {s: system_prompt(s) + turn_tokens(s, 0) for s in range(4)}
    seen: dict[int, list[str]] = {s: [] for s in prompts}
    asked, answered = [], []
    for turn in range(3):
        for session, prompt in prompts.items():
            tokens, replica = complete(url, model, prompt)
            asked.append(prompt)
            answered.append(tokens)
            seen[session].append(replica)
            prompts[session] = prompt + tokens + turn_tokens(session, turn + 1)
        time.sleep(0.2)  # the steps' events reach the router
    assert all(len(set(r)) == 1 for r in seen.values()), seen  # each conversation stays with its cache
    assert len({r[0] for r in seen.values()}) == 2  # new conversations (no cache anywhere) spread
    assert answered == offline(model, asked)
    hits = httpx.get(f"{url}/metrics", timeout=10).text
    total = sum(
        float(line.rsplit(" ", 1)[1]) for line in hits.splitlines() if line.startswith("shoal:prefix_cache_hits_total")
    )
    assert total >= 8 * (len(SYSTEM) + 8)  # later turns hit (nearly) their whole earlier prompt
    view = replicas(url)
    assert all(r["num_cached_blocks"] > 0 and r["alive"] and r["num_requests"] == 0 for r in view), view


def test_multi_turn_bench_reports_the_routers_hits(routed) -> None:
    """`shoal bench serve --multi-turn` through the router: every turn answered, the hit rate
    read from the replicas' counters (turns after the first hit their earlier prompt)."""
    from shoal.bench import multi_turn
    from shoal.cli import make_parser

    url, model, _ = routed
    argv = ["bench", "serve", "--base-url", url, "--multi-turn", "--num-sessions", "4", "--num-turns", "3"]
    argv += ["--system-prompt-len", "16", "--user-len", "8", "--output-len", "4", "--max-concurrency", "2"]
    args = make_parser().parse_args(argv)
    report = multi_turn.run(args, url, model, vocab_size=380)
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["prefix_cache_queries"] == sum(4 * (16 + 8 + 12 * t) for t in range(3))
    assert 0.5 < report["prefix_cache_hit_rate"] < 1.0
    assert report["ttft_ms"]["mean"] > 0 and len(multi_turn.report_lines(report)) == 4


def test_a_session_header_pins_and_a_dead_replica_is_skipped(routed) -> None:
    url, model, _ = routed
    prompt = SYSTEM + turn_tokens(9, 0)
    before, replica = complete(url, model, prompt, session="conversation-9")
    unrelated = list(range(300, 340))
    assert {complete(url, model, [*unrelated, i], session="conversation-9")[1] for i in range(3)} == {replica}
    victim = next(r for r in replicas(url) if r["name"] == replica)
    os.killpg(victim["pid"], signal.SIGKILL)  # the replica and its engine core, as a lost machine
    for _ in range(3):  # the session moves to the live replica, the answer stays the same
        tokens, now = complete(url, model, prompt, session="conversation-9")
        assert now != replica and tokens == before
    view = {r["name"]: r for r in replicas(url)}
    assert not view[replica]["alive"] and view[replica]["num_cached_blocks"] == 0
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30)  # the replica's 400
    assert bad.status_code == 400 and "error" in bad.json()
    last = next(r for r in view.values() if r["name"] != replica)
    os.killpg(last["pid"], signal.SIGKILL)
    gone = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=30)
    assert gone.status_code == 503 and gone.json()["error"]["message"] == "no replica is available"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503

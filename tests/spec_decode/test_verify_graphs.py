"""Verification steps laid out for CUDA graphs (shoal/workers/verify_graphs.py): the padding
(placeholder drafts, padding requests, logits rows) checked directly, and the engine on CPU with
the graphs emulated (`EagerVerifyRunner`: replay runs the model on the padded buffers), whose
greedy output with speculation equals greedy output without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal import LLM, SamplingParams
from shoal.forward_context import set_forward_context
from shoal.spec_decode.draft_layout import DraftLayout
from shoal.workers.verify_graphs import pad_verification, verification_capture_sizes, verification_graph_size
from tests.spec_decode.verify_emulation import emulate_verify_graphs

BLOCK = 4


def step_arrays(num_scheduled: list[int], seq_lens: list[int], block_table: np.ndarray) -> dict[str, np.ndarray]:
    """An eager step's flat arrays, as the runner gathers them (token ids 100 + row)."""
    n, lens = np.array(num_scheduled), np.array(seq_lens)
    positions = np.concatenate([np.arange(s - k, s) for k, s in zip(n, lens)])
    req = np.repeat(np.arange(len(n)), n)
    slots = block_table[req, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    return {
        "input_ids": 100 + np.arange(int(n.sum())),
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": np.concatenate([[0], np.cumsum(n)]),
        "seq_lens": lens,
        "block_tables": block_table[:, : -(-int(lens.max()) // BLOCK)],
    }


def test_a_verification_pads_drafts_with_placeholders_and_the_batch_with_padding_requests() -> None:
    # k = 3 (q = 4): request 0 has 3 drafts, request 1 one, request 2 none; batch padded to 4.
    num_scheduled, seq_lens = [4, 2, 1], [10, 7, 5]
    block_table = np.array([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], dtype=np.int32)
    arrays = step_arrays(num_scheduled, seq_lens, block_table)
    p = pad_verification(arrays, np.array(num_scheduled), np.array(seq_lens), block_table, BLOCK, 4, 4)
    a = p.arrays
    assert p.token_rows.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert p.query_ends.tolist() == [4, 6, 9]
    assert a["query_start_loc"].tolist() == [0, 4, 8, 12, 16]
    # Real tokens keep their ids, positions and slots; placeholders follow them, written nowhere.
    assert a["input_ids"].tolist() == [100, 101, 102, 103, 104, 105, 0, 0, 106, 0, 0, 0, 0, 0, 0, 0]
    assert a["positions"].tolist() == [6, 7, 8, 9, 5, 6, 7, 8, 4, 5, 6, 7, 1, 2, 3, 4]
    assert a["slot_mapping"][p.token_rows].tolist() == arrays["slot_mapping"].tolist()
    assert (np.delete(a["slot_mapping"], p.token_rows) == -1).all()
    # Contexts count the placeholders (the real rows keep their positions); padding: one cached
    # token, then q (no fresh prompt).
    assert a["seq_lens"].tolist() == [10, 9, 8, 5]
    assert (a["seq_lens"] - 4 == a["positions"][::4]).all()
    # Block tables reach the padded contexts' blocks; the padding request's are block 0.
    assert a["block_tables"].tolist() == [[5, 6, 7], [9, 10, 11], [13, 14, 15], [0, 0, 0]]
    assert a["query_start_loc"][-1] == len(a["input_ids"]) == len(a["positions"]) == len(a["slot_mapping"])
    assert sorted(a["decode_order"].tolist()) == [0, 1, 2, 3]


def test_logits_rows_of_a_padded_verification_are_the_real_rows() -> None:
    num_scheduled = np.array([4, 2, 1])
    p = pad_verification(
        step_arrays([4, 2, 1], [10, 7, 5], np.zeros((3, 4), dtype=np.int32)),
        num_scheduled,
        np.array([10, 7, 5]),
        np.zeros((3, 4), dtype=np.int32),
        BLOCK,
        4,
        4,
    )
    layout = DraftLayout.of(num_scheduled - 1)
    # The runner's logits index of each request's last real token, + 1: its query end.
    rows = layout.logits_indices(p.query_ends)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert (rows == p.token_rows).all()  # every real token of a verification has a logits row


def test_which_steps_replay_a_verification_graph() -> None:
    sizes = verification_capture_sizes(8, disable_by_batch_size=4, query_len=3, max_num_tokens=64)
    assert sizes == [1, 2, 4]
    assert verification_capture_sizes(256, None, 5, 512)[-1] == 102  # the step buffers' rows

    def size(num_scheduled: list[int], num_known: list[int], seq_lens: list[int], max_len: int = 100) -> int | None:
        return verification_graph_size(
            np.array(num_scheduled), np.array(num_known), np.array(seq_lens), 3, sizes, max_len
        )

    assert size([3, 2, 1], [1, 1, 1], [10, 10, 10]) == 4
    assert size([3], [1], [10]) == 1
    assert size([1, 1], [1, 1], [10, 10]) is None  # no drafts: a decode graph's step
    assert size([3, 5], [1, 3], [10, 10]) is None  # a prefill chunk
    assert size([3, 2, 2, 2, 2], [1] * 5, [10] * 5) is None  # past the captured sizes
    assert size([2], [1], [100], max_len=100) is None  # the placeholder would pass max_model_len
    assert size([2], [1], [99], max_len=100) == 1


ENGINE: dict[str, Any] = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=8, multiprocess=False)
TEXTS = [
    "one two three four five six seven eight nine ten one two three four five six seven eight",
    "The quick brown fox",
    "Hello world! This is",
    "the dog and the fox and the dog and the fox and the",
]
# Different lengths: the batch shrinks as requests finish, and a request near max_tokens drafts fewer.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(len(TEXTS))]


@pytest.fixture(scope="module")
def target(tiny_checkpoints: dict) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def expected(target: str) -> tuple[list[dict], list[list[int]]]:
    plain = LLM(target, **ENGINE)
    tokenizer = plain.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in TEXTS]
    return prompts, [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_greedy_output_with_emulated_verification_graphs_equals_plain_greedy(
    method: str, target: str, eagle_head: Path, eagle3_head: Path, expected: tuple[list[dict], list[list[int]]]
) -> None:
    prompts, tokens = expected
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model":
        config["model"] = target
    else:
        config.update(model=str(eagle_head if method == "eagle" else eagle3_head), num_speculative_tokens=2)
    llm = LLM(target, speculative_config=config, **ENGINE)
    runner = llm.engine_core.core.executor.worker.model_runner
    assert runner.verify_graphs is None  # no capture on the CPU
    graphs = emulate_verify_graphs(runner)
    captured = runner._verify_graph_runner()  # what a GPU would capture
    assert captured is not None and (captured.sizes, captured.query_len) == (graphs.sizes, graphs.query_len)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == tokens
    assert graphs.num_replays > 0
    # Requests with fewer than k drafts (placeholders), full ones, and padding requests replayed.
    assert {0, 1 + config["num_speculative_tokens"]} < graphs.real_rows
    assert llm.get_stats()["spec_decode_num_drafts"] > 0
    runner.drop_cuda_graphs()  # (sleep, where the addresses move): recaptured on wake-up
    assert runner.verify_graphs is None


def test_mla_models_verify_eagerly(deepseek_mtp: Path) -> None:
    """MLA attention over several query tokens loops over the requests on the host: no graphs."""
    llm = LLM(str(deepseek_mtp), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    runner = llm.engine_core.core.executor.worker.model_runner
    assert runner._verify_graph_runner() is None


def test_what_a_verification_graph_captures_is_a_consistent_batch(target: str) -> None:
    """The batch each graph is captured on (padding requests only): its metadata's host arrays
    agree with the buffers the graph reads, and the model runs on it with finite outputs."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(target, speculative_config=config, **ENGINE)
    graphs = llm.engine_core.core.executor.worker.model_runner._verify_graph_runner()
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]  # 24 token rows: 6 requests of 4
    for size in graphs.sizes:
        graphs._load_padding_only(size)
        md = graphs.metadata(size)
        assert md.query_start_loc.tolist() == md.query_start_loc_cpu.tolist()
        assert md.seq_lens.tolist() == md.seq_lens_cpu.tolist()
        assert (md.slot_mapping == -1).all()
        with set_forward_context(md):
            hidden_states = graphs._forward(size)
        assert hidden_states.shape[0] == size * 4 and hidden_states.isfinite().all()

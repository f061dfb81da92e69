"""shoal's models against Hugging Face transformers on the same tiny random checkpoints."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal.config import ParallelConfig
from tests.checkpoints import KINDS
from tests.layers.tp_utils import fake_pp_group
from tests.models.model_utils import PagedRunner, hf_logits, load_shoal

# float32 on both sides; differences come only from the order of floating-point operations.
ATOL = 1e-4


def _sequences(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_batch_matches_hf(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    model = load_shoal(path)
    sequences = _sequences(model.config.vocab_size, [5, 11, 17])
    runner = PagedRunner(model, [len(s) for s in sequences], block_size=4)
    logits = runner.step(sequences, [(0, len(s)) for s in sequences])
    for ours, expected in zip(logits, hf_logits(path, sequences)):
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_and_decode_match_hf(tiny_checkpoints, kind):
    """A: a 13-token prompt in two chunks, then one decode; B: a 6-token prompt, then decodes,
    batched with A's chunks (so prefill with a cached context and decode share each step)."""
    path = tiny_checkpoints[kind]
    model = load_shoal(path)
    a, b = _sequences(model.config.vocab_size, [14, 8], seed=1)
    runner = PagedRunner(model, [len(a), len(b)], block_size=16 if kind == "qwen3" else 4)
    steps = [[(0, 5), (0, 6)], [(5, 13), (6, 7)], [(13, 14), (7, 8)]]
    ours = [runner.step([a, b], chunks) for chunks in steps]
    expected_a, expected_b = hf_logits(path, [a, b])
    for step, chunks in zip(ours, steps):
        (sa, ea), (sb, eb) = chunks
        torch.testing.assert_close(step[0], expected_a[sa:ea], rtol=0, atol=ATOL)
        torch.testing.assert_close(step[1], expected_b[sb:eb], rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_pipeline_stages_match_one(tiny_checkpoints, kind):
    """Stage 0 holds the embedding and layer 0, stage 1 layers 1-2, norm and head (a tied head
    loads its own copy of the embedding); run back to back they equal the whole model."""
    path = tiny_checkpoints[kind]
    parallel_config = ParallelConfig(pipeline_parallel_size=2, pipeline_layer_partition=(1, 2))
    stages = []
    for rank in range(2):
        with fake_pp_group(rank, 2):
            stages.append(load_shoal(path, parallel_config=parallel_config))
    assert list(stages[0].model.layers) == ["0"] and list(stages[1].model.layers) == ["1", "2"]
    assert not hasattr(stages[0], "lm_head") and not hasattr(stages[1].model, "embed_tokens")
    sequences = _sequences(stages[0].config.vocab_size, [6, 9])
    runner = PagedRunner(stages, [len(s) for s in sequences])
    logits = runner.step(sequences, [(0, len(s)) for s in sequences])
    for ours, expected in zip(logits, hf_logits(path, sequences)):
        torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)


def test_greedy_outputs_are_not_degenerate(tiny_checkpoints):
    """The checkpoints' large init std gives varied greedy tokens (a random model still falls
    into a loop on the odd prompt), so engine tests can tell right outputs from wrong ones."""
    for kind in KINDS:
        model = load_shoal(tiny_checkpoints[kind])
        distinct = [len(set(_greedy(model, prompt, 20))) for prompt in _sequences(model.config.vocab_size, [4] * 4)]
        assert sorted(distinct)[1] >= 5, (kind, distinct)


def _greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    runner = PagedRunner(model, [len(prompt) + max_tokens])
    logits = runner.step([seq], [(0, len(seq))])[0]
    while len(seq) < len(prompt) + max_tokens:
        seq.append(int(logits[-1].argmax()))
        logits = runner.step([seq], [(len(seq) - 1, len(seq))])[0]
    return seq[len(prompt) :]


def test_dummy_weights_from_config_only(tiny_checkpoints, tmp_path):
    shutil.copy(tiny_checkpoints["qwen3"] / "config.json", tmp_path / "config.json")
    model = load_shoal(tmp_path, load_format="dummy")
    params = dict(model.named_parameters())
    assert all(p.abs().max() <= 1e-3 for p in params.values())
    again = load_shoal(tmp_path, load_format="dummy")
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())  # seeded
    logits = PagedRunner(model, [7]).step([[1, 2, 3, 4, 5, 6, 7]], [(0, 7)])[0]
    assert logits.shape == (7, model.config.vocab_size) and torch.isfinite(logits).all()


def test_auto_format_without_weights_fails_clearly(tiny_checkpoints, tmp_path):
    shutil.copy(tiny_checkpoints["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_shoal(tmp_path)


def test_missing_weights_are_named(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["llama"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape("model.layers.1.mlp.down_proj.weight")):
        load_shoal(tmp_path)


def test_sharded_checkpoint_with_index(tiny_checkpoints, tmp_path):
    """Only the files the index names are read (a stray consolidated file is ignored)."""
    source = tiny_checkpoints["llama"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    save_file({"junk": torch.zeros(1)}, tmp_path / "consolidated.safetensors")
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_shoal(tmp_path)
    assert torch.equal(model.model.layers["0"].mlp.down_proj.weight, tensors["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bfloat16_is_as_accurate_as_hf_bfloat16(tiny_checkpoints, kind):
    """In bfloat16 the logits move by ~0.1-0.3 from float32 on these checkpoints, in shoal as in
    transformers; shoal's error must stay within twice transformers' own."""
    path = tiny_checkpoints[kind]
    sequences = _sequences(384, [9, 4])
    model = load_shoal(path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    ours = PagedRunner(model, [9, 4]).step(sequences, [(0, 9), (0, 4)])
    exact, hf_low = hf_logits(path, sequences), hf_logits(path, sequences, torch.bfloat16)
    for low, reference, hf in zip(ours, exact, hf_low):
        assert low.dtype == torch.bfloat16
        hf_error = (hf.float() - reference).abs().max()
        assert (low.float() - reference).abs().max() <= 2 * hf_error

"""Mixtral, Qwen2-MoE and Qwen3-MoE against Hugging Face transformers on tiny random checkpoints
(tests/checkpoints.py MOE_KINDS): logits of a batched prefill and of chunked prefill with
decodes; both checkpoint layouts of the experts; each rank's shard under tensor and expert
parallelism; dummy weights from a config alone."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal.distributed import parallel_state
from shoal.layers.moe import FusedMoE, SparseMoeBlock
from shoal.models.llama import LlamaMLP
from tests.checkpoints import MOE_KINDS
from tests.layers.tp_utils import fake_tp_group
from tests.models.model_utils import PagedRunner, hf_logits, load_shoal

ATOL = 1e-4


def _sequences(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_prefill_then_chunks_and_decodes_match_hf(moe_checkpoints, kind):
    """A batched prefill of three prompts; then A in two chunks and a decode beside B's decodes."""
    path = moe_checkpoints[kind]
    model = load_shoal(path)
    sequences = _sequences(model.config.vocab_size, [5, 11, 17])
    a, b = _sequences(model.config.vocab_size, [14, 8], seed=1)
    *expected, expected_a, expected_b = hf_logits(path, [*sequences, a, b])
    logits = PagedRunner(model, [len(s) for s in sequences]).step(sequences, [(0, len(s)) for s in sequences])
    for ours, theirs in zip(logits, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    runner = PagedRunner(load_shoal(path), [len(a), len(b)])
    for chunks in [[(0, 5), (0, 6)], [(5, 13), (6, 7)], [(13, 14), (7, 8)]]:
        ours = runner.step([a, b], chunks)
        (sa, ea), (sb, eb) = chunks
        torch.testing.assert_close(ours[0], expected_a[sa:ea], rtol=0, atol=ATOL)
        torch.testing.assert_close(ours[1], expected_b[sb:eb], rtol=0, atol=ATOL)


def test_layers_have_the_mlps_of_their_config(moe_checkpoints):
    qwen2 = load_shoal(moe_checkpoints["qwen2_moe"]).model.layers
    assert isinstance(qwen2["1"].mlp, LlamaMLP)  # mlp_only_layers=[1]
    assert all(isinstance(qwen2[i].mlp, SparseMoeBlock) for i in ("0", "2"))
    assert qwen2["0"].mlp.shared_expert is not None and qwen2["0"].mlp.gate.routing.renormalize is False
    mixtral = load_shoal(moe_checkpoints["mixtral"]).model.layers["0"].mlp
    assert mixtral.experts.w13_weight.shape == (8, 2 * 64, 64) and mixtral.gate.routing.renormalize
    assert load_shoal(moe_checkpoints["qwen3_moe"]).model.layers["2"].mlp.gate.routing.renormalize


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_the_other_expert_layout_loads_the_same_model(moe_checkpoints, tmp_path, kind):
    """mixtral is saved per expert (block_sparse_moe.experts.{e}.w1/w3/w2), qwen3_moe stacked
    (mlp.experts.gate_up_proj/down_proj): rewrite each in the other layout."""
    source = moe_checkpoints[kind]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    tensors = load_file(source / "model.safetensors")
    save_file(_restacked(tensors) if kind == "mixtral" else _per_expert(tensors), tmp_path / "model.safetensors")
    original, rewritten = load_shoal(source), load_shoal(tmp_path)
    for (name, a), (_, b) in zip(original.named_parameters(), rewritten.named_parameters()):
        assert torch.equal(a, b), name


def _restacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral per-expert tensors -> transformers 5's stacked names under `mlp`."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".block_sparse_moe.experts." in name:
            prefix, rest = name.split(".block_sparse_moe.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(prefix, {})[(int(e), proj)] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for prefix, by_expert in experts.items():
        n = 1 + max(e for e, _ in by_expert)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[(e, "w1")], by_expert[(e, "w3")]]) for e in range(n)]
        )
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([by_expert[(e, "w2")] for e in range(n)])
    return out


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors -> the published per-expert names."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, stacked in enumerate(t):
                gate, up = stacked.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, down in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = down.clone()
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_expert_shards(moe_checkpoints, rank, expert_parallel):
    path = moe_checkpoints["qwen2_moe"]
    hf = load_file(path / "model.safetensors")
    parallel_state.set_expert_parallel(expert_parallel)
    try:
        with fake_tp_group(rank):
            model = load_shoal(path)
    finally:
        parallel_state.set_expert_parallel(False)
    block = model.model.layers["0"].mlp
    p = "model.layers.0.mlp."
    experts = range(4 * rank, 4 * rank + 4) if expert_parallel else range(8)
    rows = slice(None) if expert_parallel else slice(16 * rank, 16 * rank + 16)
    gate = torch.stack([hf[f"{p}experts.{e}.gate_proj.weight"][rows] for e in experts])
    up = torch.stack([hf[f"{p}experts.{e}.up_proj.weight"][rows] for e in experts])
    down = torch.stack([hf[f"{p}experts.{e}.down_proj.weight"][:, rows] for e in experts])
    assert torch.equal(block.experts.w13_weight, torch.cat([gate, up], dim=1))
    assert torch.equal(block.experts.w2_weight, down)
    assert torch.equal(block.gate.weight, hf[f"{p}gate.weight"])  # the router is whole on every rank
    # The shared expert stays tensor-parallel in both modes.
    shared_rows = slice(32 * rank, 32 * rank + 32)
    shared = block.shared_expert
    assert torch.equal(shared.down_proj.weight, hf[f"{p}shared_expert.down_proj.weight"][:, shared_rows])
    assert torch.equal(block.shared_expert_gate.weight, hf[f"{p}shared_expert_gate.weight"])


def test_dummy_weights_from_a_config_only(moe_checkpoints, tmp_path):
    shutil.copy(moe_checkpoints["qwen2_moe"] / "config.json", tmp_path / "config.json")
    model = load_shoal(tmp_path, load_format="dummy")
    assert any(isinstance(m, FusedMoE) for m in model.modules())
    logits = PagedRunner(model, [7]).step([[1, 2, 3, 4, 5, 6, 7]], [(0, 7)])[0]
    assert logits.shape == (7, model.config.vocab_size) and torch.isfinite(logits).all()


def test_expert_parallel_flag_applies_to_moe_architectures_only(moe_checkpoints, tiny_checkpoints, shoal_log):
    from shoal.config import EngineArgs
    from shoal.models.registry import is_moe_architecture

    def parallel(path) -> bool:
        args = EngineArgs(model=str(path), device="cpu", enable_expert_parallel=True)
        return args.create_engine_config().parallel_config.enable_expert_parallel

    assert parallel(moe_checkpoints["mixtral"]) is True
    assert parallel(tiny_checkpoints["llama"]) is False
    assert "enable_expert_parallel is ignored" in shoal_log.text
    assert is_moe_architecture("Qwen3MoeForCausalLM") and not is_moe_architecture("Qwen3ForCausalLM")

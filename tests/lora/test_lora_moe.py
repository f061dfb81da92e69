"""LoRA on the routed MoE experts (PEFT's target_parameters on transformers 5's stacked experts):
greedy output equals transformers + peft on a tiny Qwen3-MoE (every attention projection and
both experts' projections, ranks 8 and 64, rsLoRA on and off; the experts alone); a batch
mixing two expert adapters and the base equals each alone; an RL update reaches the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal import LLM, LoRARequest, SamplingParams
from tests.hf_reference import hf_greedy
from tests.lora.adapters import ATTENTION_PROJECTIONS, EXPERT_PARAMETERS, make_adapter, peft_greedy

NUM_NEW_TOKENS = 6
PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6, 11, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_adapters(moe_checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_lora_adapters")
    base = moe_checkpoints["qwen3_moe"]

    def make(name: str, **kwargs) -> Path:
        return make_adapter(base, root / name, target_parameters=EXPERT_PARAMETERS, **kwargs)

    return {
        "moe_r8": make("moe_r8", r=8, target_modules=ATTENTION_PROJECTIONS, seed=11),
        "moe_r64_rs": make(
            "moe_r64_rs", r=64, lora_alpha=32, use_rslora=True, target_modules=ATTENTION_PROJECTIONS, seed=12
        ),
        "experts_only": make("experts_only", r=16, target_modules=[], seed=13),
    }


# max_num_seqs=2: prefill chunks take the grouped GEMMs in the attention projections, decodes
# the per-token form; the experts' deltas run in the fused-MoE path either way.
@pytest.fixture(scope="module")
def moe_llm(moe_checkpoints: dict) -> LLM:
    llm = LLM(
        str(moe_checkpoints["qwen3_moe"]), multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=64,
        max_num_batched_tokens=32, max_num_seqs=2,
    )  # fmt: skip
    yield llm
    llm.shutdown()


def _generate(llm: LLM, prompts: list[list[int]], lora_request) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_request
    )
    return [o.outputs[0].token_ids for o in outputs]


def _lora(adapters: dict, name: str) -> LoRARequest:
    return LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name]))


@pytest.mark.parametrize("name", ["moe_r8", "moe_r64_rs", "experts_only"])
def test_expert_adapter_matches_peft(moe_llm: LLM, moe_checkpoints: dict, moe_adapters: dict, name: str) -> None:
    base = moe_checkpoints["qwen3_moe"]
    ours = _generate(moe_llm, PROMPTS, _lora(moe_adapters, name))
    assert ours == [peft_greedy(base, moe_adapters[name], p, NUM_NEW_TOKENS) for p in PROMPTS]
    if name == "experts_only":  # the experts' deltas alone change the output
        assert ours != [hf_greedy(str(base), p, NUM_NEW_TOKENS, stop_at_eos=False).token_ids for p in PROMPTS]


def test_batch_mixing_two_expert_adapters_and_the_base_equals_each_alone(moe_llm: LLM, moe_adapters: dict) -> None:
    loras = [_lora(moe_adapters, "moe_r8"), _lora(moe_adapters, "experts_only"), None]
    cases = [(PROMPTS[i % 2], lora) for i, lora in enumerate(loras * 2)]
    mixed = _generate(moe_llm, [p for p, _ in cases], [lora for _, lora in cases])
    alone = [_generate(moe_llm, [p], lora)[0] for p, lora in cases]
    assert mixed == alone
    assert len({tuple(t) for t in alone[:3]}) == 3


def test_expert_adapter_updated_from_tensors_equals_peft(
    moe_llm: LLM, moe_checkpoints: dict, moe_adapters: dict, tmp_path
) -> None:
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = moe_checkpoints["qwen3_moe"]
    policy = LoRARequest("moe_policy", 50, str(moe_adapters["experts_only"]))
    before = _generate(moe_llm, PROMPTS, policy)
    new = make_adapter(base, tmp_path / "new", r=16, target_modules=[], target_parameters=EXPERT_PARAMETERS, seed=77)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(new))
    state = get_peft_model_state_dict(model)
    assert any(".experts." in k for k in state)
    assert moe_llm.update_lora_weights_from_tensors("moe_policy", state) == "1"
    after = _generate(moe_llm, PROMPTS, policy)
    assert after != before
    assert after == [peft_greedy(base, new, p, NUM_NEW_TOKENS) for p in PROMPTS]


def test_bad_expert_adapters_are_refused(moe_llm: LLM, moe_adapters: dict, tmp_path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    def broken(name: str, edit_config=None, edit_weights=None) -> str:
        folder = tmp_path / name
        shutil.copytree(moe_adapters["experts_only"], folder)
        if edit_config is not None:
            config = json.loads((folder / "adapter_config.json").read_text())
            edit_config(config)
            (folder / "adapter_config.json").write_text(json.dumps(config))
        if edit_weights is not None:
            tensors = load_file(folder / "adapter_model.safetensors")
            edit_weights(tensors)
            save_file(tensors, folder / "adapter_model.safetensors")
        return str(folder)

    def fewer_experts(t):  # rank 16 times 6 experts, where the model has 8
        for key in [k for k in t if ".experts." in k]:
            t[key] = (t[key][:96] if "lora_A" in key else t[key][:, :96]).contiguous()

    def per_expert_module(t):  # transformers 4's layout: one module per expert
        t["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"] = torch.zeros(16, 64)
        t["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight"] = torch.zeros(32, 16)

    cases = {
        "router": (broken("router", lambda c: c.update(target_parameters=["mlp.gate.weight"])), "unknown target param"),
        "experts": (broken("experts", edit_weights=fewer_experts), r"gate_up_proj.lora_A has shape \[6, 16, 64\]"),
    }
    cases["per_expert"] = (broken("per_expert", edit_weights=per_expert_module), "per-expert layout")
    for i, (name, (path, message)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            _generate(moe_llm, [[1, 2, 3]], LoRARequest(name, 200 + i, path))
    assert _generate(moe_llm, PROMPTS[:1], None)  # the engine keeps serving


def test_steps_without_expert_adapters_take_the_plain_fused_path(
    moe_llm: LLM, moe_checkpoints: dict, moe_adapters: dict, tmp_path, monkeypatch
) -> None:
    """Base-model steps, and steps whose adapters have no experts' weights, pay nothing for the
    experts' LoRA (eager steps on CPU: `TokenSlots.experts_active`)."""
    import shoal.lora.expert_layers as expert_layers

    calls = []
    lora_path = expert_layers.fused_moe_lora
    monkeypatch.setattr(expert_layers, "fused_moe_lora", lambda *args: calls.append(1) or lora_path(*args))
    attention_only = make_adapter(
        moe_checkpoints["qwen3_moe"], tmp_path / "attention_only", r=8, target_modules=ATTENTION_PROJECTIONS, seed=14
    )
    _generate(moe_llm, PROMPTS, [None, LoRARequest("attention_only", 60, str(attention_only))])
    assert not calls
    _generate(moe_llm, PROMPTS, [None, _lora(moe_adapters, "moe_r8")])
    assert calls

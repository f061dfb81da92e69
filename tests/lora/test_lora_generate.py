"""Greedy generation with LoRA adapters equals transformers + peft (float32, CPU): Llama and
Qwen3, ranks 8 and 64, every projection, rsLoRA on and off; a batch mixing four adapters and the
base model equals each request alone; adapters never share prefix-cache blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal import LLM, LoRARequest, SamplingParams
from tests.hf_reference import hf_greedy
from tests.lora.adapters import make_adapter, peft_greedy

NUM_NEW_TOKENS = 8
TEXTS = ["The quick brown fox", "Paged attention stores keys and values in fixed-size blocks.", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_adapters")
    llama, qwen3 = tiny_checkpoints["llama"], tiny_checkpoints["qwen3"]
    return {
        "llama_r8": make_adapter(llama, root / "llama_r8", r=8, seed=1),
        "llama_r64_rs": make_adapter(llama, root / "llama_r64_rs", r=64, lora_alpha=32, use_rslora=True, seed=2),
        "llama_qv": make_adapter(llama, root / "llama_qv", r=8, target_modules=["q_proj", "v_proj"], seed=3),
        "llama_mlp": make_adapter(llama, root / "llama_mlp", r=16, target_modules=["gate_proj", "down_proj"], seed=4),
        "qwen3_r8_rs": make_adapter(qwen3, root / "qwen3_r8_rs", r=8, use_rslora=True, seed=5),
        "qwen3_r64": make_adapter(qwen3, root / "qwen3_r64", r=64, seed=6),
    }


# max_num_seqs=4: steps of more tokens (prefill chunks) take the grouped GEMMs, decodes the
# per-token form (shoal/kernels/lora.py).
@pytest.fixture(scope="module")
def llama_llm(tiny_checkpoints: dict) -> LLM:
    llm = LLM(
        str(tiny_checkpoints["llama"]), multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=64,
        max_cpu_loras=3, max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
    )  # fmt: skip
    yield llm
    llm.shutdown()


def _prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(t) for t in TEXTS]


def _generate(llm: LLM, prompts: list[list[int]], lora_request) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_request
    )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["llama_r8", "llama_r64_rs"])
def test_llama_adapter_matches_peft(llama_llm: LLM, tiny_checkpoints: dict, adapters: dict, name: str) -> None:
    base = tiny_checkpoints["llama"]
    prompts = _prompts(llama_llm)
    lora = LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name]))
    ours = _generate(llama_llm, prompts, lora)
    expected = [peft_greedy(base, adapters[name], p, NUM_NEW_TOKENS) for p in prompts]
    assert ours == expected
    base_tokens = [hf_greedy(str(base), p, NUM_NEW_TOKENS, stop_at_eos=False).token_ids for p in prompts]
    assert ours != base_tokens  # the adapter changes the output


@pytest.mark.parametrize("name", ["qwen3_r8_rs", "qwen3_r64"])
def test_qwen3_adapter_matches_peft(tiny_checkpoints: dict, adapters: dict, name: str) -> None:
    base = tiny_checkpoints["qwen3"]
    with LLM(str(base), multiprocess=False, enable_lora=True, max_lora_rank=64) as llm:
        prompts = _prompts(llm)
        ours = _generate(llm, prompts, LoRARequest(name, 7, str(adapters[name])))
    assert ours == [peft_greedy(base, adapters[name], p, NUM_NEW_TOKENS) for p in prompts]


def test_batch_mixing_four_adapters_and_the_base_equals_each_alone(llama_llm: LLM, adapters: dict) -> None:
    """max_loras=2 and max_cpu_loras=3 here: the batch's adapters take turns in the slots (the
    others wait), and one is dropped from the CPU cache and read from disk again."""
    names = ["llama_r8", "llama_r64_rs", "llama_qv", "llama_mlp"]
    loras = [LoRARequest(n, 1 + list(adapters).index(n), str(adapters[n])) for n in names] + [None]
    prompts = _prompts(llama_llm)
    cases = [(prompts[i % len(prompts)], lora) for i, lora in enumerate(loras * 2)]
    mixed = _generate(llama_llm, [p for p, _ in cases], [lora for _, lora in cases])
    alone = [_generate(llama_llm, [p], lora)[0] for p, lora in cases[: len(loras)]]
    assert mixed[: len(loras)] == alone
    assert len({tuple(t) for t in alone}) == len(alone)  # every adapter (and the base) differs


def test_same_prompt_under_two_adapters_shares_no_cached_block(llama_llm: LLM, adapters: dict) -> None:
    kv = llama_llm.engine_core.core.scheduler.kv_cache_manager
    prompt = list(range(10, 30))  # five full blocks of 4
    llama_llm.reset_prefix_cache()

    def run(lora: LoRARequest | None) -> tuple[set[int], int]:
        before = set(b.block_id for b in kv.block_pool._cached.values())
        hits = llama_llm.get_stats()["prefix_cache_hits"]
        _generate(llama_llm, [prompt], lora)
        after = set(b.block_id for b in kv.block_pool._cached.values())
        return after - before, llama_llm.get_stats()["prefix_cache_hits"] - hits

    r8 = LoRARequest("llama_r8", 1, str(adapters["llama_r8"]))
    qv = LoRARequest("llama_qv", 3, str(adapters["llama_qv"]))
    new_r8, hits_r8 = run(r8)
    new_qv, hits_qv = run(qv)
    new_base, hits_base = run(None)
    assert hits_r8 == hits_qv == hits_base == 0
    assert len(new_r8) >= 4 and len(new_qv) >= 4 and len(new_base) >= 4
    assert not (new_r8 & new_qv) and not (new_r8 & new_base) and not (new_qv & new_base)
    assert run(r8)[1] > 0  # the same adapter finds its blocks


def test_adapter_updated_from_tensors_equals_peft_with_the_new_weights(
    llama_llm: LLM, tiny_checkpoints: dict, adapters: dict, tmp_path
) -> None:
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = tiny_checkpoints["llama"]
    # A copy of llama_mlp served as "policy"; the trainer's new weights are another adapter's.
    policy = LoRARequest("policy", 40, str(adapters["llama_mlp"]))
    prompts = _prompts(llama_llm)
    before = _generate(llama_llm, prompts, policy)
    new = tmp_path / "new_policy"
    make_adapter(base, new, r=16, target_modules=["gate_proj", "down_proj"], seed=42)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(new))
    state = get_peft_model_state_dict(model)
    assert llama_llm.get_lora_version("policy") == "0"
    assert llama_llm.update_lora_weights_from_tensors("policy", state) == "1"
    after = _generate(llama_llm, prompts, policy)
    assert after != before
    assert after == [peft_greedy(base, new, p, NUM_NEW_TOKENS) for p in prompts]
    with pytest.raises(ValueError, match="lora_B has shape"):
        bad = {k: (v[:-1] if "down_proj.lora_B" in k else v) for k, v in state.items()}
        llama_llm.update_lora_weights_from_tensors("policy", bad)
    assert _generate(llama_llm, prompts, policy) == after  # a refused update changes nothing
    # The same new weights from disk (a trainer's save_pretrained): version 2, the same output.
    assert llama_llm.update_lora_weights_from_disk("policy", str(new)) == "2"
    assert _generate(llama_llm, prompts, policy) == after
    with pytest.raises(ValueError, match=r"has no adapter_config\.json"):
        llama_llm.update_lora_weights_from_disk("policy", str(tmp_path / "nowhere"))


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(
    llama_llm: LLM, tiny_checkpoints: dict, adapters: dict, tmp_path
) -> None:
    import json
    import shutil

    def broken(name: str, edit_config=None, edit_weights=None) -> str:
        folder = tmp_path / name
        shutil.copytree(adapters["llama_r8"], folder)
        if edit_config is not None:
            config = json.loads((folder / "adapter_config.json").read_text())
            edit_config(config)
            (folder / "adapter_config.json").write_text(json.dumps(config))
        if edit_weights is not None:
            from safetensors.torch import load_file, save_file

            tensors = load_file(folder / "adapter_model.safetensors")
            edit_weights(tensors)
            save_file(tensors, folder / "adapter_model.safetensors")
        return str(folder)

    def wrong_shape(t):
        key = next(k for k in t if "q_proj.lora_B" in k)
        t[key] = t[key][:-2].contiguous()

    def unknown_module(t):
        key = next(k for k in t if "q_proj.lora_A" in k)
        t[key.replace("q_proj", "rotary_proj")] = t[key].clone()
        t[key.replace("q_proj", "rotary_proj").replace("lora_A", "lora_B")] = t[key].T.contiguous()

    def experts_on_a_dense_model(t):
        t["base_model.model.model.layers.0.mlp.experts.lora_A.weight"] = torch.zeros(8 * 4, 64)
        t["base_model.model.model.layers.0.mlp.experts.lora_B.weight"] = torch.zeros(64, 8 * 4)

    cases = {
        "missing": (str(tmp_path / "nowhere"), "has no adapter_config.json"),
        "no_weights": (broken("no_weights"), None),
        "rank": (broken("rank", lambda c: c.update(r=128)), "over max_lora_rank=64"),
        "modules_to_save": (broken("mts", lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
        "target": (broken("target", lambda c: c.update(target_modules=["q_proj", "rotary_proj"])), "unknown target"),
        "experts": (
            broken("experts", lambda c: c.update(target_parameters=["mlp.gate.weight"])),
            "unknown target param",
        ),
        "dense_experts": (
            broken(
                "dense_experts",
                lambda c: c.update(target_parameters=["mlp.experts.down_proj"]),
                experts_on_a_dense_model,
            ),
            "the model has no routed experts",
        ),
        "shape": (
            broken("shape", edit_weights=wrong_shape),
            r"q_proj.lora_B has shape \[62, 8\], but the base model.s layer needs \[64, 8\]",
        ),
        "module": (broken("module", edit_weights=unknown_module), "unknown target module"),
    }
    (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
    cases["no_weights"] = (cases["no_weights"][0], "has no adapter_model.safetensors")
    for i, (name, (path, message)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            _generate(llama_llm, [[1, 2, 3]], LoRARequest(name, 100 + i, path))
    assert set(llama_llm.list_loras()).isdisjoint(cases)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "somewhere")
    r8 = LoRARequest("llama_r8", 1, str(adapters["llama_r8"]))
    assert _generate(llama_llm, _prompts(llama_llm), r8) == _generate(llama_llm, _prompts(llama_llm), r8)


def test_lora_needs_enable_lora(tiny_checkpoints: dict, adapters: dict) -> None:
    with LLM(str(tiny_checkpoints["llama"]), multiprocess=False) as llm, pytest.raises(ValueError, match="enable_lora"):
        _generate(llm, [[1, 2, 3]], LoRARequest("a", 1, str(adapters["llama_r8"])))

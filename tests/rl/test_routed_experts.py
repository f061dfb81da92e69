"""Routed experts (`return_routed_experts`) of a tiny Qwen3-MoE and a tiny DeepSeek-V3 against
transformers' routers on the same tokens: the engine's ids of every position (prompt, then
output tokens but the last) equal the top-k the Hugging Face router picks, layer by layer, with
chunked prefill and a request that does not ask in the same batches; and the trainer's masks."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.rl import decode_routed_experts, routing_masks

CASES = [("moe_checkpoints", "qwen3_moe"), ("deepseek_checkpoints", "deepseek_v3")]


def _hf_router_choices(path, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """Layer index -> the transformers router's top-k ids [len(token_ids), top_k], sorted."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    chosen: dict[int, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def keep(module, args, output, layer=layer):
                chosen[layer] = output[2].sort(dim=-1).values

            handles.append(module.register_forward_hook(keep))
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    for handle in handles:
        handle.remove()
    return chosen


@pytest.mark.parametrize(("fixture", "kind"), CASES)
def test_routed_experts_equal_transformers_router(request, fixture, kind):
    path = request.getfixturevalue(fixture)[kind]
    llm = LLM(str(path), multiprocess=False, dtype="float32", block_size=4, max_num_batched_tokens=12)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()} for n in (9, 15, 5)]
    asking = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    plain = asking.clone(return_routed_experts=False)
    outputs = llm.generate(prompts, [asking, plain, asking], use_tqdm=False)
    assert outputs[1].outputs[0].routed_experts is None
    hf_config = llm.config.model_config.hf_config
    num_layers, top_k = hf_config.num_hidden_layers, hf_config.num_experts_per_tok
    for out in (outputs[0], outputs[2]):
        sequence = out.prompt_token_ids + out.outputs[0].token_ids
        ours = out.outputs[0].routed_experts
        assert ours.shape == (len(sequence) - 1, num_layers, top_k) and ours.dtype == np.int32
        theirs = _hf_router_choices(path, sequence[:-1])
        assert theirs, "no router found in the transformers model"
        for layer in range(num_layers):
            if layer in theirs:
                assert torch.equal(torch.from_numpy(ours[:, layer]).long().sort(dim=-1).values, theirs[layer]), layer
            else:  # a dense layer
                assert (ours[:, layer] == -1).all()
    # Again: the prompts' blocks are cached now, but a request that asks computes its prompt.
    again = llm.generate(prompts[:1], asking, use_tqdm=False)[0].outputs[0]
    assert np.array_equal(again.routed_experts, outputs[0].outputs[0].routed_experts)
    llm.shutdown()


def test_routing_masks_from_ids_and_sglang_encoding():
    ids = np.array([[[1, 3], [-1, -1]], [[0, 1], [-1, -1]]], dtype=np.int32)  # 2 tokens, 2 layers
    encoded = base64.b64encode(ids.tobytes()).decode()
    decoded = decode_routed_experts(encoded, num_layers=2, top_k=2)
    assert np.array_equal(decoded, ids)
    masks = routing_masks(decoded, num_experts=4)
    assert masks[1] is None
    assert masks[0].tolist() == [[False, True, False, True], [True, True, False, False]]
    with pytest.raises(ValueError, match="out of range"):
        routing_masks(ids, num_experts=2)
    with pytest.raises(ValueError, match="whole rows"):
        decode_routed_experts(base64.b64encode(b"\0" * 12).decode(), num_layers=2, top_k=2)


def test_sglang_and_vllm_answers_carry_them():
    """SGLang's /generate: `return_routed_experts` (one per prompt) and `routed_experts_start_len`
    -> meta_info.routed_experts in base64; the vLLM-shaped choice: nested lists."""
    from shoal.entrypoints.openai import sglang_generate, vllm_api
    from shoal.outputs import CompletionOutput, RequestOutput

    call = sglang_generate.parse_generate(
        {"input_ids": [[1, 2], [3, 4]], "return_routed_experts": [True, False], "routed_experts_start_len": 1}
    )
    asking, plain = call.samples
    assert asking.params.return_routed_experts and not plain.params.return_routed_experts
    ids = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)
    completion = CompletionOutput(0, "x", [7, 8], finish_reason="length", routed_experts=ids)
    output = RequestOutput("r", None, [1, 2], [completion], finished=True)
    meta = sglang_generate.answer(asking, output, "0")["meta_info"]
    assert np.array_equal(decode_routed_experts(meta["routed_experts"], 2, 2), ids[1:])
    assert "routed_experts" not in sglang_generate.answer(plain, output, "0")["meta_info"]
    choice = vllm_api._choice(completion, asking.params, aborted=False)
    assert choice["routed_experts"] == ids.tolist()
    with pytest.raises(ValueError, match="routed_experts_start_len"):
        sglang_generate.parse_generate(
            {"input_ids": [1], "return_routed_experts": True, "routed_experts_start_len": -1}
        )

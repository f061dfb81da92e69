"""LoRA under tensor parallelism through Ray: A and B cut like the base layer they attach to
(and with fully_sharded_loras), greedy output equal to TP=1's and to transformers + peft, in a
batch that mixes the adapter and the base model."""

from __future__ import annotations

import pytest

from shoal import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import make_adapter, peft_greedy

PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# Each case starts two Ray workers (about 25 s on two cores): the fully sharded layout (which cuts
# B of column-parallel and A of row-parallel layers like the base, and the rest too) runs in
# make test, the plain one with the slow tests.
@pytest.mark.parametrize(
    "fully_sharded",
    [pytest.param(False, marks=pytest.mark.slow, id="sharded_like_base"), pytest.param(True, id="fully_sharded")],
)
def test_tp2_through_ray_equals_tp1(ray_cluster: dict, tiny_checkpoints: dict, tmp_path, fully_sharded: bool) -> None:
    base = tiny_checkpoints["llama"]
    adapter = make_adapter(base, tmp_path / "adapter", r=8, seed=21)
    loras = [LoRARequest("a", 1, str(adapter)), None]
    llm = LLM(
        str(base), tensor_parallel_size=2, distributed_executor_backend="ray", enable_lora=True,
        max_lora_rank=8, fully_sharded_loras=fully_sharded, multiprocess=False,
    )  # fmt: skip
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, GREEDY, use_tqdm=False,
                               lora_request=[loras[0], loras[0], loras[1], loras[1]])  # fmt: skip
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens[:2] == [peft_greedy(base, adapter, p, 6) for p in PROMPTS]
    with LLM(str(base), multiprocess=False, enable_lora=True, max_lora_rank=8) as tp1:
        expected = tp1.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, GREEDY, use_tqdm=False,
                                lora_request=[loras[0], loras[0], loras[1], loras[1]])  # fmt: skip
    assert tokens == [o.outputs[0].token_ids for o in expected]


# LoRA on the routed experts: TP cuts gate_up's B and down's A like the experts' intermediate
# dimension, EP keeps each rank's experts whole; either equals TP=1 and transformers + peft.
# Two Ray workers each: the tensor-parallel cut (B of gate_up and A of down split) runs in make
# test, expert parallelism with the slow tests (tests/lora/test_expert_lora_layers.py checks both
# cuts' partial sums without Ray).
@pytest.mark.parametrize(
    "expert_parallel",
    [pytest.param(False, id="experts_tp"), pytest.param(True, marks=pytest.mark.slow, id="experts_ep")],
)
def test_expert_lora_tp2_through_ray_equals_tp1(
    ray_cluster: dict, moe_checkpoints: dict, tmp_path, expert_parallel: bool
) -> None:
    from tests.lora.adapters import ATTENTION_PROJECTIONS, EXPERT_PARAMETERS

    base = moe_checkpoints["qwen3_moe"]
    adapter = make_adapter(
        base,
        tmp_path / "adapter",
        r=8,
        seed=22,
        target_modules=ATTENTION_PROJECTIONS,
        target_parameters=EXPERT_PARAMETERS,
    )
    loras = [LoRARequest("a", 1, str(adapter))] * 2 + [None] * 2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * 2
    llm = LLM(
        str(base), tensor_parallel_size=2, distributed_executor_backend="ray", enable_lora=True,
        max_lora_rank=8, enable_expert_parallel=expert_parallel, multiprocess=False,
    )  # fmt: skip
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
    finally:
        llm.shutdown()
    assert tokens[:2] == [peft_greedy(base, adapter, p, 6) for p in PROMPTS]
    with LLM(str(base), multiprocess=False, enable_lora=True, max_lora_rank=8) as tp1:
        expected = tp1.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert tokens == [o.outputs[0].token_ids for o in expected]

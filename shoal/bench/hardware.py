"""The hardware bound of a workload: the time no engine could beat on this device.

Two ceilings are measured at the start of a run on the device itself:

- read bandwidth: one streaming read of a large buffer (shoal/bench/stream_read.py on a GPU,
  a tensor sum on a CPU), bytes / time; what weight and KV-cache reads can reach. The
  device-to-device copy rate, (bytes read + bytes written) / time, is measured and reported
  beside it (on an H200 reads alone run ~9% faster than a copy);
- GEMM rate: an N×N×N matrix product (bf16, N = 8192 on a GPU; the engine's dtype, N = 1024 on
  a CPU), 2·N³ / time; on a GPU with fp8 tensor cores the same product in e4m3 too
  (`torch._scaled_mm`), the rate of the products of fp8 weights (the linear layers of fp8
  checkpoints and, block-wise, their routed experts), which run about twice as fast.

The workload is then replayed as engine steps (`simulate_steps`): every prompt is prefilled
first, in chunks of at most `max_num_batched_tokens` tokens a step; then decode steps run every
running request (at most `max_num_seqs`) one token further, a finished request's place going to
the next waiting one, so the batch shrinks at the end. Each step costs at least

    max(bytes / read bandwidth, flops / GEMM rate + fp8 flops / fp8 GEMM rate)
    bytes = weight bytes (every weight read once a step; of a mixture of experts, the experts
            the step's tokens chose, expected under uniform routing)
            + KV bytes per token × (context tokens attention reads + new tokens written)
    flops = 2 × layer params × new tokens + 2 × LM-head params × sampled tokens
            + 4 × layers × heads × head_dim × (query, key) pairs attention scores
            (of them 2 × fp8 params × new tokens are the fp8 flops)

and the bound is the sum over steps. That max() assumes a step's weight traffic, its GEMMs and
its attention all overlap. Kernels that run one after another cannot overlap them, so a second,
*serial* bound charges each step its weight phase (weights and GEMM FLOPs) and its attention
phase (KV cache and attention FLOPs) one after the other:

    max(weight bytes / bw, GEMM flops / rate) + max(KV bytes / bw, attention flops / rate)

At large decode batches the GEMMs turn compute-bound while attention stays memory-bound, and
the two bounds part. Left out of both: activations, the embedding lookup, norms and
rotary, sampling, CPU and launch overhead, and overlap between steps; chunked prefill that mixes
prefill into decode steps would share their weight reads (so the real optimum can be a little
lower). With tensor parallelism the model is assumed split evenly over `tp` devices, each with
the measured ceilings. `achieved share = bound / measured time`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from shoal.layers.quantization.fp8_config import Fp8Config

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


# ---- ceilings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceCeilings:
    device: str
    device_name: str
    read_bytes_per_s: float
    copy_bytes_per_s: float
    gemm_flops_per_s: float
    gemm_dtype: str
    gemm_size: int
    fp8_gemm_flops_per_s: float | None = None  # None: no fp8 tensor cores (fp8 flops at gemm_flops_per_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_ceilings(
    device: str, dtype: str = "bfloat16", copy_bytes: int | None = None, gemm_size: int | None = None
) -> DeviceCeilings:
    """Read and copy bandwidth and GEMM rate measured on `device` ("cuda" or "cpu")."""
    import torch

    on_gpu = device == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if on_gpu else 128 << 20)
    gemm_size = gemm_size or (8192 if on_gpu else 1024)
    gemm_dtype = ("bfloat16" if dtype == "float32" else dtype) if on_gpu else dtype
    torch_device = torch.device("cuda" if on_gpu else "cpu")
    copy_s = _copy_time(torch_device, copy_bytes)
    read_s = _read_time(torch_device, copy_bytes)
    gemm_s = _gemm_time(torch_device, gemm_size, getattr(torch, gemm_dtype))
    fp8_gemm_s = _fp8_gemm_time(torch_device, gemm_size) if on_gpu else None
    if on_gpu:
        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(torch_device)
    else:
        import platform

        name = platform.processor() or platform.machine()
    gemm_flops = 2 * gemm_size**3
    return DeviceCeilings(
        device, name, copy_bytes / read_s, 2 * copy_bytes / copy_s, gemm_flops / gemm_s, gemm_dtype, gemm_size,
        None if fp8_gemm_s is None else gemm_flops / fp8_gemm_s,
    )  # fmt: skip


def _copy_time(device: Any, num_bytes: int) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _time_per_call(lambda: dst.copy_(src), device.type == "cuda", iters=10)


def _read_time(device: Any, num_bytes: int) -> float:
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    if device.type != "cuda":
        return _time_per_call(lambda: src.sum(), False, iters=10)
    from shoal.bench.stream_read import num_programs, stream_read

    partials = torch.empty(num_programs(src.numel()), dtype=torch.float32, device=device)
    # The best of 5 rounds of 20 calls (after the compile and 10 calls of warm-up): one long
    # round measured 4.47 TB/s in one process and 4.19 in the next of the same call (2 GB both),
    # and a ceiling taken low makes a run look closer to it than it is.
    return min(_time_per_call(lambda: stream_read(src, partials), True, iters=20, warmup=10 if r == 0 else 0)
               for r in range(5))  # fmt: skip


def _gemm_time(device: Any, n: int, dtype: Any) -> float:
    import torch

    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn_like(a)
    on_gpu = device.type == "cuda"
    return _time_per_call(lambda: torch.matmul(a, b), on_gpu, iters=10 if on_gpu else 3)


def _fp8_gemm_time(device: Any, n: int) -> float | None:
    """Seconds of an n×n×n e4m3 product with per-tensor scales; None on a GPU without fp8 tensor
    cores (before sm_89) or a torch without `_scaled_mm` there."""
    import torch

    if torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    one = torch.ones((), device=device)
    try:
        return _time_per_call(
            lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), True, iters=10
        )
    except (RuntimeError, TypeError):  # an fp8 GEMM this torch does not run: the bound uses the bf16 rate
        return None


def _time_per_call(fn: Any, on_gpu: bool, iters: int, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if on_gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


# ---- the model's size ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What a step of this model moves and computes, from its config alone."""

    num_layers: int
    num_heads: int
    head_dim: int
    layer_params: int  # every decoder layer and the final norm
    embed_params: int
    lm_head_params: int
    tied_embeddings: bool
    weight_bytes: int  # read once a step: layers + LM head (the embedding is a row lookup); no routed expert
    kv_bytes_per_token: int  # K and V of one token over all layers
    # Mixture of experts: layer_params counts the experts a token goes through (top_k of them);
    # a step reads the weights of the experts its tokens chose (`weight_bytes_for`).
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0  # one routed expert of one layer
    expert_bytes: int = 0
    # Of layer_params, those whose products run in fp8 (fp8 checkpoints: the linear layers, and of
    # block-wise ones the experts a token goes through too).
    fp8_params: int = 0
    # Multi-head latent attention (DeepSeek): flops of one (query, key) pair in one head, when
    # they are not 4 x head_dim (0: standard attention).
    flops_per_pair_per_head: int = 0

    @property
    def num_params(self) -> int:
        idle_experts = self.num_moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params
        return (
            self.layer_params + idle_experts + self.embed_params + (0 if self.tied_embeddings else self.lm_head_params)
        )

    def experts_touched(self, num_tokens: int) -> float:
        """The routed experts a step of `num_tokens` tokens reads in one MoE layer, expected
        under uniform routing: E (1 - (1 - k/E)^T) (random weights route nearly uniformly;
        trained routers are less even, and touch fewer)."""
        if self.num_experts == 0:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens)

    def weight_bytes_for(self, num_tokens: int) -> float:
        """Weight bytes a step of `num_tokens` tokens reads: everything but the routed experts,
        and the experts it touches."""
        return self.weight_bytes + self.num_moe_layers * self.expert_bytes * self.experts_touched(num_tokens)

    @property
    def attention_flops_per_pair(self) -> int:
        """Q·K and P·V for one (query, key) pair over every layer and head: 2 × 2 × head_dim each."""
        per_head = self.flops_per_pair_per_head or 4 * self.head_dim
        return self.num_layers * self.num_heads * per_head

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "num_params": self.num_params}

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, dtype: str, kv_cache_dtype: str = "auto", quantization: str | None = None
    ) -> ModelShape:
        """Parameter counts of a dense Llama/Qwen/Mistral-style decoder (GQA attention with
        optional q/k norms and biases, a gated MLP)."""
        hidden = int(hf_config.hidden_size)
        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hidden // num_heads)
        num_layers = int(hf_config.num_hidden_layers)
        intermediate = int(hf_config.intermediate_size)
        vocab = int(hf_config.vocab_size)
        model_type = getattr(hf_config, "model_type", "")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        attention = hidden * (q_size + 2 * kv_size) + q_size * hidden
        mla = _mla_shape(hf_config, hidden, num_heads)
        if mla is not None:
            attention = mla["params"]
        if getattr(hf_config, "attention_bias", False) or model_type in ("qwen2", "qwen2_moe"):
            attention += q_size + 2 * kv_size + (hidden if getattr(hf_config, "attention_bias", False) else 0)
        if model_type in ("qwen3", "qwen3_moe"):
            attention += 2 * head_dim  # q_norm and k_norm
        mlp = 3 * hidden * intermediate + (2 * intermediate + hidden if getattr(hf_config, "mlp_bias", False) else 0)
        moe = _moe_shape(hf_config, hidden)
        num_dense = num_layers - moe["num_moe_layers"]
        # Linear layers read every step: attention everywhere, dense MLPs, MoE layers' router and shared experts.
        linear_params = num_layers * attention + num_dense * mlp + moe["num_moe_layers"] * moe["always_params"]
        active_experts = moe["num_moe_layers"] * moe["experts_per_token"] * moe["expert_params"]
        layer_params = linear_params + active_experts + num_layers * 2 * hidden + hidden  # two norms a layer, one final
        lm_head = vocab * hidden
        dtype_bytes = DTYPE_BYTES[dtype]
        linear_bytes: float = DTYPE_BYTES["fp8"] if quantization == "fp8" else dtype_bytes
        block = Fp8Config.from_hf_config(hf_config).weight_block_size if quantization == "fp8" else None
        # Block-wise fp8 (DeepSeek-V3's checkpoints) quantizes the routed experts too, and adds
        # one float32 scale per block; per-tensor fp8 leaves the experts in the model's dtype.
        expert_bytes: float = dtype_bytes
        if block is not None:
            linear_bytes = expert_bytes = DTYPE_BYTES["fp8"] + 4 / (block[0] * block[1])
        norm_params = layer_params - linear_params - active_experts
        fp8_params = 0 if quantization != "fp8" else linear_params + (active_experts if block is not None else 0)
        weight_bytes = round(linear_params * linear_bytes) + (norm_params + lm_head) * dtype_bytes
        kv_bytes = dtype_bytes if kv_cache_dtype == "auto" else DTYPE_BYTES[kv_cache_dtype]
        return cls(
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            layer_params=layer_params,
            embed_params=vocab * hidden,
            lm_head_params=lm_head,
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            weight_bytes=weight_bytes,
            kv_bytes_per_token=num_layers * kv_bytes * (mla["latent"] if mla else 2 * num_kv_heads * head_dim),
            num_moe_layers=moe["num_moe_layers"],
            num_experts=moe["num_experts"],
            experts_per_token=moe["experts_per_token"],
            expert_params=moe["expert_params"],
            expert_bytes=round(moe["expert_params"] * expert_bytes),
            fp8_params=fp8_params,
            flops_per_pair_per_head=mla["flops_per_pair"] if mla else 0,
        )


def _mla_shape(hf_config: Any, hidden: int, num_heads: int) -> dict[str, int] | None:
    """Multi-head latent attention's parameters of one layer, the latent a token caches, and the
    flops of one (query, key) pair in one head as the absorbed decode computes them (the score
    over the whole latent, the output over its kv_lora_rank values; decode dominates the bound
    of a generation workload). None for standard attention."""
    rank = int(getattr(hf_config, "kv_lora_rank", None) or 0)
    if not rank:
        return None
    nope, rope, v_dim = (int(getattr(hf_config, k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_lora = int(getattr(hf_config, "q_lora_rank", None) or 0)
    q_head = num_heads * (nope + rope)
    query = hidden * q_head if not q_lora else hidden * q_lora + q_lora + q_lora * q_head
    params = query + hidden * (rank + rope) + rank + rank * num_heads * (nope + v_dim) + num_heads * v_dim * hidden
    return dict(params=params, latent=rank + rope, flops_per_pair=2 * (rank + rope) + 2 * rank)


def _moe_shape(hf_config: Any, hidden: int) -> dict[str, int]:
    """A mixture-of-experts config's layer counts and sizes (zeros for a dense model): routed
    experts of `moe_intermediate_size` (Mixtral: `intermediate_size`), and the parameters every
    token of a MoE layer goes through: the router and the shared experts (Qwen2-MoE's gated one,
    DeepSeek's `n_shared_experts`)."""
    from shoal.layers.moe.routing import num_routed_experts
    from shoal.layers.moe.sparsity import is_moe_layer

    num_experts = num_routed_experts(hf_config)
    num_moe_layers = sum(is_moe_layer(hf_config, i) for i in range(int(hf_config.num_hidden_layers)))
    if not num_experts or not num_moe_layers:
        return dict(num_moe_layers=0, num_experts=0, experts_per_token=0, expert_params=0, always_params=0)
    expert_intermediate = int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    shared_params = 3 * hidden * shared + (hidden if shared else 0)  # with its gate
    shared_params += 3 * hidden * expert_intermediate * int(getattr(hf_config, "n_shared_experts", 0) or 0)
    return dict(
        num_moe_layers=num_moe_layers,
        num_experts=num_experts,
        experts_per_token=int(hf_config.num_experts_per_tok),
        expert_params=3 * hidden * expert_intermediate,
        always_params=num_experts * hidden + shared_params,
    )


# ---- the workload as engine steps ------------------------------------------------------------


@dataclass(frozen=True)
class StepLoad:
    """What one engine step computes, summed over its requests."""

    num_tokens: int  # new tokens through every layer
    num_sampled: int  # rows through the LM head (the last token of a finished prefill, each decode)
    kv_read_tokens: int  # context tokens (new ones included) whose K and V attention reads
    attention_pairs: int  # (query, key) pairs attention scores, causal
    is_prefill: bool


def prefill_piece_pairs(num_computed: int, num_new: int) -> int:
    """(query, key) pairs of `num_new` prompt tokens after `num_computed` cached ones: token i
    (0-based) of the chunk attends to num_computed + i + 1 keys."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


def simulate_steps(
    prompt_lens: list[int], output_lens: list[int], max_num_seqs: int, max_num_batched_tokens: int
) -> list[StepLoad]:
    """The workload as engine steps: prefill of every prompt in order, chunked by the token
    budget; then decode with at most `max_num_seqs` running, requests admitted in order."""
    steps = _prefill_steps(prompt_lens, max_num_batched_tokens)
    steps.extend(_decode_steps(prompt_lens, output_lens, max_num_seqs))
    return steps


def _prefill_steps(prompt_lens: list[int], budget: int) -> list[StepLoad]:
    steps: list[StepLoad] = []
    tokens = sampled = kv_read = pairs = 0
    for prompt_len in prompt_lens:
        done = 0
        while done < prompt_len:
            if tokens == budget:
                steps.append(StepLoad(tokens, sampled, kv_read, pairs, True))
                tokens = sampled = kv_read = pairs = 0
            num_new = min(prompt_len - done, budget - tokens)
            tokens += num_new
            kv_read += done + num_new
            pairs += prefill_piece_pairs(done, num_new)
            done += num_new
        sampled += 1  # the prompt's last chunk samples its first output token
    if tokens:
        steps.append(StepLoad(tokens, sampled, kv_read, pairs, True))
    return steps


def _decode_steps(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int) -> list[StepLoad]:
    """Request r decodes output_lens[r] - 1 tokens (the first came from its prefill); at its
    k-th decode step it has prompt_len + k - 1 tokens cached and attends to prompt_len + k."""
    waiting = [(p, n - 1) for p, n in zip(prompt_lens, output_lens) if n > 1][::-1]
    running: list[list[int]] = []  # [context after the next step, decode steps left]
    steps: list[StepLoad] = []
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            prompt_len, num_decode = waiting.pop()
            running.append([prompt_len + 1, num_decode])
        context = sum(r[0] for r in running)
        steps.append(StepLoad(len(running), len(running), context, context, False))
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return steps


# ---- the bound -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadBound:
    bound_s: float
    prefill_s: float
    decode_s: float
    num_steps: int
    num_memory_bound_steps: int
    total_bytes: float
    total_flops: float
    serial_bound_s: float = 0.0  # weight phase and attention phase of each step in series

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_bytes_and_flops(shape: ModelShape, step: StepLoad) -> tuple[float, float]:
    kv_bytes = shape.kv_bytes_per_token * (step.kv_read_tokens + step.num_tokens)
    flops = (
        2 * shape.layer_params * step.num_tokens
        + 2 * shape.lm_head_params * step.num_sampled
        + shape.attention_flops_per_pair * step.attention_pairs
    )
    return shape.weight_bytes_for(step.num_tokens) + kv_bytes, flops


def step_phases(shape: ModelShape, step: StepLoad) -> tuple[tuple[float, float], tuple[float, float]]:
    """((bytes, flops) of the weight phase, (bytes, flops) of the attention phase)."""
    weight_flops = 2 * shape.layer_params * step.num_tokens + 2 * shape.lm_head_params * step.num_sampled
    kv_bytes = shape.kv_bytes_per_token * (step.kv_read_tokens + step.num_tokens)
    weight_bytes = shape.weight_bytes_for(step.num_tokens)
    return (weight_bytes, weight_flops), (kv_bytes, shape.attention_flops_per_pair * step.attention_pairs)


def workload_bound(
    shape: ModelShape, ceilings: DeviceCeilings, steps: list[StepLoad], tensor_parallel_size: int = 1
) -> WorkloadBound:
    prefill_s = decode_s = serial_s = total_bytes = total_flops = 0.0
    num_memory_bound = 0

    fp8_rate = ceilings.fp8_gemm_flops_per_s or ceilings.gemm_flops_per_s

    def seconds(num_bytes: float, flops: float, fp8_flops: float = 0.0) -> tuple[float, float]:
        compute_s = (flops - fp8_flops) / ceilings.gemm_flops_per_s + fp8_flops / fp8_rate
        return num_bytes / tensor_parallel_size / ceilings.read_bytes_per_s, compute_s / tensor_parallel_size

    for step in steps:
        num_bytes, flops = step_bytes_and_flops(shape, step)
        fp8_flops = 2 * shape.fp8_params * step.num_tokens
        memory_s, compute_s = seconds(num_bytes, flops, fp8_flops)
        num_memory_bound += memory_s >= compute_s
        if step.is_prefill:
            prefill_s += max(memory_s, compute_s)
        else:
            decode_s += max(memory_s, compute_s)
        weight_phase, attention_phase = step_phases(shape, step)
        serial_s += max(seconds(*weight_phase, fp8_flops)) + max(seconds(*attention_phase))
        total_bytes += num_bytes
        total_flops += flops
    return WorkloadBound(
        prefill_s + decode_s, prefill_s, decode_s, len(steps), num_memory_bound, total_bytes, total_flops, serial_s
    )

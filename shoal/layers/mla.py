"""Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and
Efficient Mixture-of-Experts Language Model", section 2.1), as DeepSeek-V2, V2-Lite and V3 use it.

Keys and values are compressed jointly into one latent per token, shared by every head:

    [c_kv, k_pe] = x W_DKV                      (kv_a_proj_with_mqa: kv_lora_rank + qk_rope_head_dim)
    c_kv = RMSNorm(c_kv);  k_pe = RoPE(k_pe)    (kv_a_layernorm; one rotated key for all heads)
    [k_nope_h, v_h] = c_kv W_UKV_h              (kv_b_proj: qk_nope_head_dim + v_head_dim per head)
    q = x W_Q  or  RMSNorm(x W_DQ) W_UQ         (q_proj; or q_a_proj, q_a_layernorm, q_b_proj when
                                                 q_lora_rank is set, as in V2 and V3)
    q_h = [q_nope_h, RoPE(q_pe_h)],  k_h = [k_nope_h, k_pe]
    out = o_proj(concat_h softmax(q_h k_h^T * scale) v_h)

The paged cache holds only `[c_kv, k_pe]` (`mla_spec`, 576 values a token for V3's 128 heads).
Two equal forms of the attention read it:
- prefill, expanded: the context's latents are up-projected to per-head keys and values and
  attended over as usual (a chunk after a cached prefix, a prefix-cache hit or a resumed
  request reads its context's latents back from the cache);
- decode, absorbed (section 2.1.3): q_nope_h . k_nope_h = (W_UK_h^T q_nope_h) . c_kv, so the
  query is folded into the latent space and attends over the cached latents directly
  (`mla_decode`), and W_UV is applied to the result. No per-head key or value is materialized.
  A block-fp8 kv_b_proj is dequantized for this once, and the latent is cached as its fp8
  input rounds it, so that both forms compute the same (`_as_kv_b_input`).

Tensor parallelism splits the heads: q_proj / q_b_proj and kv_b_proj are column-parallel (whole
heads per rank), o_proj row-parallel; the down-projections and the latent are replicated.
The rotary embedding rotates interleaved pairs (DeepSeek's layout; V3 with
`rope_interleave=False` rotates halves).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from shoal.distributed.parallel_state import get_tp_group
from shoal.forward_context import AttentionMetadata, get_forward_context
from shoal.kernels.concat_and_cache_mla import concat_and_cache_mla
from shoal.kernels.mla_decode import mla_decode, warm_up_mla_decode
from shoal.kernels.paged_attention import step_plan
from shoal.kernels.per_token_group_quant_fp8 import dequantize_per_token_group, per_token_group_quant_fp8
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE
from shoal.kernels.w8a8_block_fp8_matmul import dequantize_block_fp8
from shoal.layers.kv_cache_spec import KVCacheSpec, mla_spec
from shoal.layers.layernorm import RMSNorm
from shoal.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.rotary import RotaryEmbedding, rope_params_from_config, yarn_softmax_scale

# The expanded prefill's SDPA backends on the GPU. Left to choose, SDPA takes cuDNN, which builds a
# plan for every new (query, context) length: on one H200 the 256 x (512 in, 256 out) run of
# DeepSeek-V2-Lite's shape stalled up to 1.2 s at a time on it, the device busy 36% of the wall.
# Flash attention needs equal key and value widths (192 and 128 here), so memory-efficient
# attention serves, with the bottom-right causal mask natively.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


class MLAAttention(nn.Module):
    """One decoder layer's self-attention; also the layer the model runner binds its latent
    cache to (`kv_cache`, shaped by `kv_cache_spec`)."""

    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, quant_config: Fp8Config | None = None, prefix: str = ""
    ):
        super().__init__()
        self.num_heads = divide(config.num_attention_heads, get_tp_group().world_size, "number of heads")
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.scale = self.qk_head_dim**-0.5 * yarn_softmax_scale(rope_params_from_config(config))
        self._build_projections(config, quant_config, prefix)
        self.rotary_emb = rotary_emb
        # A plain attribute, not a buffer: the runner owns the cache and binds it here.
        self.kv_cache: torch.Tensor | None = None
        self._kv_b_cache: tuple[tuple[Any, ...], torch.Tensor] | None = None  # see _dequantized_kv_b

    def _build_projections(self, config: Any, quant_config: Fp8Config | None, prefix: str) -> None:
        bias, hidden, total_heads = (
            bool(getattr(config, "attention_bias", False)),
            config.hidden_size,
            config.num_attention_heads,
        )
        q_size = total_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden, q_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.q_proj"
            )
        else:
            self.q_a_proj = ReplicatedLinear(
                hidden, self.q_lora_rank, bias, quant_config=quant_config, prefix=f"{prefix}.q_a_proj"
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # eps 1e-6, as in the reference
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.q_b_proj"
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias, quant_config=quant_config,
            prefix=f"{prefix}.kv_a_proj_with_mqa",
        )  # fmt: skip
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False,
            quant_config=quant_config, prefix=f"{prefix}.kv_b_proj",
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            total_heads * self.v_head_dim, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent per token for all heads: kv_lora_rank + qk_rope_head_dim values."""
        return mla_spec(self.kv_lora_rank, self.qk_rope_head_dim)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [num_tokens], hidden_states [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        num_tokens = hidden_states.shape[0]
        q = self._query(hidden_states).view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self._as_kv_b_input(self.kv_a_layernorm(kv_c.contiguous()))  # [num_tokens, kv_lora_rank]
        # The rotary op rotates contiguous rows in place: [num_tokens, num_heads * rope] and [num_tokens, rope].
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(num_tokens, -1), k_pe.contiguous())
        q_pe = q_pe.view(num_tokens, self.num_heads, self.qk_rope_head_dim)
        out = self._attention(q_nope, q_pe, kv_c, k_pe)  # [num_tokens, num_heads, v_head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))

    def _as_kv_b_input(self, kv_c: torch.Tensor) -> torch.Tensor:
        """The latent as kv_b_proj reads it. A block-fp8 kv_b_proj rounds its input to fp8 per
        token and group; the latent is cached so rounded, and the absorbed decode, which never
        runs kv_b_proj on it, then computes what the expanded form computes (DeepSeek's "naive"
        attention), so an output does not depend on which tokens were prefilled and which
        decoded. Rounding again in the expanded form's GEMM changes nothing."""
        if self.kv_b_proj.weight.dtype != FP8_DTYPE:
            return kv_c
        group_size = self.kv_b_proj.linear_method.block_size[1]
        return dequantize_per_token_group(*per_token_group_quant_fp8(kv_c, group_size), group_size).to(kv_c.dtype)

    def _query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """-> [num_tokens, num_heads * qk_head_dim]."""
        if self.q_lora_rank is None:
            return self.q_proj(hidden_states)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))

    # ---- attention over the latent cache --------------------------------------------------

    def _attention(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope], kv_c [T, rank], k_pe [T, rope] -> [T, H, v]."""
        md = get_forward_context().attn_metadata
        if md is None:  # a profiling or warm-up run: the batch as one causal sequence
            return self._causal_attention(torch.cat((q_nope, q_pe), dim=-1), *self._up_projected(kv_c, k_pe))
        if self.kv_cache is None:
            raise RuntimeError("attention ran with metadata but no KV cache bound to the layer")
        concat_and_cache_mla(kv_c, k_pe, self.kv_cache, md.slot_mapping)
        if md.is_decode_only:  # every row one request: device tensors only (CUDA-graph safe)
            return self._absorbed_decode(q_nope, q_pe, md.block_tables, md.seq_lens, md.max_seq_len)
        return self._mixed(q_nope, q_pe, kv_c, k_pe, md)

    def _mixed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """A batch with prefill chunks: decode rows absorbed, each prefill chunk expanded."""
        plan = step_plan(md, self.kv_cache.shape[2])  # type: ignore[union-attr]
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_head_dim)  # padding rows stay zero
        if plan.decode_rows.numel() > 0:
            rows = plan.decode_rows
            out[rows] = self._absorbed_decode(
                q_nope[rows], q_pe[rows], plan.decode_block_tables, plan.decode_seq_lens, md.max_seq_len
            )
        query = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, qk_head_dim]
        step_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        for i, (start, end, seq_len) in enumerate(plan.prefills):
            if seq_len == end - start:  # a fresh prompt: its latents are this step's rows
                # One up-projection of the step's rows serves every fresh prompt in it.
                step_kv = step_kv or self._up_projected(kv_c, k_pe)
                key, value = step_kv[0][start:end], step_kv[1][start:end]
            else:
                key, value = self._up_projected(*self._cached_latents(plan.prefill_block_tables[i], seq_len))
            out[start:end] = self._causal_attention(query[start:end], key, value)
        return out

    def _cached_latents(self, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's first `seq_len` latents from the cache -> (kv_c [S, rank], k_pe [S, rope])."""
        assert self.kv_cache is not None
        block_size = self.kv_cache.shape[2]
        blocks = self.kv_cache[0, block_table[: -(-seq_len // block_size)], :, 0]  # [nb, block_size, latent]
        latents = blocks.flatten(0, 1)[:seq_len]  # [S, kv_lora_rank + rope]
        return latents[:, : self.kv_lora_rank], latents[:, self.kv_lora_rank :]

    def _up_projected(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expanded form's keys and values of S latents: kv_c [S, rank], k_pe [S, rope] ->
        key [S, H, qk_head_dim], value [S, H, v]."""
        seq_len = kv_c.shape[0]  # the cache holds latents in the activations' dtype
        kv = self.kv_b_proj(kv_c).view(seq_len, self.num_heads, -1)  # [S, H, nope + v]
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe[:, None, :].expand(seq_len, self.num_heads, self.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), value

    def _causal_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One request's Q new tokens (its last positions) over its S positions: query [Q, H, qk],
        key [S, H, qk], value [S, H, v] -> [Q, H, v]."""
        # The new tokens are the last Q of the S positions: the causal diagonal is aligned
        # bottom-right (SDPA's is_causal aligns it top-left).
        causal = causal_lower_right(query.shape[0], key.shape[0])
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, H, len, dim]
        with sdpa_kernel(PREFILL_BACKENDS) if query.is_cuda else nullcontext():
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=self.scale)
        return attn[0].transpose(0, 1)  # [Q, H, v]

    def _absorbed_decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """One new token per request, attending over the cached latents: q_nope [R, H, nope],
        q_pe [R, H, rope] -> [R, H, v]."""
        w_uk, w_uv = self._up_projections(q_nope.dtype)  # [H, nope, rank], [H, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [R, H, rank]
        query = torch.cat((q_latent, q_pe), dim=-1)  # [R, H, rank + rope]
        assert self.kv_cache is not None
        latent_out = mla_decode(
            query, self.kv_cache, block_tables, seq_lens, max_seq_len, self.kv_lora_rank, self.scale
        )
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [R, H, v]

    def _up_projections(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank]: views of this rank's kv_b_proj weight
        (views, so an in-place weight update reaches them), or of its dequantized copy when the
        weight is block-wise fp8."""
        weight = self.kv_b_proj.weight
        if weight.dtype == FP8_DTYPE:
            weight = self._dequantized_kv_b(dtype)
        per_head = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]

    def _dequantized_kv_b(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's fp8 blocks times their scales, in the activations' dtype, made once and
        again only after the weight or its scales change in place (torch counts such writes in
        `_version`). The absorbed product needs the matrix itself, not a GEMM with it; DeepSeek-V3
        keeps this one matrix per layer in bf16 this way (128 heads x 256 x 512, 32 MiB)."""
        weight, scale_inv = self.kv_b_proj.weight, self.kv_b_proj.weight_scale_inv
        key = (weight.data_ptr(), weight._version, scale_inv.data_ptr(), scale_inv._version, dtype)
        if self._kv_b_cache is None or self._kv_b_cache[0] != key:
            block_size = self.kv_b_proj.linear_method.block_size
            dequantized = dequantize_block_fp8(weight, scale_inv, block_size).to(dtype)
            if self._kv_b_cache is not None and self._kv_b_cache[1].dtype == dtype:
                dequantized = self._kv_b_cache[1].copy_(dequantized)  # in place: captured graphs read it
            self._kv_b_cache = (key, dequantized)
        return self._kv_b_cache[1]

    @torch.inference_mode()
    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compile the latent decode kernel's variants before serving (GPU; the runner calls
        this once the cache is bound; queries come in the cache's dtype, the activations')."""
        if self.kv_cache is not None:
            warm_up_mla_decode(self.kv_cache, self.num_heads, self.kv_lora_rank, self.kv_cache.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}"
        )

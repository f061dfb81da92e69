"""`ModelRunner`: turns a `SchedulerOutput` into one forward pass and sampled tokens.

Each step: apply the scheduler's diffs to the persistent `InputBatch`; gather the flat batch
(token ids, positions, slot mapping, block tables) with numpy; run the model under the step's
attention metadata; compute logits only where a token is sampled (or prompt logprobs are
wanted); sample.

On a GPU the inputs land in persistent device buffers (`StepBuffers`), and pure-decode steps
replay CUDA graphs (`CudaGraphRunner`) unless `enforce_eager`; so do speculative decoding's
verification steps, padded to k + 1 tokens a request (`VerifyGraphRunner`, verify_graphs.py).

A step's sampled tokens stay on the device until `SampledStep.result()` reads them back, so
with async scheduling the engine prepares and launches the next step first. That next step may
include a request whose last token the host does not know yet: its input is taken on the device
from the previous step's samples (`_pending_token_arrays`).

With pipeline parallelism a stage after the first receives the previous stage's hidden states
and residual before its forward, and a stage before the last sends its own after; only the last
stage computes logits and samples.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from shoal.config import EngineConfig
from shoal.distributed.parallel_state import get_pp_group, get_tp_group
from shoal.forward_context import AttentionMetadata, set_forward_context
from shoal.kernels import fresh_prefill_attention
from shoal.layers.mla import MLAAttention
from shoal.lora.slots import LoRASlots
from shoal.sampling_params import SamplingParams
from shoal.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from shoal.workers.cuda_graphs import CudaGraphRunner, capture_sizes, padding_rows, round_up_to_size
from shoal.workers.grammar_bitmask import StructuredSampling
from shoal.workers.input_batch import InputBatch, RequestState
from shoal.workers.logprobs_mode import prompt_values
from shoal.workers.routed_experts import RoutedExpertsRecorder
from shoal.workers.sampler import (
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    temperatures_only,
    top_logprobs,
)
from shoal.workers.spec_decode_step import SpeculativeStep
from shoal.workers.step_buffers import StepBuffers
from shoal.workers.step_output import DeferredStep, FinishedStep, SampledStep
from shoal.workers.verify_graphs import (
    VerificationPadding,
    VerifyGraphRunner,
    no_fresh_prompts,
    pad_verification,
    verification_capture_sizes,
    verification_graph_size,
)

logger = logging.getLogger(__name__)

# What one pipeline stage hands the next (the models' intermediate tensors), in send order.
INTERMEDIATE_TENSOR_NAMES = ("hidden_states", "residual")


@dataclass
class StepInputs:
    """The flat model inputs of one step, and which rows of the output to use."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    # Requests that sample this step (their prompt is complete), their input batch rows, and
    # their last token's row.
    sampling_req_ids: list[str]
    sampling_slots: np.ndarray
    # A plain batch's sampling metadata, loaded with the inputs (None: build it from the states).
    sampling_metadata: SamplingMetadata | None
    logits_indices: np.ndarray
    # Requests that want prompt logprobs: (req_id, rows, target token ids) computed this step.
    prompt_logprob_rows: list[tuple[str, np.ndarray, np.ndarray]]
    # A verification step laid out for a verification graph (verify_graphs.py): the tensors and
    # the metadata above are the padded batch's, the logits indices point into it.
    padding: VerificationPadding | None = None


@dataclass
class _LogitsOfStep:
    """A step's results before sampling."""

    inputs: StepInputs
    states: list[RequestState]
    logits: torch.Tensor | None
    prompt_logprobs: dict[str, tuple[torch.Tensor, ...]]
    step_id: int


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.model_config = config.model_config
        self.dtype: torch.dtype = getattr(torch, config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        self.input_batch = InputBatch(
            max_num_reqs=config.scheduler_config.max_num_seqs,
            max_model_len=max_model_len,
            max_blocks_per_req=-(-max_model_len // self.block_size),
            device=device,
        )
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        scheduler_config = config.scheduler_config
        self.buffers = StepBuffers(
            max_num_tokens=max(scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs),
            max_num_reqs=scheduler_config.max_num_seqs,
            max_blocks_per_req=self.max_blocks_per_req,
            device=device,
        )
        self.sampler = Sampler(config.model_config.logprobs_mode)
        # Structured output: a step's grammar bitmask, and a step whose bitmask follows it.
        self.structured: StructuredSampling[_LogitsOfStep] = StructuredSampling(scheduler_config.max_num_seqs, device)
        # The row counts the LM head runs at (see `_logits`): the decode graphs' batch sizes.
        self.logits_row_counts = capture_sizes(scheduler_config.max_num_seqs)
        self.model: torch.nn.Module | None = None
        # Mixture-of-experts models: the routers' choices for the requests that ask for them;
        # a step that records them runs eagerly (the routers' hooks must run).
        self.routed_experts: RoutedExpertsRecorder | None = None
        self.records_routing = False
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CudaGraphRunner | None = None
        # Speculative decoding's verification steps (k + 1 tokens a request), replayed likewise.
        self.verify_graphs: VerifyGraphRunner | None = None
        # The last step's sampled tokens on the device, and by input batch row (slot) the row
        # in them that was sampled for its request (-1: none).
        self.prev_sampled: torch.Tensor | None = None
        self.prev_sampled_rows = np.full(scheduler_config.max_num_seqs, -1, dtype=np.int64)
        # Speculative decoding: drafts into the batch, verification, the proposer (None: off).
        spec = config.speculative_config
        self.speculation: SpeculativeStep | None = SpeculativeStep(spec, self) if spec is not None else None
        # Multi-LoRA: the adapters' slots and each step's token -> slot map (shoal/lora/slots.py).
        self.lora: LoRASlots | None = None

    @property
    def is_sampling_rank(self) -> bool:
        """Only the last pipeline stage's first tensor-parallel rank returns tokens."""
        return get_pp_group().is_last_rank and get_tp_group().is_first_rank

    # ---- model and KV cache ----------------------------------------------------------------

    def load_model(self) -> None:
        from shoal.models.loader import get_model

        self.model = get_model(self.model_config, self.device, self.config.parallel_config)
        if self.speculation is not None:
            self.speculation.load_model(self.model)
        if self.config.lora_config is not None:
            self.lora = LoRASlots(
                self.model,
                self.config.lora_config,
                self.model_config.num_layers,
                self.dtype,
                self.device,
                max(self.config.scheduler_config.max_num_batched_tokens, self.config.scheduler_config.max_num_seqs),
                skip_idle_steps=self.device.type != "cuda" or self.model_config.enforce_eager,
                grouped_min_tokens=self.config.scheduler_config.max_num_seqs + 1,
            )
        self.routed_experts = RoutedExpertsRecorder.for_model(self.model, self.model_config.num_layers)

    def kv_cache_block_bytes(self) -> int:
        """Bytes of one KV block across this worker's attention layers, by each layer's
        `kv_cache_spec` (K and V per KV head; MLA's one latent)."""
        drafter_bytes = self.speculation.kv_cache_block_bytes() if self.speculation is not None else 0
        return drafter_bytes + sum(
            layer.kv_cache_spec.block_bytes(self.block_size, self.dtype) for layer in self._model.attention_layers()
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's cache of the shape its `kv_cache_spec` gives (standard attention:
        [2, num_blocks, block_size, num_kv_heads, head_dim], index 0 keys, 1 values), and bind it
        to the layer."""
        self.kv_caches = []
        for layer in self._model.attention_layers():
            cache = layer.kv_cache_spec.allocate(num_blocks, self.block_size, self.dtype, self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        if self.speculation is not None:  # the drafter's, same blocks (sleep frees it with these)
            self.kv_caches.extend(self.speculation.initialize_kv_cache(num_blocks))

    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (GPU, one pipeline stage, unless enforce_eager)."""
        if self.device.type != "cuda" or self.model_config.enforce_eager or get_pp_group().world_size > 1:
            return
        # With speculative decoding the decode graphs serve the steps without drafts (speculation
        # switched off by batch size or acceptance, or nothing to propose), the verification
        # graphs the steps with drafts.
        self.cuda_graphs = CudaGraphRunner(
            self._model, self.buffers, self.config.scheduler_config.max_num_seqs, self.model_config.max_model_len
        )
        self.cuda_graphs.capture()
        self.verify_graphs = self._verify_graph_runner()
        if self.verify_graphs is not None:  # in the decode graphs' memory: one replays at a time
            self.verify_graphs.capture(self.cuda_graphs.pool)

    def _verify_graph_runner(self) -> VerifyGraphRunner | None:
        """Verification graphs, when the step's drafts can be replayed: not with LoRA (its token
        map follows the unpadded batch) nor MLA (its attention over several query tokens loops
        over the requests on the host)."""
        spec = self.config.speculative_config
        if spec is None or self.lora is not None:
            return None
        if any(isinstance(layer, MLAAttention) for layer in self._model.attention_layers()):
            return None
        query_len = spec.num_speculative_tokens + 1
        if query_len + 1 > self.model_config.max_model_len:  # a padding request's context
            return None
        scheduler_config = self.config.scheduler_config
        sizes = verification_capture_sizes(
            scheduler_config.max_num_seqs,
            spec.disable_by_batch_size,
            query_len,
            self.buffers["input_ids"].shape[0],
        )
        if not sizes:
            return None
        return VerifyGraphRunner(self._model, self.buffers, sizes, query_len, self.model_config.max_model_len)

    def drop_cuda_graphs(self) -> None:
        """Forget the decode and verification graphs (the tensors whose addresses they hold are
        about to move); `capture_cuda_graphs` makes new ones."""
        self.cuda_graphs = None
        self.verify_graphs = None

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Run every module's `warm_up_kernels(max_num_tokens)` hook (GPU): a mixture-of-experts
        layer compiles its Triton kernels for every launch configuration that steps of up to
        `max_num_batched_tokens` tokens can pick, so that no step of a run compiles one."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        max_num_tokens = self.config.scheduler_config.max_num_batched_tokens
        hooks = [m.warm_up_kernels for m in self._model.modules() if callable(getattr(m, "warm_up_kernels", None))]
        for warm_up in hooks:
            warm_up(max_num_tokens)
        if hooks:
            torch.cuda.synchronize(self.device)
            logger.info("Warmed up the kernels of %d layers in %.1f s", len(hooks), time.perf_counter() - start)

    @torch.inference_mode()
    def warm_up_logits(self) -> None:
        """Run the LM head once at every row count `_logits` pads to (GPU, last stage), so that
        no step of a run meets a GEMM shape for the first time."""
        if self.device.type == "cuda" and get_pp_group().is_last_rank:
            self._run_lm_head_at_every_row_count()
            torch.cuda.synchronize(self.device)

    def _run_lm_head_at_every_row_count(self) -> None:
        hidden_size = int(self.model_config.hf_config.hidden_size)
        hidden = torch.zeros(self.logits_row_counts[-1], hidden_size, dtype=self.dtype, device=self.device)
        for num_rows in self.logits_row_counts:
            self._model.compute_logits(hidden[:num_rows])

    @torch.inference_mode()
    def profile_available_kv_cache_memory(self, device_used_at_start_bytes: int = 0) -> int:
        """Run a dummy step of `max_num_batched_tokens` tokens (and the sampler over
        `max_num_seqs` rows) to measure peak activation memory; returns the bytes left for the
        KV cache in the engine's share (see `gpu_memory.py`; `device_used_at_start_bytes`: what
        the device held when this worker started, others' memory not charged to the engine)."""
        from shoal.workers.gpu_memory import kv_cache_budget_bytes

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_step(self.config.scheduler_config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        utilization = self.config.cache_config.gpu_memory_utilization
        return kv_cache_budget_bytes(self.device, utilization, peak, device_used_at_start_bytes)

    def _dummy_step(self, num_tokens: int) -> None:
        """A forward over `num_tokens` prompt tokens that writes no KV (slots -1) and reads a
        one-block scratch cache, then logits and a top-p sampler pass over up to max_num_seqs rows.
        No step holds more than max_num_seqs sequences of max_model_len tokens, so neither does
        this one (the step buffers have room for max_num_seqs sequences)."""
        max_len = self.model_config.max_model_len
        num_tokens = min(num_tokens, self.config.scheduler_config.max_num_seqs * max_len)
        query_lens = np.array([min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)])
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
        positions = np.concatenate([np.arange(n) for n in query_lens])
        block_tables = np.zeros((len(query_lens), self.max_blocks_per_req), dtype=np.int32)
        views = self.buffers.load(
            input_ids=np.zeros(num_tokens, dtype=np.int64),
            positions=positions,
            **self._attention_arrays(
                query_start_loc, query_lens, block_tables, np.full(num_tokens, -1, dtype=np.int64)
            ),
        )
        metadata = self._attention_metadata(query_start_loc, query_lens, views)
        for layer in self._model.attention_layers():
            layer.kv_cache = layer.kv_cache_spec.allocate(1, self.block_size, self.dtype, self.device)
        with set_forward_context(metadata):
            hidden_states = self._model(views["input_ids"], views["positions"])
        if isinstance(hidden_states, tuple):  # with an EAGLE-3 head's features after them
            hidden_states = hidden_states[0]
        if get_pp_group().is_last_rank:
            num_rows = min(self.config.scheduler_config.max_num_seqs, num_tokens)
            logits = self._model.compute_logits(hidden_states[:num_rows])
            states = [RequestState(str(i), i, 1, SamplingParams(top_p=0.9), None, None) for i in range(num_rows)]
            self.sampler(logits, build_sampling_metadata(states, logits.shape[-1], self.device))
        for layer in self._model.attention_layers():
            layer.kv_cache = None

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | SampledStep | FinishedStep | None:
        """Run one step. With `non_block` return as soon as it is launched: a `SampledStep`
        whose `result()` waits for the device and reads the sampled tokens back."""
        slots = self.input_batch.update(scheduler_output)
        asking = self._asking_for_routed_experts(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            empty = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], step_id=scheduler_output.step_id)
            return FinishedStep(empty) if non_block else empty
        if self.speculation is not None:
            self.speculation.write_drafts(scheduler_output)
        inputs = self._prepare_inputs(scheduler_output, slots)
        if self.speculation is not None:
            inputs = self.speculation.lay_out(inputs, scheduler_output)
        hidden_states = self._forward_recording_routing(inputs, asking) if asking else self._forward(inputs)
        if not get_pp_group().is_last_rank:
            self._send_intermediate_tensors(hidden_states)
            return None
        if self.speculation is not None:  # verified and drafted: the tokens are on the host
            output = self.speculation.sample(inputs, hidden_states, scheduler_output, slots)
            return FinishedStep(output) if non_block and output is not None else output
        step = self._sample(inputs, hidden_states, scheduler_output)
        if step is None:
            return None
        if not non_block:
            assert not isinstance(step, DeferredStep), "a step whose bitmask follows is launched with non_block"
            return step.result()
        return step

    def _forward(self, inputs: StepInputs) -> torch.Tensor | dict[str, torch.Tensor]:
        """The model on this step's batch: a CUDA-graph replay for a captured decode size (its
        padding rows after the batch's), else an eager forward (receiving the previous pipeline
        stage's tensors first)."""
        md = inputs.attn_metadata
        if inputs.padding is not None:
            assert self.verify_graphs is not None
            return self.verify_graphs.replay(inputs.padding.size, md)
        size = self._graph_size(md.num_reqs, md.num_tokens)
        if size is not None:
            assert self.cuda_graphs is not None
            return self.cuda_graphs.replay(size)
        intermediate_tensors = self._recv_intermediate_tensors(md.num_tokens)
        with set_forward_context(md):
            return self._model(inputs.input_ids, inputs.positions, intermediate_tensors)

    def _asking_for_routed_experts(self, scheduler_output: SchedulerOutput) -> list[int]:
        """The batch indices of the step's requests whose routed experts are recorded (on the
        rank that returns tokens); usually none."""
        recorder = self.routed_experts
        if recorder is None or not self.is_sampling_rank:
            return []
        recorder.update(scheduler_output)
        asking = recorder.asking_in(scheduler_output.scheduled_req_ids)
        self.records_routing = bool(asking)
        return asking

    def _forward_recording_routing(
        self, inputs: StepInputs, asking: list[int]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The forward, with the routers' top-k ids kept for the requests at `asking`."""
        assert self.routed_experts is not None
        with self.routed_experts.capture(True) as captured:
            hidden_states = self._forward(inputs)
        md = inputs.attn_metadata
        query_start_loc = md.query_start_loc_cpu.tolist()
        first_positions = (md.seq_lens_cpu - md.query_start_loc_cpu.diff()).tolist()
        self.routed_experts.keep_rows(captured, inputs.req_ids, asking, query_start_loc, first_positions)
        return hidden_states

    def _recv_intermediate_tensors(self, num_tokens: int) -> dict[str, torch.Tensor] | None:
        """The previous pipeline stage's {"hidden_states", "residual"}, each [num_tokens,
        hidden_size]; None on the first stage."""
        pp = get_pp_group()
        if pp.is_first_rank:
            return None
        shape = (num_tokens, self.model_config.hf_config.hidden_size)
        return {
            name: pp.recv(torch.empty(shape, dtype=self.dtype, device=self.device), pp.rank_in_group - 1)
            for name in INTERMEDIATE_TENSOR_NAMES
        }

    def _send_intermediate_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Send this stage's {"hidden_states", "residual"} to the next stage, in the order it
        receives them."""
        pp = get_pp_group()
        for name in INTERMEDIATE_TENSOR_NAMES:
            pp.send(tensors[name], pp.rank_in_group + 1)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput, slots: np.ndarray) -> StepInputs:
        """The step's flat inputs; `slots` holds each scheduled request's row of the input batch,
        in batch order."""
        self.buffers.begin_step()
        batch = self.input_batch
        req_ids = scheduler_output.scheduled_req_ids
        num_scheduled = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(slots))
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if self.lora is not None:
            self.lora.prepare_step(scheduler_output, num_scheduled)

        # Token t belongs to request req_index[t] and sits at positions[t] in its sequence.
        req_index = np.repeat(np.arange(len(req_ids)), num_scheduled)  # [num_tokens]
        start = batch.num_computed_tokens[slots]  # [num_reqs] tokens already in the cache
        positions = np.repeat(start - query_start_loc[:-1], num_scheduled) + np.arange(num_tokens)
        token_slots = slots[req_index]
        input_ids = batch.token_ids[token_slots, positions]
        block_ids = batch.block_table[token_slots, positions // self.block_size]
        slot_mapping = block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = start + num_scheduled  # [num_reqs] context length after this step
        # The rows' first blocks, as many as the longest context needs (the device buffer keeps
        # its full width, so the rows' stride never changes; the kernels read no further).
        block_tables = batch.block_table[slots, : -(-int(seq_lens.max()) // self.block_size)]

        samples = seq_lens >= batch.num_tokens[slots]  # this step completes the known tokens
        all_sample = bool(samples.all())
        sampling_slots = slots if all_sample else slots[samples]
        arrays = {
            "input_ids": input_ids,
            "positions": positions,
            **self._attention_arrays(query_start_loc, seq_lens, block_tables, slot_mapping),
            **self._plain_sampling_arrays(sampling_slots),
            **self._pending_token_arrays(positions, token_slots),
        }
        padding = self._verification_padding(slots, num_scheduled, seq_lens, arrays)
        logits_indices = query_start_loc[1:][samples] - 1
        if padding is not None:  # a verification graph's layout: the step's rows padded
            arrays, query_start_loc, seq_lens = padding.arrays, padding.query_start_loc, padding.seq_lens
            num_tokens, logits_indices = len(arrays["input_ids"]), padding.query_ends[samples] - 1
        views = self._load(num_tokens, arrays)
        if "pending_token_index" in views:
            self._fill_pending_tokens(views)
        attn_metadata = self._attention_metadata(query_start_loc, seq_lens, views)
        if padding is not None:  # as captured: no fresh prompts to look for on the host
            attn_metadata.fresh_prefill_plan = no_fresh_prompts(padding.size)
        return StepInputs(
            req_ids=req_ids,
            input_ids=views["input_ids"],
            positions=views["positions"],
            attn_metadata=attn_metadata,
            sampling_req_ids=req_ids if all_sample else [r for r, s in zip(req_ids, samples.tolist()) if s],
            sampling_slots=sampling_slots,
            sampling_metadata=self._plain_sampling_metadata(arrays, views),
            logits_indices=logits_indices,
            prompt_logprob_rows=self._prompt_logprob_rows(req_ids, start, query_start_loc, num_scheduled),
            padding=padding,
        )

    def _verification_padding(
        self, slots: np.ndarray, num_scheduled: np.ndarray, seq_lens: np.ndarray, arrays: dict[str, np.ndarray]
    ) -> VerificationPadding | None:
        """The step laid out for a verification graph, when it replays one (verify_graphs.py)."""
        graphs = self.verify_graphs
        if graphs is None or self.records_routing or "pending_token_index" in arrays:
            return None
        num_known = num_scheduled - self.input_batch.num_draft_tokens[slots]
        max_model_len = self.model_config.max_model_len
        size = verification_graph_size(
            num_scheduled, num_known, seq_lens, graphs.query_len, graphs.sizes, max_model_len
        )
        if size is None:
            return None
        block_table_rows = self.input_batch.block_table[slots]
        return pad_verification(
            arrays, num_scheduled, seq_lens, block_table_rows, self.block_size, graphs.query_len, size
        )

    def unpadded_metadata(self, padding: VerificationPadding) -> AttentionMetadata:
        """The attention metadata of a padded verification step's real rows, as an eager step
        has it (the drafters' own passes run on it)."""
        arrays = padding.unpadded
        names = ("query_start_loc", "seq_lens", "decode_order", "block_tables", "slot_mapping")
        views = {
            name: torch.from_numpy(np.ascontiguousarray(arrays[name])).to(self.device, self.buffers[name].dtype)
            for name in names
        }
        return self._attention_metadata(arrays["query_start_loc"], arrays["seq_lens"], views)

    def _plain_sampling_arrays(self, sampling_slots: np.ndarray) -> dict[str, np.ndarray]:
        """For a step whose sampling rows are all plain (temperature or greedy only), their
        sampling metadata's host arrays, to load with the inputs; none otherwise."""
        batch = self.input_batch
        if len(sampling_slots) == 0 or not batch.plain[sampling_slots].all():
            return {}
        return {
            "sampling_temperature": batch.temperature[sampling_slots],
            "sampling_greedy": batch.greedy[sampling_slots],
        }

    @staticmethod
    def _plain_sampling_metadata(
        arrays: dict[str, np.ndarray], views: dict[str, torch.Tensor]
    ) -> SamplingMetadata | None:
        """A plain batch's sampling metadata over the device rows its host `arrays` were loaded
        into; None when the batch needs the general build (`build_sampling_metadata`)."""
        if "sampling_greedy" not in arrays:
            return None
        greedy = arrays["sampling_greedy"]
        return temperatures_only(
            views["sampling_temperature"], views["sampling_greedy"], bool(greedy.all()), bool(greedy.any())
        )

    def _graph_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The captured batch size a step replays at: a decode (one token per request) within
        the captured sizes; None when it runs eagerly."""
        if self.cuda_graphs is None or num_tokens != num_reqs or self.records_routing:
            return None
        return self.cuda_graphs.padded_size(num_reqs)

    def _load(self, num_tokens: int, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Load the step's host arrays into the step buffers; a step that replays a CUDA graph
        loads the graph's padding rows with them (`padding_rows`). Returns the views of the
        step's own rows."""
        num_reqs = len(arrays["seq_lens"])
        size = self._graph_size(num_reqs, num_tokens)
        if size is None or size == num_reqs:
            return self.buffers.load(**arrays)
        pad = padding_rows(num_reqs, size, arrays["block_tables"].shape[1])
        views = self.buffers.load(
            **{name: np.concatenate([a, pad[name]]) if name in pad else a for name, a in arrays.items()}
        )
        return {name: view[: len(arrays[name])] if name in pad else view for name, view in views.items()}

    def _pending_token_arrays(self, positions: np.ndarray, token_slots: np.ndarray) -> dict[str, np.ndarray]:
        """Async scheduling: a request scheduled again before its last sampled token came back
        takes that token from the previous step's samples on the device. The rows of input_ids
        past the tokens the worker knows, and their rows in those samples; none when every
        token is known."""
        batch = self.input_batch
        index = np.flatnonzero(positions >= batch.num_tokens[token_slots] + batch.num_draft_tokens[token_slots])
        if len(index) == 0:
            return {}
        rows = self.prev_sampled_rows[token_slots[index]]  # all -1 while there are no samples
        if (rows < 0).any():
            raise RuntimeError("a step's input token was never sampled: the engine scheduled ahead of two steps")
        return {"pending_token_index": index, "pending_token_rows": rows}

    def _fill_pending_tokens(self, views: dict[str, torch.Tensor]) -> None:
        """Copy the pending tokens from the previous step's samples into input_ids, on the device."""
        assert self.prev_sampled is not None
        sampled = self.prev_sampled[views["pending_token_rows"]]
        views["input_ids"].index_copy_(0, views["pending_token_index"], sampled)

    @staticmethod
    def _attention_arrays(
        query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, slot_mapping: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The host arrays the attention metadata's device tensors are loaded from."""
        return {
            "query_start_loc": query_start_loc,
            "seq_lens": seq_lens,
            # Longest context first, so the decode kernel's long programs start first.
            "decode_order": np.argsort(-seq_lens, kind="stable").astype(np.int32),
            "block_tables": block_tables,
            "slot_mapping": slot_mapping,
        }

    def _attention_metadata(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray, views: dict[str, torch.Tensor]
    ) -> AttentionMetadata:
        """The step's attention metadata over the device `views` its `_attention_arrays` were
        loaded into."""
        query_lens = np.diff(query_start_loc)
        is_decode_only = bool((query_lens == 1).all())
        plans_fresh_prefills = fresh_prefill_attention.BY_SDPA and not is_decode_only
        return AttentionMetadata(
            num_reqs=len(seq_lens),
            num_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            slot_mapping=views["slot_mapping"],
            query_start_loc_cpu=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens_cpu=torch.from_numpy(seq_lens.astype(np.int32)),
            is_decode_only=is_decode_only,
            decode_order=views["decode_order"],
            fresh_prefill_plan=(
                fresh_prefill_attention.plan_fresh_prefills(query_start_loc, seq_lens) if plans_fresh_prefills else None
            ),
        )

    def _prompt_logprob_rows(
        self, req_ids: list[str], start: np.ndarray, query_start_loc: np.ndarray, num_scheduled: np.ndarray
    ) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """For requests that asked for prompt logprobs: the rows whose logits predict a prompt
        token (position p predicts token p + 1), and those target tokens."""
        rows: list[tuple[str, np.ndarray, np.ndarray]] = []
        if not self.input_batch.wants_prompt_logprobs:
            return rows
        for i, req_id in enumerate(req_ids):
            if req_id not in self.input_batch.wants_prompt_logprobs:
                continue
            state = self.input_batch.requests[req_id]
            first, end = int(start[i]), min(int(start[i] + num_scheduled[i]), state.num_prompt_tokens - 1)
            if end <= first:
                continue
            positions = np.arange(first, end)
            targets = self.input_batch.token_ids[state.slot, positions + 1]
            rows.append((req_id, positions - first + query_start_loc[i], targets))
        return rows

    def _sample(
        self, inputs: StepInputs, hidden_states: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> SampledStep | DeferredStep | None:
        """Logits on every tensor-parallel rank of the last stage (the LM head all-gathers
        them); sampling, launched and not read back, only on the rank whose tokens go back to
        the engine (None on the others). A step whose grammar bitmask follows keeps its logits
        until `sample_tokens` brings it."""
        states = [self.input_batch.requests[r] for r in inputs.sampling_req_ids]
        logits = self._logits(hidden_states, inputs.logits_indices, inputs.attn_metadata.num_tokens) if states else None
        prompt_logprobs = self._prompt_logprobs(inputs, hidden_states)
        if not self.is_sampling_rank:
            return None
        step = _LogitsOfStep(inputs, states, logits, prompt_logprobs, scheduler_output.step_id)
        if scheduler_output.grammar_follows:
            return self.structured.defer(step)
        return self._sample_logits(step, scheduler_output.grammar)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarBitmask | None) -> None:
        """Sample the step whose logits wait for their grammar bitmask; its `DeferredStep`
        then reads the tokens back like any step."""
        step, deferred = self.structured.take_deferred()
        deferred.step = self._sample_logits(step, grammar)

    def _sample_logits(self, step: _LogitsOfStep, grammar: GrammarBitmask | None) -> SampledStep:
        inputs, states, logits = step.inputs, step.states, step.logits
        result = None
        if logits is not None:
            metadata = self.sampling_metadata(inputs, states, logits.shape[-1])
            if grammar is not None:
                metadata = self.structured.apply(metadata, grammar, inputs.sampling_req_ids)
            result = self.sampler(logits, metadata)
        self.keep_samples(inputs.sampling_slots, result.sampled_token_ids if result is not None else None)
        routed = self.routed_experts.take_sampled(inputs.sampling_req_ids) if self.routed_experts else {}
        return SampledStep(inputs.req_ids, states, result, step.prompt_logprobs, step.step_id, routed)

    def sampling_metadata(self, inputs: StepInputs, states: list[RequestState], vocab_size: int) -> SamplingMetadata:
        """The step's sampling metadata: a plain batch's came with its inputs; the rest are built
        from the requests' states."""
        return inputs.sampling_metadata or build_sampling_metadata(states, vocab_size, self.device)

    def keep_samples(self, slots: np.ndarray, sampled_token_ids: torch.Tensor | None) -> None:
        """Remember this step's samples on the device, row i sampled for the request in input
        batch row `slots[i]`: the next step's inputs may take them (`_pending_token_arrays`)."""
        self.prev_sampled = sampled_token_ids
        self.prev_sampled_rows.fill(-1)
        if sampled_token_ids is not None:
            self.prev_sampled_rows[slots] = np.arange(len(slots))

    def _logits(self, hidden_states: torch.Tensor, logits_indices: np.ndarray, num_tokens: int) -> torch.Tensor:
        """Logits of the rows `logits_indices`. The LM head runs at the next of
        `logits_row_counts` (padded, sliced back), all of them met at start-up
        (`warm_up_logits`): the first GEMM of a new shape costs the host milliseconds (cuBLAS
        choosing and loading its kernel) while the device waits, and the number of sampling rows
        changes from step to step."""
        num_rows = len(logits_indices)
        padded = round_up_to_size(self.logits_row_counts, num_rows) or num_rows
        if num_rows == num_tokens and hidden_states.shape[0] == padded:
            # A decode (every row samples, in order) whose rows already come padded to the size
            # (a CUDA graph's, or a batch of exactly that size): no gather.
            return self._model.compute_logits(hidden_states)[:num_rows]
        index = np.zeros(padded, dtype=np.int64)  # the padding repeats row 0
        index[:num_rows] = logits_indices
        return self._model.compute_logits(hidden_states[self._to_device(index)])[:num_rows]

    def _prompt_logprobs(self, inputs: StepInputs, hidden_states: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
        """Per request: (token ids, logprobs, ranks) of its prompt rows, on the device."""
        result = {}
        for req_id, rows, targets in inputs.prompt_logprob_rows:
            num_logprobs = self.input_batch.requests[req_id].sampling_params.prompt_logprobs or 0
            logits = self._model.compute_logits(hidden_states[self._to_device(rows)])
            logprobs = prompt_values(self.sampler.logprobs_mode, logits)  # [num_rows, vocab]
            target = self._to_device(targets)[:, None]
            target_lp = logprobs.gather(-1, target)
            ranks = (logprobs > target_lp).sum(dim=-1) + 1
            top_lp, top_ids = top_logprobs(logprobs, num_logprobs)
            result[req_id] = (torch.cat([target, top_ids], dim=-1), torch.cat([target_lp, top_lp], dim=-1), ranks)
        return result

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @property
    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("the model is not loaded")
        return self.model

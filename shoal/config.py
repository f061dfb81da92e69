"""Engine configuration: frozen dataclasses grouped by concern, built once from `EngineArgs`.

Config never changes after it is built. Facts found at run time (the number of KV blocks, the
eos id) travel in their own objects, never written back here. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from shoal.spec_decode.config import SpeculativeConfig

from shoal.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]
DTYPES = ("float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")
EXECUTOR_BACKENDS = ("uni", "ray")
# How Ray spreads an engine's worker bundles over nodes (Ray's placement-group strategies).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# What returned logprobs are (vLLM's names): shoal/workers/logprobs_mode.py.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs, in which dtype, and how long its sequences may be."""

    model: str
    tokenizer: str
    served_model_name: str
    dtype: str
    max_model_len: int
    hf_config: Any = field(repr=False, compare=False)
    architecture: str
    vocab_size: int
    seed: int
    load_format: str = "auto"
    enforce_eager: bool = False
    quantization: str | None = None
    # Every token's result independent of the batch it runs in (docs/batch_invariance.md).
    batch_invariant: bool = False
    # On a GPU: weights and KV cache in memory pools that keep their addresses across
    # sleep / wake_up, so the CUDA graphs need no recapture (see shoal/workers/sleep.py).
    enable_sleep_mode: bool = False
    # What returned logprobs are (vLLM's names; shoal/workers/logprobs_mode.py).
    logprobs_mode: str = "raw_logprobs"

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, prefix caching and how much memory it may take."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # CPU: the KV cache's size in bytes. GPU: overrides the profiled size when given.
    kv_cache_memory_bytes: int | None = None
    # Forces the number of KV blocks (tests use it to force preemption).
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    # The host-memory tier under the prefix cache, in bytes (0: none; shoal/kv_transfer/host_tier.py).
    kv_offload_bytes: int = 0
    # Prefill/decode disaggregation: this engine saves ("prefill"), loads ("decode") or both the KV
    # of requests that carry transfer params (shoal/kv_transfer/pd_connector.py); None: neither.
    kv_transfer_role: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """The token budget of one step and the most requests running at once."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Schedule step N+1 while step N runs on the device (see docs/async_scheduling.md).
    async_scheduling: bool = False
    # LoRA: the most adapters running at once (None: no adapters; see lora_admission.py).
    max_loras: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism, and the executor that drives the workers."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    # Layers per pipeline stage; None splits them as evenly as possible.
    pipeline_layer_partition: tuple[int, ...] | None = None
    ray_address: str | None = None
    # Seconds to wait for the placement group before failing with the missing resources.
    placement_group_timeout_s: float = 120.0
    # PACK: as few nodes as possible, so a tensor-parallel group shares a node and pipeline
    # stages go to other nodes only when one is full (see ray_utils.order_bundles).
    placement_strategy: str = "PACK"
    # Ray workers that die are re-created, at most this many times within any window of
    # `worker_restart_window_s` seconds; one more death shuts the engine down (0: never restart).
    max_worker_restarts: int = 3
    worker_restart_window_s: float = 3600.0
    # Mixture-of-experts layers: whole experts split across the tensor-parallel ranks instead of
    # every expert's intermediate dimension (docs/moe.md). Set only for MoE architectures.
    enable_expert_parallel: bool = False
    # Colocated training (docs/rl.md, "Placement for colocated training"): a placement group the
    # caller made (a Ray PlacementGroup, or the name of one), which the engine uses and never
    # removes; the bundles of it the workers take, in rank order; a worker's share of a GPU
    # (or, on CPU, its logical CPUs).
    placement_group: Any = field(default=None, compare=False, repr=False)
    bundle_indices: tuple[int, ...] | None = None
    num_gpus_per_worker: float = 1.0
    num_cpus_per_worker: float = 1.0
    # "pkg.module:Class": a mixin added to every worker, whose methods collective_rpc can call
    # (shoal/workers/extension.py).
    worker_extension_cls: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md): how many adapters one step may mix (`max_loras`, the
    GPU slots), the largest rank a slot holds, how many loaded adapters the CPU cache keeps."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    # The adapters' weights' dtype ("auto": the model's).
    lora_dtype: str = "auto"
    # Column-parallel layers: A split on its rank dimension too; row-parallel: B split on output.
    fully_sharded_loras: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    device: Device = "cpu"


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start, grouped by concern."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    # Speculative decoding (docs/spec_decode.md); None: none.
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: no adapters (enable_lora=False)
    # Publishing KV-cache events (shoal/kv_events/); None: off.
    kv_events_config: KVEventsConfig | None = None


@dataclass
class EngineArgs:
    """The user-facing engine arguments (the `LLM(...)` keywords and `shoal serve` flags)."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # Blocks evicted from the prefix cache are kept in this much host memory (0: not kept).
    kv_offload_bytes: int = 0
    # Prefill/decode disaggregation: "prefill", "decode" or "both" (None: the engine moves no KV).
    kv_transfer_role: str | None = None
    load_format: str = "auto"
    seed: int = 0
    device: str = "auto"
    enforce_eager: bool = False
    enable_sleep_mode: bool = False
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pipeline_layer_partition: tuple[int, ...] | None = None
    ray_address: str | None = None
    placement_strategy: str = "PACK"
    max_worker_restarts: int = 3
    worker_restart_window_s: float = 3600.0
    # None: on for one GPU worker, off otherwise.
    async_scheduling: bool | None = None
    # MoE models: split whole experts across the tensor-parallel ranks (vLLM's flag).
    enable_expert_parallel: bool = False
    # Colocated training: the caller's Ray placement group (or its name), the bundles the
    # workers take in rank order, and each worker's share of a GPU / number of CPUs.
    placement_group: Any = None
    bundle_indices: tuple[int, ...] | None = None
    num_gpus_per_worker: float = 1.0
    num_cpus_per_worker: float = 1.0
    # "pkg.module:Class": a mixin added to every worker, for collective_rpc (RL frameworks).
    worker_extension_cls: str | None = None
    # Speculative decoding: a dict of SpeculativeConfig's keys, its JSON, or a SpeculativeConfig.
    speculative_config: Any = None
    # Multi-LoRA serving (vLLM's names; docs/lora.md).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    # What returned logprobs are: raw_logprobs, processed_logprobs, raw_logits, processed_logits.
    logprobs_mode: str = "raw_logprobs"
    # A request's tokens and logprobs bitwise the same alone or in any batch (docs/batch_invariance.md).
    batch_invariant: bool = False
    # KV-cache events for routers (vLLM's `--kv-events-config`): a JSON object, a dict or a
    # `KVEventsConfig` (docs/routing.md).
    kv_events_config: str | dict[str, Any] | KVEventsConfig | None = None

    def create_engine_config(self) -> EngineConfig:
        """Validate the arguments and build the frozen config (raises `ValueError`)."""
        device = _resolve_device(self.device)
        model_config = self._model_config(device)
        max_num_batched_tokens = self.max_num_batched_tokens or (8192 if device == "cuda" else 2048)
        _require(self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
        _require(max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size must be a power of 2 <= 128")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _require(self.kv_offload_bytes >= 0, "kv_offload_bytes must be at least 0")
        _require(
            self.kv_transfer_role in (None, "prefill", "decode", "both"),
            f"kv_transfer_role must be prefill, decode or both, got {self.kv_transfer_role!r}",
        )
        _require(
            not self.kv_offload_bytes or self.enable_prefix_caching,
            "kv_offload_bytes needs prefix caching: the host tier keeps the prefix cache's evicted blocks",
        )
        parallel_config = self._parallel_config(model_config)
        speculative_config = self._speculative_config(model_config, parallel_config)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_offload_bytes=self.kv_offload_bytes,
                kv_transfer_role=self.kv_transfer_role,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=model_config.max_model_len,
                async_scheduling=self._async_scheduling(device, parallel_config, speculative_config),
                max_loras=self.max_loras if self.enable_lora else None,
            ),
            parallel_config=parallel_config,
            device_config=DeviceConfig(device=device),
            speculative_config=speculative_config,
            lora_config=self._lora_config(),
            kv_events_config=KVEventsConfig.parse(self.kv_events_config),
        )

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        max_cpu_loras = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        _require(self.max_loras >= 1, "max_loras must be at least 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank must be at least 1")
        _require(max_cpu_loras >= self.max_loras, "max_cpu_loras must be at least max_loras")
        lora_dtype = _DTYPE_ALIASES.get(self.lora_dtype, self.lora_dtype)
        _require(lora_dtype == "auto" or lora_dtype in DTYPES, f"lora_dtype must be 'auto' or one of {DTYPES}")
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            lora_dtype=lora_dtype,
            fully_sharded_loras=self.fully_sharded_loras,
        )

    def _speculative_config(
        self, model_config: ModelConfig, parallel_config: ParallelConfig
    ) -> SpeculativeConfig | None:
        """The speculative config, checked against the target before anything loads."""
        if self.speculative_config is None:
            return None
        from shoal.spec_decode.config import SpeculativeConfig

        config = self.speculative_config
        if not isinstance(config, SpeculativeConfig):
            config = SpeculativeConfig.from_json(config)
        config.validate_against(model_config, parallel_config)
        # Not yet combined: the drafter has no adapters, and the token -> adapter map of a step
        # does not cover the verified drafts (docs/spec_decode.md, "What composes").
        _require(not self.enable_lora, "speculative_config cannot be combined with enable_lora yet")
        _require(
            self.logprobs_mode == "raw_logprobs",
            "speculative_config returns raw logprobs only for now: logprobs_mode must be 'raw_logprobs'",
        )
        # The drafts are made on the last stage after sampling; with pp steps in flight the
        # next step of a request is scheduled before they exist (docs/spec_decode.md).
        _require(
            parallel_config.pipeline_parallel_size == 1,
            "speculative decoding does not run with pipeline parallelism (pipeline_parallel_size must be 1)",
        )
        # A model drafter is built of shoal's tensor-parallel layers: it is sharded like the
        # target and runs on every rank (the sampling rank sends the emitted tokens).
        tp = parallel_config.tensor_parallel_size
        _require(
            config.method == "ngram" or config.draft_tensor_parallel_size in (None, tp),
            f"speculative_config draft_tensor_parallel_size must be the target's ({tp}) for now: "
            "the drafter is sharded like the target",
        )
        return config

    def _async_scheduling(
        self, device: Device, parallel_config: ParallelConfig, speculative_config: SpeculativeConfig | None = None
    ) -> bool:
        """Async scheduling feeds each step's sampled tokens to the next step on the device,
        which one worker can do; with several, every rank would need the same tokens. A step's
        drafts depend on the previous step's accepted tokens, so speculation turns it off."""
        single_worker = parallel_config.world_size == 1
        if speculative_config is not None:
            if self.async_scheduling:
                logger.warning("async_scheduling is off: speculative decoding drafts from each step's accepted tokens")
            return False
        if self.async_scheduling is None:
            return device == "cuda" and single_worker
        _require(
            single_worker or not self.async_scheduling,
            "async_scheduling needs one worker (tensor_parallel_size = pipeline_parallel_size = 1)",
        )
        return self.async_scheduling

    def _model_config(self, device: Device) -> ModelConfig:
        from shoal.demo_model import DEMO_MODEL_NAME, ensure_demo_model, is_demo_model_dir

        model = self.model
        if model is None:
            model = ensure_demo_model()
        # The demo model answers to its name, however it was given (the README's promise).
        default_name = DEMO_MODEL_NAME if is_demo_model_dir(model) else model
        served = self.served_model_name or default_name
        if not Path(model).is_dir():
            raise ValueError(f"model {model!r} is not a local directory with a config.json")
        hf_config = load_hf_config(model)
        architecture = _architecture(hf_config)
        derived_len = _derived_max_model_len(hf_config)
        max_model_len = self.max_model_len or derived_len
        _require(max_model_len >= 1, "max_model_len must be at least 1")
        if max_model_len > derived_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's maximum of {derived_len} "
                "(max_position_embeddings in config.json)"
            )
        _require(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}")
        quantization = _resolve_quantization(self.quantization, hf_config)
        _require(self.logprobs_mode in LOGPROBS_MODES, f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}")
        return ModelConfig(
            model=model,
            tokenizer=self.tokenizer or model,
            served_model_name=served,
            dtype=_resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_model_len,
            hf_config=hf_config,
            architecture=architecture,
            vocab_size=int(hf_config.vocab_size),
            seed=self.seed,
            load_format=self.load_format,
            enforce_eager=self.enforce_eager or self._eager_for_batch_invariance(hf_config, device),
            enable_sleep_mode=self.enable_sleep_mode,
            quantization=quantization,
            logprobs_mode=self.logprobs_mode,
            batch_invariant=self._batch_invariant(quantization),
        )

    def _batch_invariant(self, quantization: str | None) -> bool:
        if self.batch_invariant:
            _require(quantization is None, "batch_invariant supports float weights only (no quantization)")
            _require(self.kv_cache_dtype == "auto", "batch_invariant needs kv_cache_dtype='auto'")
            # Not yet made invariant: the adapters' grouped products and the drafts' verification.
            _require(not self.enable_lora, "batch_invariant cannot be combined with enable_lora yet")
            _require(self.speculative_config is None, "batch_invariant cannot be combined with speculative_config yet")
        return bool(self.batch_invariant)

    def _eager_for_batch_invariance(self, hf_config: Any, device: Device) -> bool:
        """Batch-invariant experts read each expert's tokens back to the host (their GEMMs' row
        counts), which a CUDA graph cannot replay: a mixture of experts then runs eagerly."""
        has_experts = any(
            getattr(hf_config, key, None) for key in ("n_routed_experts", "num_local_experts", "num_experts")
        )
        if self.batch_invariant and device == "cuda" and has_experts and not self.enforce_eager:
            logger.info("batch_invariant: a mixture-of-experts model runs without CUDA graphs")
            return True
        return False

    def _parallel_config(self, model_config: ModelConfig) -> ParallelConfig:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        _require(tp >= 1 and pp >= 1, "tensor_parallel_size and pipeline_parallel_size must be >= 1")
        placed = self.placement_group is not None or self.bundle_indices is not None
        backend = self.distributed_executor_backend or ("ray" if tp * pp > 1 or placed else "uni")
        _require(backend == "ray" or not placed, "placement_group and bundle_indices need the 'ray' executor")
        bundle_indices = _bundle_indices(self.bundle_indices, tp * pp)
        _require(_is_placement_group(self.placement_group), "placement_group must be a Ray PlacementGroup or its name")
        _require(0.0 < self.num_gpus_per_worker <= 1.0, "num_gpus_per_worker must be in (0, 1]")
        _require(self.num_cpus_per_worker > 0.0, "num_cpus_per_worker must be > 0")
        _require(backend in EXECUTOR_BACKENDS, f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}")
        _require(backend == "ray" or tp * pp == 1, "tensor/pipeline parallelism needs the 'ray' executor")
        _require(
            pp <= model_config.num_layers, f"pipeline_parallel_size={pp} exceeds the {model_config.num_layers} layers"
        )
        _require(self.max_worker_restarts >= 0, "max_worker_restarts must be >= 0")
        _require(
            self.placement_strategy in PLACEMENT_STRATEGIES,
            f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}",
        )
        _require(self.worker_restart_window_s > 0, "worker_restart_window_s must be > 0")
        partition = self.pipeline_layer_partition
        if partition is not None:
            partition = tuple(int(n) for n in partition)
            _require(len(partition) == pp, "pipeline_layer_partition needs one entry per stage")
            _require(all(n >= 1 for n in partition), "each pipeline stage needs at least one layer")
            _require(sum(partition) == model_config.num_layers, "pipeline_layer_partition must sum to the layer count")
        return ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            distributed_executor_backend=backend,
            pipeline_layer_partition=partition,
            ray_address=self.ray_address,
            placement_strategy=self.placement_strategy,
            max_worker_restarts=self.max_worker_restarts,
            worker_restart_window_s=self.worker_restart_window_s,
            enable_expert_parallel=self._expert_parallel(model_config),
            placement_group=self.placement_group,
            bundle_indices=bundle_indices,
            num_gpus_per_worker=float(self.num_gpus_per_worker),
            num_cpus_per_worker=float(self.num_cpus_per_worker),
            worker_extension_cls=self._worker_extension_cls(),
        )

    def _worker_extension_cls(self) -> str | None:
        """The extension's path, checked here (importable, a class, no clash with the worker)
        so that a bad one fails before any worker starts."""
        if self.worker_extension_cls is None:
            return None
        from shoal.workers.extension import worker_class

        worker_class(self.worker_extension_cls)
        return self.worker_extension_cls

    def _expert_parallel(self, model_config: ModelConfig) -> bool:
        """Expert parallelism applies to mixture-of-experts architectures; asked of a dense
        model it changes nothing, and the log says so."""
        from shoal.models.registry import is_moe_architecture

        if self.enable_expert_parallel and not is_moe_architecture(model_config.architecture):
            logger.warning("enable_expert_parallel is ignored: %s has no experts", model_config.architecture)
            return False
        return self.enable_expert_parallel

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _bundle_indices(indices: Any, num_workers: int) -> tuple[int, ...] | None:
    """The bundle of each rank, checked: one per worker, distinct, non-negative (whether the
    group has them is checked against the group, once Ray is reached)."""
    if indices is None:
        return None
    if isinstance(indices, str):  # "2,1", as vLLM's VLLM_RAY_BUNDLE_INDICES spells them
        indices = [part for part in indices.split(",") if part.strip()]
    try:
        result = tuple(int(i) for i in indices)
    except (TypeError, ValueError):
        raise ValueError(f"bundle_indices must be integers, got {indices!r}") from None
    _require(
        len(result) == num_workers, f"bundle_indices {list(result)} must name one bundle per worker ({num_workers})"
    )
    _require(len(set(result)) == len(result), f"bundle_indices {list(result)} name a bundle twice")
    _require(all(i >= 0 for i in result), f"bundle_indices {list(result)} must be >= 0")
    return result


def _is_placement_group(group: Any) -> bool:
    """None, a name, or a Ray PlacementGroup (by its shape: this module does not import Ray)."""
    return group is None or isinstance(group, str) or (hasattr(group, "id") and hasattr(group, "bundle_specs"))


def _resolve_device(device: str) -> Device:
    if device == "cpu":
        return "cpu"
    if device in ("cuda", "gpu"):
        return "cuda"
    if device != "auto":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, hf_config: Any, device: Device) -> str:
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype in DTYPES:
        return dtype
    if dtype != "auto":
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    if device == "cpu":
        return "float32"  # CPU kernels for half types are slow, and float32 matches HF exactly
    checkpoint = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
    checkpoint = checkpoint.replace("torch.", "")
    return checkpoint if checkpoint in ("float16", "bfloat16") else "bfloat16"


def _resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The quantization to run: fp8 when asked for (float weights are quantized after loading) or
    when the checkpoint stores fp8 weights (its `quantization_config`); any other checkpoint
    quantization is refused."""
    _require(requested in (None, "fp8"), "quantization must be None or 'fp8'")
    from shoal.layers.quantization.fp8_config import checkpoint_quantization

    return checkpoint_quantization(hf_config) or requested


def load_hf_config(model: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read the config of model {model!r}: {explain_remote_code(exc)}") from exc


def explain_remote_code(exc: BaseException) -> str:
    """The reason a transformers load failed, in shoal's words when the folder asked to run code
    of its own (transformers' own message suggests trust_remote_code=True, which shoal has not)."""
    if "trust_remote_code" not in str(exc):
        return str(exc)
    return (
        "it asks to run Python code of its own (auto_map in its config.json or tokenizer_config.json), "
        "and shoal never runs code from a model folder (every transformers load passes "
        "trust_remote_code=False); use a model whose architecture transformers and shoal support"
    )


def _architecture(hf_config: Any) -> str:
    from shoal.models.registry import supported_architectures

    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in supported_architectures():
            return name
    raise ValueError(
        f"model architectures {architectures} are not supported; shoal supports {sorted(supported_architectures())}"
    )


def _derived_max_model_len(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 2048

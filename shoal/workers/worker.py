"""`Worker`: one device's share of the engine — device setup, model, KV cache, and steps.

The same class runs in the engine-core process (`UniProcExecutor`) and inside a Ray actor
(`RayExecutor`), one per GPU or CPU bundle. Start-up: `init_device`, then (several workers only)
`init_distributed`, then `load_model`. The RL verbs' worker side (sleep / wake_up:
shoal/workers/sleep.py; weight updates: shoal/workers/weight_updates.py) is reached through `call`
by the paths shoal/rl_verbs.py declares. After a peer's death the survivors `leave_distributed`
and join the new world with the peer's replacement (see docs/fault_tolerance.md).
"""

from __future__ import annotations

import gc
import logging
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shoal import envs, rl_verbs
from shoal.config import EngineConfig
from shoal.distributed import parallel_state
from shoal.distributed.communicator import NcclUniqueId
from shoal.step import GrammarBitmask, KVBlockCopies, SchedulerOutput
from shoal.workers.cpu_threads import default_cpu_threads
from shoal.workers.lora_calls import LoRACalls
from shoal.workers.model_runner import ModelRunner
from shoal.workers.profiler import StepProfiler
from shoal.workers.sleep import KV_CACHE, WEIGHTS, WorkerSleep
from shoal.workers.weight_updates import WeightUpdates

if TYPE_CHECKING:
    from shoal.kv_transfer.host_pool import HostKVPool
    from shoal.kv_transfer.worker_side import KVTransferWorker

logger = logging.getLogger(__name__)

# Default KV-cache size on CPU when `kv_cache_memory_bytes` is not given.
_CPU_KV_CACHE_BYTES = 1 << 30


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        self.sleep_state: WorkerSleep | None = None
        self.profiler = StepProfiler(rank)
        # "<node id>:<bundle index>" in a Ray actor (set by the actor), else None.
        self.placement: str | None = None
        # What the GPU held when this worker started: other processes' (a colocated trainer's)
        # memory, which KV-cache sizing does not charge to the engine (gpu_memory.py).
        self.device_used_at_start_bytes = 0
        self.weight_updates = WeightUpdates(self)
        self.lora_calls = LoRACalls(self)
        # The host-memory tier's blocks (shoal/kv_transfer/host_pool.py), when the engine has one.
        self.host_kv_pool: HostKVPool | None = None
        # Prefill/decode disaggregation's KV transfers (shoal/kv_transfer/worker_side.py), made
        # at the first one.
        self.kv_transfer: KVTransferWorker | None = None

    # ---- start-up ------------------------------------------------------------------------

    def init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            # Ray (or the user) already chose the visible GPUs; never reassign them here.
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            from shoal.workers.gpu_memory import device_used_bytes

            self.device_used_at_start_bytes = device_used_bytes(self.device)
        else:
            torch.set_num_threads(envs.SHOAL_CPU_THREADS or default_cpu_threads())
            logger.info("CPU worker: %d torch threads", torch.get_num_threads())
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)
        self.sleep_state = WorkerSleep(self.model_runner, self.config.model_config.enable_sleep_mode)

    def init_distributed(
        self, init_method: str, nccl_unique_ids: dict[tuple[int, ...], NcclUniqueId] | None = None
    ) -> None:
        """Join the world of `tensor_parallel_size * pipeline_parallel_size` workers (at the same
        time as all of them) and install this worker's tensor- and pipeline-parallel groups."""
        parallel = self.config.parallel_config
        parallel_state.init_distributed_environment(parallel.world_size, self.rank, init_method)
        parallel_state.initialize_model_parallel(
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            self.device,
            nccl_unique_ids,
            enable_expert_parallel=parallel.enable_expert_parallel,
        )

    def load_model(self) -> None:
        with self.sleeper.allocating(WEIGHTS):
            self.runner.load_model()

    def leave_distributed(self) -> None:
        """A peer died and is being re-created: forget every request, the KV cache and the CUDA
        graphs (a fresh `ModelRunner` over the same model), and leave the groups, whose
        communicators include the dead peer. The weights stay; `init_distributed` and
        `initialize_kv_cache` follow, at the same time as on the new peer."""
        model = self.runner.model
        if model is not None:
            for layer in model.attention_layers():
                layer.kv_cache = None  # the old cache goes before the new one is allocated
        # The old runner, and with it its CUDA graphs, goes before the communicators whose calls
        # the graphs captured (NCCL waits for such graphs to be destroyed).
        self.model_runner = None
        parallel_state.destroy_model_parallel()
        self.model_runner = ModelRunner(self.config, self.device)
        self.model_runner.model = model
        self.sleeper.runner = self.model_runner  # (the engine never restarts workers while asleep)

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit in this worker's budget (CPU: a fixed byte budget; GPU:
        profiled from the engine's share of the device left after its weights and peak
        activations, other processes' memory not counted as the engine's: gpu_memory.py)."""
        block_bytes = self.runner.kv_cache_block_bytes()
        configured = self.config.cache_config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            available = configured or self.runner.profile_available_kv_cache_memory(self.device_used_at_start_bytes)
        else:
            available = configured or _CPU_KV_CACHE_BYTES
            available = min(available, self._cpu_kv_bytes_needed(block_bytes))
        num_blocks = available // block_bytes
        logger.info(
            "KV cache budget %.2f GiB → %d blocks (%d tokens)",
            available / 2**30,
            num_blocks,
            num_blocks * self.config.cache_config.block_size,
        )
        return num_blocks

    def _cpu_kv_bytes_needed(self, block_bytes: int) -> int:
        """On CPU, never allocate more than every sequence at full length could use."""
        block_size = self.config.cache_config.block_size
        blocks_per_seq = -(-self.config.model_config.max_model_len // block_size)
        return block_bytes * blocks_per_seq * self.config.scheduler_config.max_num_seqs

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, compile the model's own kernels (GPU), then capture the decode
        CUDA graphs over it and meet the LM head's row counts."""
        with self.sleeper.allocating(KV_CACHE):
            self.runner.initialize_kv_cache(num_blocks)
        kv_offload_bytes = self.config.cache_config.kv_offload_bytes
        if kv_offload_bytes and self.host_kv_pool is None:  # (a restarted worker makes its own)
            from shoal.kv_transfer.host_pool import HostKVPool

            self.host_kv_pool = HostKVPool.for_budget(lambda: self.runner.kv_caches, kv_offload_bytes)
        self.runner.warm_up_kernels()
        self.runner.capture_cuda_graphs()
        self.runner.warm_up_logits()

    def num_host_kv_blocks(self) -> int:
        """The host-memory tier's blocks on this worker (0: none)."""
        return self.host_kv_pool.num_blocks if self.host_kv_pool is not None else 0

    def save_kv(self, transfer_id: str, block_ids: list[int]) -> float:
        """Publish a prefilled request's KV blocks for a decode engine; returns the seconds."""
        return self._kv_transfer().save(transfer_id, block_ids)

    def start_kv_load(
        self, load_id: int, transfer_id: str, first_block: int, block_ids: list[int], timeout_s: float
    ) -> None:
        """Start copying a transfer's blocks into this worker's `block_ids`, in the background
        (shoal/kv_transfer/background_loads.py)."""
        self._kv_transfer().loads.start(load_id, transfer_id, first_block, block_ids, timeout_s)

    def ended_kv_loads(self, wait_s: float = 0.0) -> list[tuple[int, float, str | None]]:
        """The loads that ended since the last call: (load id, seconds, None or the error)."""
        return self._kv_transfer().loads.take_ended(wait_s)

    def cancel_kv_loads(self, load_ids: list[int]) -> None:
        """Give these loads up: once this returns, they write nothing more into the KV cache."""
        self._kv_transfer().loads.cancel(load_ids)

    def copy_kv_blocks(self, copies: KVBlockCopies) -> None:
        """The host tier's copies of a step, made ahead of it (before loads start into blocks
        whose old KV they offload)."""
        if self.host_kv_pool is not None:
            self.host_kv_pool.apply(copies)

    def _kv_transfer(self) -> KVTransferWorker:
        from shoal.kv_transfer.worker_side import KVTransferWorker

        if self.kv_transfer is None or self.kv_transfer.runner is not self.runner:
            self.kv_transfer = KVTransferWorker(self.runner, self.rank)
        return self.kv_transfer

    # ---- steps and calls -------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        """The step's output (None on ranks that do not sample); with `non_block`, a handle
        whose `result()` waits for it (see `ModelRunner.execute_model`). The host tier's copies
        go first: the forward may read the blocks they load and overwrite those they offload."""
        if scheduler_output.kv_block_copies is not None and self.host_kv_pool is not None:
            self.host_kv_pool.apply(scheduler_output.kv_block_copies)
        return self.runner.execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar: GrammarBitmask | None) -> None:
        """Sample the step that awaits its grammar bitmask (see `ModelRunner.sample_tokens`)."""
        self.runner.sample_tokens(grammar)

    def call(self, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run a `collective_rpc` call: an RL verb's implementation on this worker (its `worker`
        path in shoal/rl_verbs.py: "sleep" runs `self.sleeper.sleep`), a method of this worker
        by name, or a function that receives the worker as its first argument."""
        if callable(method):
            return method(self, *args, **kwargs)
        verb_path = rl_verbs.worker_path(method)
        if verb_path is not None:
            return operator.attrgetter(verb_path)(self)(*args, **kwargs)
        if method.startswith("_") or not hasattr(self, method):
            raise ValueError(f"workers have no method {method!r}")
        return getattr(self, method)(*args, **kwargs)

    def check_health(self) -> bool:
        return True

    # LoRA adapters (shoal/workers/lora_calls.py): an error string, None when done.

    def add_lora(self, name: str, lora_int_id: int, path: str) -> str | None:
        return self.lora_calls.add(name, lora_int_id, path)

    def remove_lora(self, name: str) -> str | None:
        return self.lora_calls.remove(name)

    def list_loras(self) -> dict[str, int]:
        return self.lora_calls.list()

    def update_lora_from_tensors(self, name: str, payload: bytes) -> str | None:
        return self.lora_calls.update_from_tensors(name, payload)

    def update_lora_from_disk(self, name: str, path: str) -> str | None:
        return self.lora_calls.update_from_disk(name, path)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the weights and the KV cache hold on this worker's device now."""
        return self.sleeper.resident_bytes()

    def start_profile(self, profile_dir: str) -> None:
        """torch.profiler on this worker's steps from now on (see shoal/workers/profiler.py)."""
        self.profiler.start(profile_dir)

    def stop_profile(self) -> dict[str, Any]:
        """Stop the profile: its Chrome trace is written; returns the trace's path, the wall and
        device-busy seconds and the top operations."""
        return self.profiler.stop()

    def report_device(self) -> str:
        """Where this worker runs, so that a caller can check where workers landed: on GPU the
        device's UUID (two workers on one GPU report the same one); on CPU "cpu", and in a Ray
        actor "cpu:<node id>:<bundle index>" (the node's CPUs are its device)."""
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return "cpu" if self.placement is None else f"cpu:{self.placement}"

    def shutdown(self) -> None:
        if self.host_kv_pool is not None:
            self.host_kv_pool.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.weight_updates.destroy_group()
        self.model_runner = None
        self.sleep_state = None  # with it the sleep-memory pools, once their tensors are gone
        if self.config.parallel_config.world_size > 1:
            parallel_state.destroy_model_parallel()
        if self.device.type == "cuda":
            # An in-process engine's memory goes back to the driver, not only to torch's cache
            # (a collection first: the model's modules may sit in reference cycles).
            gc.collect()
            torch.cuda.empty_cache()

    @property
    def sleeper(self) -> WorkerSleep:
        if self.sleep_state is None:
            raise RuntimeError("the worker's device is not initialized (call init_device first)")
        return self.sleep_state

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("the worker's device is not initialized (call init_device first)")
        return self.model_runner

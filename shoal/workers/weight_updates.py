"""A worker's side of RL weight updates: new weights written in place, through the model's own
`load_weights` and every parameter's `weight_loader`, as at checkpoint load. So each TP rank
keeps only its shard, fused projections (qkv, gate_up) are filled from their Hugging Face
parts, and a pipeline stage skips the layers it does not own.

Every update names its tensors as the Hugging Face model does and gives them whole (the
unsharded shape). The whole batch is checked before anything is written (`check`): a name the
model does not have, a wrong shape or dtype, or weights asleep is an error that names it, and
the old weights keep serving. The update methods return that error as a string (None when the
weights were written) rather than raising, so that every worker's answer reaches the engine,
which raises it as a `ValueError`; a worker whose check failed still takes part in the
transfer (the trainer's broadcasts must not hang) and discards what it receives.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from shoal.models.loader import iterate_safetensors, safetensors_files
from shoal.rl.buckets import DTYPES, TensorMeta, as_metas, bucket_offsets, plan_buckets, unpack
from shoal.rl.group import WeightUpdateGroup
from shoal.rl.tensor_transfer import bucket_metas, decode_metas, open_bucket
from shoal.workers.sleep import WEIGHTS

if TYPE_CHECKING:
    from shoal.workers.worker import Worker

logger = logging.getLogger(__name__)

# safetensors' dtype names → ours.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "I8": "int8",
    "U8": "uint8",
    "I32": "int32",
    "I64": "int64",
}
_MAX_PROBLEMS_SHOWN = 3


class WeightUpdates:
    """The weight-update group of one worker and the checks and writes of every update."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.group: WeightUpdateGroup | None = None

    # ---- what the model accepts -------------------------------------------------------------

    @cached_property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full Hugging Face shape of every weight the model has, on every stage: the names of
        the transformers model built on the meta device (what a trainer's model calls them),
        and those of the checkpoint the engine loaded (what a saved checkpoint calls them, e.g.
        per-expert tensors where transformers stacks them)."""
        model_config = self.worker.config.model_config
        shapes: dict[str, tuple[int, ...]] = {}
        try:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                hf_model = AutoModelForCausalLM.from_config(model_config.hf_config, trust_remote_code=False)
            shapes.update({n: tuple(p.shape) for n, p in hf_model.named_parameters(remove_duplicate=False)})
        except Exception as exc:  # an architecture transformers cannot build: the checkpoint's names
            logger.warning(
                "no transformers model for %s (%s); checking against the checkpoint", model_config.architecture, exc
            )
        with contextlib.suppress(FileNotFoundError):  # load_format="dummy" on a folder with no weights
            shapes.update({m.name: m.shape for m in safetensors_metas(model_config.model)})
        speculative_config = self.worker.config.speculative_config
        if speculative_config is not None and speculative_config.method == "draft_model":
            from shoal.workers.spec_decode_step import DRAFT_MODEL_PREFIX

            assert speculative_config.model is not None
            metas = safetensors_metas(speculative_config.model)
            shapes.update({DRAFT_MODEL_PREFIX + m.name: m.shape for m in metas})
        return shapes

    @property
    def model_dtype(self) -> str:
        return self.worker.config.model_config.dtype

    def check(self, metas: Sequence[TensorMeta], exact_dtype: bool = True) -> str | None:
        """What is wrong with an update of `metas`, or None. `exact_dtype=False` (a checkpoint
        on disk) accepts any floating dtype, cast on load as at start-up."""
        if self.worker.config.model_config.quantization is not None:
            return "weight updates into a quantized (fp8) engine are not supported"
        try:
            self.worker.sleeper.require_awake(WEIGHTS)
        except ValueError as exc:
            return str(exc)
        problems = [p for meta in metas if (p := self._problem(meta, exact_dtype)) is not None]
        if not metas:
            problems.append("the update has no tensors")
        if not problems:
            return None
        more = len(problems) - _MAX_PROBLEMS_SHOWN
        return "; ".join(problems[:_MAX_PROBLEMS_SHOWN]) + (f" (and {more} more)" if more > 0 else "")

    def check_encoded(self, metas: list[list[Any]]) -> str | None:
        """`check` of [name, dtype, shape] lists (shoal/rl/tensor_transfer.py's `encode_metas`)."""
        return self.check(decode_metas(metas))

    def _problem(self, meta: TensorMeta, exact_dtype: bool) -> str | None:
        expected = self.expected_shapes.get(meta.name)
        if expected is None:
            return f"unknown weight {meta.name!r}: the model has no parameter of that Hugging Face name"
        if tuple(meta.shape) != expected:
            return (
                f"weight {meta.name!r} has shape {list(meta.shape)}, the model's is {list(expected)} "
                "(the full Hugging Face shape, not a tensor-parallel shard)"
            )
        floating = meta.dtype in DTYPES and DTYPES[meta.dtype].is_floating_point
        if meta.dtype != self.model_dtype and (exact_dtype or not floating):
            return f"weight {meta.name!r} has dtype {meta.dtype}, the engine's weights are {self.model_dtype}"
        return None

    # ---- writing ----------------------------------------------------------------------------

    def load(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Write checked tensors (or lazy safetensors slices) through the model's loaders."""
        runner = self.worker.runner
        with torch.no_grad():
            if runner.speculation is None or runner.speculation.config.method == "ngram":
                runner.model.load_weights(named_tensors)  # type: ignore[union-attr]
                return
            # The drafter's share: a draft model's own names, or a head's / MTP module's among the target's.
            target, drafter = runner.speculation.split_weights(named_tensors)
            runner.model.load_weights(target)  # type: ignore[union-attr]
            runner.speculation.load_weights(drafter)

    def _synchronize(self) -> None:
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize(self.worker.device)

    # ---- the four sources -------------------------------------------------------------------

    def from_disk(self, path: str) -> str | None:
        """Every tensor of the safetensors folder `path` (the loader's own iterator)."""
        try:
            metas = safetensors_metas(path)
        except (FileNotFoundError, OSError) as exc:
            return str(exc)
        problem = self.check(metas, exact_dtype=False)
        if problem is None:
            self.load(iterate_safetensors(path))
            self._synchronize()
        return problem

    def from_tensors(self, buckets: Sequence[dict[str, Any]]) -> str | None:
        """Buckets made by shoal/rl/tensor_transfer.py (bytes, or a CUDA IPC handle)."""
        problem = self.check([meta for bucket in buckets for meta in bucket_metas(bucket)])
        if problem is not None:
            return problem
        for bucket in buckets:
            self.load(open_bucket(bucket))
        self._synchronize()  # the caller may free its buffers once the call has returned
        return None

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str | None,
        group_name: str | None = None,
    ) -> str | None:
        """Join the trainer's group as rank `rank_offset + this worker's rank` (shoal's, or with
        `group_name` the torch process group of SGLang's trainers); returns why not, or None."""
        if self.group is not None:
            return "this engine is already in a weight-update group: call destroy_weight_update_group() first"
        rank = rank_offset + self.worker.rank
        device = self.worker.device
        try:
            self.group = WeightUpdateGroup(
                master_address, master_port, rank, world_size, device, backend, group_name=group_name
            )
        except ValueError as exc:
            return str(exc)
        return None

    def from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], bucket_bytes: int
    ) -> str | None:
        """Receive the trainer's broadcasts (rank 0's `WeightSender.send`), one flat buffer per
        bucket, and load each as it arrives."""
        if self.group is None:
            return "no weight-update group: call init_weight_update_group() first"
        try:
            metas = as_metas(names, dtypes, shapes)
        except ValueError as exc:
            return str(exc)
        start = time.perf_counter()
        problem = self.check(metas)
        if self.group.per_tensor:
            return self._receive_per_tensor(metas, problem, start)
        buckets = plan_buckets(metas, bucket_bytes)
        for bucket in buckets:
            _, num_bytes = bucket_offsets(bucket)
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.worker.device)
            self.group.broadcast(buffer, src=0)
            if problem is None:
                self.load(unpack(buffer, bucket))
        self._synchronize()
        logger.info(
            "received %d tensors in %d bucket(s) in %.2f s", len(metas), len(buckets), time.perf_counter() - start
        )
        return problem

    def _receive_per_tensor(self, metas: Sequence[TensorMeta], problem: str | None, start: float) -> str | None:
        """SGLang's protocol: one broadcast per tensor, in order, each loaded as it arrives."""
        assert self.group is not None
        for meta in metas:
            tensor = torch.empty(meta.shape, dtype=DTYPES[meta.dtype], device=self.worker.device)
            self.group.broadcast(tensor, src=0)
            if problem is None:
                self.load([(meta.name, tensor)])
        self._synchronize()
        logger.info("received %d tensors one by one in %.2f s", len(metas), time.perf_counter() - start)
        return problem

    def destroy_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


def safetensors_metas(path: str) -> list[TensorMeta]:
    """Name, dtype and shape of every tensor of a safetensors folder (headers only)."""
    from safetensors import safe_open

    metas = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                tensor_slice = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype(), tensor_slice.get_dtype())
                metas.append(TensorMeta(name, dtype, tuple(tensor_slice.get_shape())))
    return metas

"""Build a model for this worker's pipeline stage and tensor-parallel rank, and fill its weights
from a Hugging Face safetensors folder (or with small random values for `load_format="dummy"`).

Each checkpoint tensor is handed to `load_weights` as a lazy safetensors slice, so every
parameter's `weight_loader` reads only its own rank's rows or columns from disk. Once all are
in, every layer with a `process_weights_after_loading` hook (the linear layers) turns its
loaded tensors into the form its forward uses: with `quantization="fp8"` that is where float
weights are quantized, and fp8 weights transposed into the GEMM's column-major layout.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shoal.config import ModelConfig, ParallelConfig
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

DUMMY_WEIGHT_RANGE = 1e-3
DUMMY_INPUT_AMAX = 16.0  # static fp8 activation scales of dummy weights: activations up to this
# The fp8 weight scales: per tensor or channel ("weight_scale"), per block ("weight_scale_inv").
_WEIGHT_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def get_model(
    model_config: ModelConfig, device: torch.device, parallel_config: ParallelConfig | None = None
) -> nn.Module:
    """The model of `model_config.architecture`, on `device` in `model_config.dtype`, with weights."""
    start = time.perf_counter()
    model_cls = resolve_model_class(model_config.architecture)
    partition = parallel_config.pipeline_layer_partition if parallel_config is not None else None
    quant_config = get_quant_config(model_config)
    with default_dtype(getattr(torch, model_config.dtype)), torch.device(device):
        model = model_cls(model_config.hf_config, quant_config, pipeline_layer_partition=partition)
    with torch.no_grad():
        if model_config.load_format == "dummy":
            initialize_dummy_weights(model, model_config.seed)
        else:
            weights = iterate_safetensors(model_config.model)
            if quant_config is not None:
                weights = ((name, w) for name, w in weights if not quant_config.is_unused_tensor(name))
            loaded = model.load_weights(weights)
            check_all_loaded(model, loaded)
        process_weights_after_loading(model)
    if model_config.batch_invariant:
        from shoal.layers.batch_invariant import make_batch_invariant

        make_batch_invariant(model)
    logger.info(
        "Loaded %s (%s, %s%s) on %s in %.2f s",
        model_config.architecture,
        model_config.dtype,
        model_config.load_format,
        ", fp8" if quant_config is not None else "",
        device,
        time.perf_counter() - start,
    )
    return model.eval()


def get_quant_config(model_config: ModelConfig) -> Fp8Config | None:
    """The fp8 scheme of the checkpoint, or on-the-fly fp8 for a float one; None unquantized."""
    if model_config.quantization is None:
        return None
    return Fp8Config.from_hf_config(model_config.hf_config)


def process_weights_after_loading(model: nn.Module) -> None:
    """Call every module's post-loading hook (quantization, layout changes), once."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are of `dtype` (torch's default dtype, restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(model_dir: str) -> list[Path]:
    """The checkpoint's shards: those the index names when there is one (a folder may also hold
    differently named consolidated weights), else every *.safetensors file."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir} (only safetensors checkpoints are supported; "
            "use load_format='dummy' for random weights)"
        )
    return files


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor of the checkpoint; a slice reads from disk only when indexed."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                yield name, f.get_slice(name)


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"the checkpoint has no weights for {len(missing)} parameters: {shown}")


def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Every parameter uniform in [-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE], reproducible for a
    given seed and device type. Drawn where the parameter lives: on a GPU an 8B model takes a
    second instead of half a minute on the CPU.

    fp8 checkpoints' tensors get values of the same effect: fp8 weights uniform over the whole
    e4m3 range and their scales DUMMY_WEIGHT_RANGE / 448 (so the dequantized weights again lie
    in [-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE], not rounded to zero by e4m3's few small
    values), and static activation scales that fit activations of magnitude up to DUMMY_INPUT_AMAX."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        values = torch.empty(param.shape, dtype=torch.float32, device=device)
        if name.endswith(_WEIGHT_SCALE_SUFFIXES):
            values.fill_(DUMMY_WEIGHT_RANGE / FP8_MAX)  # positive: a scale multiplies
        elif name.endswith(".input_scale"):
            values.fill_(DUMMY_INPUT_AMAX / FP8_MAX)
        elif param.dtype == FP8_DTYPE:
            values.uniform_(-FP8_MAX, FP8_MAX, generator=generator)
        else:
            values.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
        param.data.copy_(values)

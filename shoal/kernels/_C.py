"""Load the compiled csrc library (`shoal/_C.so`, built by `python -m shoal.kernels.build`) into
`torch.ops.shoal`, once per process.

The library is loaded only when it exists, was built for the running torch (a build stamp
`_C.so.json` beside it records the torch version), torch has CUDA, and `SHOAL_DISABLE_CSRC` is
off. Otherwise one info line says why and the ops fall back to the Triton kernels and the torch
references. CPU machines never need the library.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from shoal import envs

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # shoal/
LIBRARY_NAME = "_C.so"

_loaded: bool | None = None


def library_path() -> Path:
    return PACKAGE_DIR / LIBRARY_NAME


def stamp_path(library: Path) -> Path:
    """The build stamp beside a library: `_C.so` -> `_C.so.json`."""
    return library.with_name(library.name + ".json")


def read_stamp(library: Path) -> dict[str, str] | None:
    try:
        stamp = json.loads(stamp_path(library).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _unusable_reason(library: Path) -> str | None:
    """Why the library cannot be loaded in this process, or None when it can."""
    if envs.SHOAL_DISABLE_CSRC:
        return "SHOAL_DISABLE_CSRC is set"
    if not library.exists():
        return f"{library.name} is not built (make kernels)"
    if torch.version.cuda is None:
        return "this torch has no CUDA"
    stamp = read_stamp(library)
    if stamp is None:
        return f"{stamp_path(library).name} is missing: rebuild with make kernels"
    if stamp.get("torch_version") != torch.__version__:
        return f"built for torch {stamp.get('torch_version')}, running {torch.__version__}: rebuild with make kernels"
    return None


def load() -> bool:
    """Register the compiled ops if possible; True when `torch.ops.shoal` holds them."""
    global _loaded
    if _loaded is None:
        library = library_path()
        reason = _unusable_reason(library)
        if reason is None:
            torch.ops.load_library(str(library))
            logger.debug("loaded %s", library)
            _loaded = True
        else:
            logger.info("shoal CUDA ops not loaded (%s); using Triton kernels and torch references", reason)
            _loaded = False
    return _loaded

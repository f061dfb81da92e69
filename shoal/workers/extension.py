"""Worker extensions: `worker_extension_cls="pkg.module:Class"`, a mixin class added to every
worker (Ray actor or in-process), whose methods `collective_rpc("method", args=...)` calls and
which reaches the worker's model runner and model (`self.runner`, `self.runner.model`).

The worker class of an engine with an extension is built as `type("Worker", (Extension, Worker),
{})`. An extension adds methods; one that would replace a worker's attribute is refused, since
the engine calls those and would run the extension's instead.

This module imports no torch until an extension is loaded (the config checks paths with it).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from shoal import rl_verbs


def load_worker_extension(path: str) -> type:
    """The class `path` names ("pkg.module:Class", or "pkg.module.Class" as vLLM spells it);
    a ValueError that names the path if it does not name an importable class."""
    module_name, _, class_name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"worker_extension_cls {path!r} must look like 'pkg.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"worker_extension_cls {path!r}: cannot import module {module_name!r} ({exc})") from exc
    extension = getattr(module, class_name, None)
    if not isinstance(extension, type):
        raise ValueError(f"worker_extension_cls {path!r}: module {module_name!r} has no class {class_name!r}")
    return extension


def extension_names(extension: type) -> set[str]:
    """The attributes an extension defines (its own and its bases', beyond `object`)."""
    return {name for cls in extension.__mro__ if cls is not object for name in vars(cls) if not _is_dunder(name)}


def check_clashes(extension: type, taken: set[str], path: str) -> None:
    clashes = sorted(extension_names(extension) & taken)
    if clashes:
        raise ValueError(f"worker_extension_cls {path!r} defines {clashes}, which the worker has already; rename them")


@functools.cache
def worker_class(path: str | None) -> type:
    """`Worker`, or `Worker` with the extension `path` mixed in (built once per process)."""
    from shoal.workers.worker import Worker

    if path is None:
        return Worker
    extension = load_worker_extension(path)
    # The RL verbs a worker implements (shoal/rl_verbs.py) are its names too: `call` runs them.
    verbs = {verb.name for verb in rl_verbs.declared() if verb.worker is not None}
    check_clashes(extension, {name for name in dir(Worker) if not _is_dunder(name)} | verbs, path)
    return type("Worker", (extension, Worker), {"__doc__": f"Worker with the extension {path}"})


def create_worker(config: Any, rank: int = 0, local_rank: int = 0) -> Any:
    """The engine's worker for `rank`, with its extension if the config names one (an
    extension attribute that a worker's own `__init__` sets is a clash too)."""
    path = config.parallel_config.worker_extension_cls
    worker = worker_class(path)(config, rank=rank, local_rank=local_rank)
    if path is not None:
        check_clashes(load_worker_extension(path), set(vars(worker)), path)
    return worker


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")

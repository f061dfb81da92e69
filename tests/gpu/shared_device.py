"""A pytest plugin for GPU tests that run in several processes on one GPU (`make test-gpu`'s
parallel phase, pytest-xdist): every engine gets at most an equal share of the device
(`gpu_memory_utilization`, instead of its default 0.9 or a test's own larger figure), so that
the workers' engines fit side by side; an engine given `kv_cache_memory_bytes` is left as it
is. Before an engine starts, the garbage collector runs: an engine an earlier test dropped in
a reference cycle still holds its KV cache until it does, and this process's torch memory is
charged to the next engine's share. Tests that measure the device's memory, or start Ray or
NCCL, run alone in the suite's serial phase instead (tests/gpu/suite.sh)."""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch

from shoal import LLM

# What all the workers' engines may take together; the rest is the tests' own tensors.
_ENGINES_SHARE = 0.8


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = round(_ENGINES_SHARE / workers, 3)
    init = LLM.__init__

    @functools.wraps(init)
    def init_with_a_share(self: LLM, *args: object, **kwargs: object) -> None:
        if "kv_cache_memory_bytes" not in kwargs:
            asked = kwargs.get("gpu_memory_utilization", share)
            kwargs["gpu_memory_utilization"] = min(float(asked), share)  # type: ignore[arg-type]
        gc.collect()
        torch.cuda.empty_cache()
        init(self, *args, **kwargs)

    LLM.__init__ = init_with_a_share  # type: ignore[method-assign]

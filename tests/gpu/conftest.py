"""After every test here, shut down each `LLM` the test made and give the device memory back.

A failing test's traceback keeps its frames, and with them its engine, alive until the end of
the session: on one GPU every later engine then finds too little free memory and fails too.
Shutting the engines down drops their weights and KV cache however the test ended."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from shoal import LLM


@pytest.fixture(autouse=True)
def _engines_shut_down(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    made: list[weakref.ref] = []
    init = LLM.__init__

    def tracked_init(self: LLM, *args: object, **kwargs: object) -> None:
        made.append(weakref.ref(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", tracked_init)
    yield
    for ref in made:
        llm = ref()
        if llm is not None:
            llm.shutdown()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()

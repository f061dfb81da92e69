"""The RL verbs' table (shoal/rl_verbs.py): a verb declared in the test, and only there, becomes
a method of `LLM` and `AsyncLLM` (with its signature, docstring and alias) and an HTTP route, and
reaches the workers through the engine core; withdrawn, it is gone from every layer. The built-in
verbs' methods carry their signatures and docstrings, every layer finds their implementations,
and the table imports no torch."""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from shoal import LLM, rl_verbs
from shoal.config import EngineArgs
from shoal.entrypoints.openai.api_server import ServerArgs, build_app
from shoal.frontend.async_llm import AsyncLLM
from shoal.rl_verbs import RESULT, Route
from shoal.workers.extension import worker_class

PROBE = "tests.workers.weight_probe:WeightProbe"  # its method parameter_norm_squared(name)
NORM = "model.norm.weight"


@pytest.fixture
def toy_verb() -> Iterator[rl_verbs.Verb]:
    """One declaration: the workers' layer (the probe extension's method of the same name), an
    alias, a GET route."""

    @rl_verbs.verb(
        layer="workers",
        aliases=("parameter_norms",),
        routes=(Route("GET", "/parameter_norm_squared", {"norms_squared": RESULT}),),
    )
    def parameter_norm_squared(name: str) -> list[float]:
        """Each worker's sum of squares of its shard of the parameter `name` (rank order)."""

    yield parameter_norm_squared
    rl_verbs.withdraw("parameter_norm_squared")


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoints: dict) -> str:
    return str(tiny_checkpoints["llama"])


def test_a_declared_verb_reaches_the_workers_through_llm(toy_verb: rl_verbs.Verb, tiny_llama: str) -> None:
    with LLM(tiny_llama, multiprocess=False, max_model_len=128, worker_extension_cls=PROBE) as llm:
        norm = llm.collective_rpc("parameter_norm_squared", (NORM,))
        assert norm[0] > 0
        assert llm.parameter_norm_squared(NORM) == norm
        assert llm.parameter_norm_squared(name=NORM) == norm
        assert llm.parameter_norms(NORM) == norm  # the alias
        with pytest.raises(TypeError):
            llm.parameter_norm_squared()
        assert str(inspect.signature(LLM.parameter_norm_squared)) == "(self, name: str) -> list[float]"
        assert LLM.parameter_norm_squared.__doc__.startswith("Each worker's sum of squares")
        assert inspect.iscoroutinefunction(AsyncLLM.parameter_norm_squared)

        rl_verbs.withdraw("parameter_norm_squared")
        assert not hasattr(LLM, "parameter_norm_squared") and not hasattr(AsyncLLM, "parameter_norms")
        with pytest.raises(ValueError, match="no utility method 'parameter_norm_squared'"):
            llm._call("parameter_norm_squared", NORM)
        rl_verbs.declare(toy_verb)  # for the fixture's withdraw


def test_a_declared_verb_gets_its_route(toy_verb: rl_verbs.Verb, tiny_llama: str) -> None:
    engine = AsyncLLM(EngineArgs(model=tiny_llama, max_model_len=128, worker_extension_cls=PROBE), multiprocess=False)
    with TestClient(build_app(engine, ServerArgs(enable_rl_endpoints=True), shutdown_engine=True)) as client:
        response = client.get("/parameter_norm_squared", params={"name": NORM})
        assert response.status_code == 200, response.text
        (norm,) = response.json()["norms_squared"]
        assert norm > 0
        missing = client.get("/parameter_norm_squared")
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "name"
        assert client.get("/weight_version").json() == {"weight_version": "0"}  # the built-in routes stay


def test_a_verb_that_a_frontend_has_already_is_refused_whole() -> None:
    """`AsyncLLM.abort` is written by hand; `LLM` (whose methods are made first) has no `abort`."""
    hand_written = AsyncLLM.abort
    with pytest.raises(TypeError, match="written by hand"):

        @rl_verbs.verb()
        def abort(request_id: str) -> None:
            """Clashes with AsyncLLM.abort."""

    assert rl_verbs.find("abort") is None
    assert AsyncLLM.abort is hand_written and not hasattr(LLM, "abort")  # LLM's is taken back


class SleepingExtension:
    def sleep(self, level: int) -> None:
        pass


def test_a_worker_extension_may_not_take_a_verbs_name() -> None:
    with pytest.raises(ValueError, match=r"defines \['sleep'\]"):
        worker_class("tests.test_rl_verbs:SleepingExtension")


def test_the_built_in_verbs_are_documented_and_implemented(tiny_llama: str) -> None:
    from shoal.engine_core.engine_core import EngineCore

    expected = ["sleep", "wake_up", "is_sleeping", "release_memory_occupation"]
    expected += ["pause_generation", "resume_generation", "is_paused"]
    expected += ["update_weights_from_disk", "update_weights_from_tensors", "init_weight_update_group"]
    expected += ["update_weights_from_distributed", "destroy_weight_update_group", "get_weight_version"]
    expected += ["update_weight_version"]
    public = [verb.name for verb in rl_verbs.declared() if verb.public]
    assert public == expected
    assert str(inspect.signature(LLM.sleep)) == "(self, level: int = 1) -> None"
    assert str(inspect.signature(AsyncLLM.wake_up)) == "(self, tags: list[str] | None = None) -> None"
    for name in public:
        assert getattr(LLM, name).__doc__ == getattr(AsyncLLM, name).__doc__ == rl_verbs.find(name).doc != ""
    for verb in rl_verbs.declared():
        assert verb.layer == "engine_core" and callable(getattr(EngineCore, verb.name)), verb.name
    with LLM(tiny_llama, multiprocess=False, max_model_len=128) as llm:
        worker = llm.engine_core.core.executor.worker
        for verb in rl_verbs.declared():
            if verb.worker is not None:
                assert callable(_resolve(worker, verb.worker)), verb.name


def _resolve(worker: object, path: str) -> object:
    for part in path.split("."):
        worker = getattr(worker, part)
    return worker


def test_the_table_imports_no_torch_and_holds_the_bucket_size() -> None:
    code = (
        "import sys, shoal.rl_verbs, shoal.engine_core.utilities; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(shoal.rl_verbs.DEFAULT_BUCKET_BYTES)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import shoal.rl

    assert int(result.stdout) == shoal.rl.DEFAULT_BUCKET_BYTES == 512 << 20

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoints import DEEPSEEK_KINDS, KINDS, MOE_KINDS, make_checkpoint

# The GPU machine has no OpenAI client, and its suite (`-m gpu`) has no test in these modules;
# CI installs the client, so there they are always collected.
collect_ignore = (
    ["entrypoints", "bench/test_bench_serve.py", "cluster/test_serving.py"]
    if importlib.util.find_spec("openai") is None
    else []
)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failure's traceback as soon as it happens, not in the end summary: a device call
    cut at its time limit, or a process killed by a crash, would otherwise say only FAILED."""
    if report.failed and _terminal is not None:
        _terminal.write_line(f"\n---- {report.nodeid} ({report.when})\n{report.longreprtext}\n----")


_terminal = None

# Session fixtures that start something costly (a Ray cluster, an OpenAI server): `make test` runs
# two pytest-xdist workers with `--dist loadgroup`, and every test using one of these goes to the
# same worker, so each starts once. Other tests go by module, so a module's fixtures start once.
_SHARED_FIXTURE_GROUPS = {"ray_cluster": "ray", "server": "server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        group = next((g for f, g in _SHARED_FIXTURE_GROUPS.items() if f in fixtures), item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config: pytest.Config) -> None:
    global _terminal
    _terminal = config.pluginmanager.get_plugin("terminalreporter")


@pytest.fixture
def shoal_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog that sees shoal's INFO lines wherever a test runs: once shoal has configured its logger
    (shoal/logger.py) it no longer propagates to the root logger that caplog listens on."""
    logger = logging.getLogger("shoal")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each line once, whether or not shoal was configured
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> folder of a tiny random HF checkpoint with a tokenizer (see tests/checkpoints.py)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: make_checkpoint(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> folder of a tiny random mixture-of-experts checkpoint (MOE_KINDS)."""
    root = tmp_path_factory.mktemp("moe_checkpoints")
    return {kind: make_checkpoint(kind, root / kind) for kind in MOE_KINDS}


@pytest.fixture(scope="session")
def deepseek_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> folder of a tiny random DeepSeek-V2 / V3 checkpoint (DEEPSEEK_KINDS)."""
    root = tmp_path_factory.mktemp("deepseek_checkpoints")
    return {kind: make_checkpoint(kind, root / kind) for kind in DEEPSEEK_KINDS}


@pytest.fixture(scope="session")
def demo_model_path() -> str:
    """The SmolLM2-135M-Instruct demo model, converted once per machine."""
    from shoal.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict]:
    """One local Ray cluster shared by every test of the session that needs one: 4 logical CPUs
    (TP=2 x PP=2 takes four {"CPU": 1} bundles, on any number of cores). RAY_ADDRESS points
    engine-core subprocesses at it; token authentication is off so that they may connect by
    address. The dashboard runs because Ray's state API (`ray.util.state`, what the lifecycle
    tests read) is served by it, where it can run: a Ray without the dashboard's dependencies (the
    GPU machine's) starts without it, and only the tests that read the state API fail there."""
    import os

    import ray

    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_AUTH_MODE", "disabled")
    try:
        context = ray.init(address="local", num_cpus=4, include_dashboard=_dashboard_can_run(), logging_level="WARNING")
    except Exception:  # the dashboard failed to start (a slimmed Ray): go on without it
        ray.shutdown()
        context = ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    patch.setenv("RAY_ADDRESS", context.address_info["gcs_address"])
    assert os.environ["RAY_ADDRESS"]
    try:
        yield context.address_info
    finally:
        ray.shutdown()
        patch.undo()


def _dashboard_can_run() -> bool:
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError:
        return False
    return True

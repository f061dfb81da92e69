"""Fixtures for the API tests: `server`, one session-wide `shoal serve` of the demo model (tests
that kill or reconfigure a server start their own small one with `ServerProcess` and a tiny
random checkpoint, which starts in seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.entrypoints.server_utils import DEMO_SERVER_ARGS, ServerProcess


@pytest.fixture(scope="session")
def server(demo_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # Tool calls in the Hermes format (the tests give the demo model a template that renders tools).
    tool_args = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    process = ServerProcess([demo_model_path, *DEMO_SERVER_ARGS, *tool_args, "--stats-interval", "2"], log_path)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tiny_model_path(tiny_checkpoints: dict[str, Path]) -> str:
    return str(tiny_checkpoints["llama"])

"""`ServerProcess`: a real `python -m shoal.cli serve ...` in a subprocess, for the API tests.

The server picks a free port itself (`--port 0`); the URL is read from its start-up log line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

_READY = re.compile(r"shoal is serving (.+) at (http://\S+)/v1 \(engine core pid (\d+|None)\)")
_START_TIMEOUT_S = 180.0
DEMO_MAX_MODEL_LEN = 1024
DEMO_KV_CACHE_BYTES = 256 * 1024**2
# The session's server schedules one step ahead, as it does on a GPU, so that every API test also
# checks async scheduling against the offline LLM (which runs synchronously on CPU).
DEMO_SERVER_ARGS = [
    "--max-model-len",
    str(DEMO_MAX_MODEL_LEN),
    "--kv-cache-memory-bytes",
    str(DEMO_KV_CACHE_BYTES),
    "--async-scheduling",
]


class ServerProcess:
    """`python -m shoal.cli serve ...` in a subprocess, its output in a log file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "shoal.cli", "serve", "--port", "0", "--disable-access-log", *args]
        # One torch thread for the engine leaves a core to the HTTP side and the test itself (on
        # a small CI machine, oversubscribed OpenMP threads slow decoding down many times over).
        env = {**os.environ, "SHOAL_CPU_THREADS": os.environ.get("SHOAL_CPU_THREADS", "1")}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url, self.model_name, self.engine_core_pid = self._wait_until_ready()

    def _wait_until_ready(self) -> tuple[str, str, int | None]:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = _READY.search(self.log())
            if match is not None:
                pid = int(match.group(3)) if match.group(3).isdigit() else None
                return match.group(2), match.group(1), pid
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}) during start-up:\n{self.log()}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start in {_START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("api_key", "EMPTY")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **kwargs)  # type: ignore[arg-type]

    def metric(self, name: str) -> float:
        """One sample of a shoal metric from /metrics (summed over labels)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = [
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(rf"{re.escape(name)}[{{ ]", line)
        ]
        assert values, f"metric {name} not found"
        return sum(values)

    def wait_for_metric(self, name: str, value: float, timeout_s: float) -> float:
        """Poll until the metric has `value`; returns the seconds it took."""
        start = time.monotonic()
        while self.metric(name) != value:
            assert time.monotonic() - start < timeout_s, (
                f"{name} is {self.metric(name)}, not {value}, after {timeout_s} s"
            )
            time.sleep(0.1)
        return time.monotonic() - start

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def process_exists(pid: int) -> bool:
    """True while `pid` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"

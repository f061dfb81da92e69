"""Ctrl-C while streams are open: the server finishes what it can within its grace period, then
cuts the rest and says how many in one log line (not a CancelledError traceback per stream)."""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path

import httpx

from tests.entrypoints.server_utils import ServerProcess

NUM_STREAMS = 2


def _open_stream(url: str, first_chunk: threading.Event) -> None:
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
    except httpx.HTTPError:
        pass  # the server cut the stream: what this test makes it do


def test_ctrl_c_cuts_open_streams_with_one_log_line(tiny_model_path: str, tmp_path: Path) -> None:
    server = ServerProcess([tiny_model_path, "--enable-rl-endpoints"], tmp_path / "server.log")
    try:
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        streams = [threading.Thread(target=_open_stream, args=(server.url, event)) for event in started]
        for stream in streams:
            stream.start()
        assert all(event.wait(60) for event in started)
        # Frozen mid-stream ("keep"), the streams outlast the shutdown's grace period for sure.
        assert httpx.post(f"{server.url}/pause", json={"mode": "keep"}, timeout=60).status_code == 200
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(60) == 0
        for stream in streams:
            stream.join(30)
    finally:
        server.stop()
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
    cut = [line for line in log.splitlines() if "grace period" in line]
    assert len(cut) == 1, log
    assert re.search(rf"\b{NUM_STREAMS} request\(s\) still running after the 5 s grace period were cut\b", cut[0]), cut

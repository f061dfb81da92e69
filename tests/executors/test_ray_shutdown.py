"""An engine on Ray shuts down quietly: no process of it prints a stack dump for the SIGTERM
that asks it to stop (Ray's C++ core installs a handler that dumps on every SIGTERM)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SIGTERM_DUMP = "SIGTERM received at time="
ENGINE_SCRIPT = """
import gc
import sys

from shoal import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2)
    print(llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)
    del llm  # dropped: its engine-core process, worker actors and placement group are released
    gc.collect()
    print("dropped", flush=True)
"""


def test_a_dropped_tp2_engine_prints_no_sigterm_dump(ray_cluster: dict, tiny_checkpoints: dict, tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    started = time.time()
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_checkpoints["llama"])],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "dropped" in result.stdout, output
    assert SIGTERM_DUMP not in output, output
    # Nor in the logs of the cluster's processes (the workers' and the engine core's own).
    logs = Path(ray_cluster["session_dir"]) / "logs"
    touched = [path for path in logs.glob("*") if path.is_file() and path.stat().st_mtime >= started]
    assert touched
    dumped = [path.name for path in touched if SIGTERM_DUMP in path.read_text(errors="replace")]
    assert not dumped, dumped

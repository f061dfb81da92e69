from __future__ import annotations

import json
import shutil

import pytest
import torch

from shoal import envs
from shoal.kernels import _C, build


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader that has not run yet, looking for the library in tmp_path."""
    monkeypatch.setattr(_C, "_loaded", None)
    monkeypatch.setattr(_C, "library_path", lambda: tmp_path / "_C.so")
    monkeypatch.setattr(envs, "SHOAL_DISABLE_CSRC", False)
    return tmp_path


def _fallback_lines(shoal_log) -> list[str]:
    return [r.getMessage() for r in shoal_log.records if "CUDA ops not loaded" in r.getMessage()]


def test_missing_library_falls_back_with_one_info_line(fresh_loader, shoal_log):
    assert _C.load() is False
    assert _C.load() is False  # cached: no second line
    lines = _fallback_lines(shoal_log)
    assert len(lines) == 1 and "not built" in lines[0]


def test_library_for_another_torch_is_not_loaded(fresh_loader, monkeypatch, shoal_log):
    library = fresh_loader / "_C.so"
    library.write_bytes(b"not a real library")
    _C.stamp_path(library).write_text(json.dumps({"torch_version": "0.0.1"}))
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as on a GPU machine
    assert _C.load() is False
    assert "built for torch 0.0.1" in _fallback_lines(shoal_log)[0]


def test_disabled_by_the_environment(fresh_loader, monkeypatch, shoal_log):
    monkeypatch.setattr(envs, "SHOAL_DISABLE_CSRC", True)
    assert _C.load() is False
    assert "SHOAL_DISABLE_CSRC" in _fallback_lines(shoal_log)[0]


def test_fingerprint_follows_sources_and_architectures(monkeypatch, tmp_path):
    assert build.fingerprint("90a") == build.fingerprint("90a")
    assert build.fingerprint("90a") != build.fingerprint("90a;100a")
    shutil.copytree(build.REPO_ROOT / "csrc", tmp_path / "csrc")
    shutil.copy(build.REPO_ROOT / "CMakeLists.txt", tmp_path)
    monkeypatch.setattr(build, "REPO_ROOT", tmp_path)
    before = build.fingerprint("90a")
    with open(tmp_path / "csrc" / "README.md", "a") as readme:
        readme.write("\nA note.\n")
    assert build.fingerprint("90a") == before  # documentation: no rebuild
    with open(tmp_path / "csrc" / "silu_and_mul.cu", "a") as source:
        source.write("\n// a change\n")
    assert build.fingerprint("90a") != before


def test_build_reuses_a_cached_library(monkeypatch, tmp_path):
    """A library in the build directory with the current fingerprint is installed, not rebuilt."""
    target = tmp_path / "pkg" / "_C.so"
    target.parent.mkdir()
    cached = tmp_path / "build" / "out" / "_C.so"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"library")
    _C.stamp_path(cached).write_text(json.dumps({"fingerprint": build.fingerprint("90a"), "torch_version": "x"}))
    monkeypatch.setattr(build, "library_path", lambda: target)
    monkeypatch.setattr(build, "_run", lambda cmd: pytest.fail(f"should not run {cmd}"))
    assert build.build(tmp_path / "build", "90a") == target
    assert target.read_bytes() == b"library" and _C.read_stamp(target)["torch_version"] == "x"
    assert build.build(tmp_path / "build", "90a") == target  # now current in place


@pytest.mark.gpu
def test_a_failing_check_inside_an_op_raises_a_runtime_error():
    """A TORCH_CHECK that fails inside shoal/_C.so reaches Python as a RuntimeError and leaves the
    process alive. Run in a subprocess: a library that carried its own copy of the C++ runtime
    (linked statically where -lstdc++ found only the archive) crashed the process instead."""
    import subprocess
    import sys

    code = """
import torch
from shoal.kernels.dispatch import compiled_op
ids = torch.zeros(4, 2, dtype=torch.int32, device="cuda")
outputs = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (8 + 9000 * 15, 9000, 1)]
try:
    compiled_op("moe_align_block_size", ids)(ids, 9000, 16, *outputs)
except RuntimeError as exc:
    print("raised:", exc)
torch.ones(1, device="cuda").add_(1)  # the process goes on
print("alive")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "experts, got 9000" in result.stdout and result.stdout.rstrip().endswith("alive")

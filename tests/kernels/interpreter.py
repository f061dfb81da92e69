"""Triton kernels on CPU: a check module run under TRITON_INTERPRET=1 in a fresh process (the
interpreter is picked when the kernels are decorated, at import, so it cannot be switched on in
the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shoal.kernels.triton import triton_available

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed (make test installs it on x86-64; GPU machines run the compiled kernels)",
)


def run_interpreter_check(module: str) -> None:
    """Run `python -m module` under the interpreter; fail with its output when it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", module]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def prepare_interpreter() -> None:
    """The start of every check module's `main`: it runs under the interpreter, which is fixed up
    for NumPy 2.4."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    _patch_interpreter_for_numpy_2_4()


def _patch_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter turns 1-element arrays into ints with int(array), which NumPy 2.4
    rejects (triton-lang/triton#9171); squeeze first, as the upstream fix does."""
    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4):
        return
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched

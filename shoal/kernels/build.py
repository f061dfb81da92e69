"""Build shoal's CUDA ops (csrc/) with CMake into shoal/_C.so.

    python -m shoal.kernels.build [--build-dir DIR] [--archs 90a] [--jobs N] [--force]

A build is skipped while nothing it depends on changed: the fingerprint of csrc/,
CMakeLists.txt, the torch version and the architectures is stored in `_C.so.json` beside the
library (the loader reads the torch version from it too). The build directory also keeps a copy
of the last library and its stamp, so a fresh checkout that points at a persistent build
directory (as tests/gpu/run_gpu_suite.sh does with /tmp) reuses it without compiling.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from shoal.kernels._C import LIBRARY_NAME, PACKAGE_DIR, library_path, read_stamp, stamp_path

logger = logging.getLogger("shoal.kernels.build")  # not __name__, which is "__main__" under python -m

REPO_ROOT = PACKAGE_DIR.parent
DEFAULT_BUILD_DIR = REPO_ROOT / "build"


def fingerprint(archs: str) -> str:
    """sha256 over every file under csrc/ but its documentation, and CMakeLists.txt (names and
    bytes), the torch version and the architectures: a change that can alter the library asks for
    a rebuild (minutes, mostly CUTLASS), an edit of csrc/README.md does not."""
    digest = hashlib.sha256()
    sources = sorted(p for p in (REPO_ROOT / "csrc").rglob("*") if p.is_file() and p.suffix != ".md")
    for path in [*sources, REPO_ROOT / "CMakeLists.txt"]:
        digest.update(str(path.relative_to(REPO_ROOT)).encode())
        digest.update(path.read_bytes())
    digest.update(f"torch={torch.__version__} archs={archs}".encode())
    return digest.hexdigest()


def _is_current(library: Path, expected: str) -> bool:
    stamp = read_stamp(library)
    return library.exists() and stamp is not None and stamp.get("fingerprint") == expected


def _install(source: Path, destination: Path) -> None:
    """Copy a library and its stamp, each through a temporary file and an atomic rename."""
    for src, dst in ((source, destination), (stamp_path(source), stamp_path(destination))):
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def _run(cmd: list[str]) -> None:
    logger.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True)


def build(
    build_dir: Path = DEFAULT_BUILD_DIR, archs: str = "90a", jobs: int | None = None, force: bool = False
) -> Path:
    """Build (or reuse) the library and return its path in the package."""
    expected = fingerprint(archs)
    target = library_path()
    cached = build_dir / "out" / LIBRARY_NAME
    if not force and _is_current(target, expected):
        logger.info("%s is up to date", target)
        return target
    if not force and _is_current(cached, expected):
        logger.info("reusing %s", cached)
        _install(cached, target)
        return target

    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(
        [
            "cmake",
            "-S",
            str(REPO_ROOT),
            "-B",
            str(build_dir),
            *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DSHOAL_PYTHON={sys.executable}",
            f"-DSHOAL_CUDA_ARCHS={archs}",
            f"-DSHOAL_OUTPUT_DIR={cached.parent}",
        ]
    )
    _run(["cmake", "--build", str(build_dir), "--parallel", str(jobs or os.cpu_count() or 1)])
    stamp = {
        "fingerprint": expected,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "archs": archs,
    }
    stamp_path(cached).write_text(json.dumps(stamp, indent=2) + "\n")
    _install(cached, target)
    logger.info("built %s", target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD_DIR)
    parser.add_argument("--archs", default="90a", help="CUDA architectures, CMake-style, ';'-separated")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--force", action="store_true", help="build even if the stamp says up to date")
    args = parser.parse_args()
    build(args.build_dir, args.archs, args.jobs, args.force)


if __name__ == "__main__":
    main()

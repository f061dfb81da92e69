#!/usr/bin/env bash
# Run here (a machine with package access), from the project root, before tests/gpu/run_structured.sh:
# puts into .whl/ what the GPU machine lacks for structured output — the wheels of
# tests/gpu/stage_suite.sh (xgrammar and apache-tvm-ffi among them) — and llama3-tokenizer.tgz,
# a Llama-3 tokenizer (128,256 tokens) for the 8B shape's config-only folder, converted
# from the vocabulary-only GGUF that llama-cpp-python's source package ships.
#   bash tests/gpu/stage_structured.sh        # then carry ".whl" as usual
set -euo pipefail
dest="${1:-.whl}"
mkdir -p "$dest"
python="${PYTHON:-python3}"
bash "$(dirname "${BASH_SOURCE[0]}")/stage_suite.sh" "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp"
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" --wildcards '*/models/ggml-vocab-llama-bpe.gguf'
"$python" - "$tmp" <<'PY'
import glob, sys
from pathlib import Path
from transformers import AutoTokenizer
gguf = Path(glob.glob(f"{sys.argv[1]}/*/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf")[0])
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(f"{sys.argv[1]}/tokenizer")
PY
tar czf "$dest/llama3-tokenizer.tgz" -C "$tmp/tokenizer" .
ls -l "$dest/llama3-tokenizer.tgz"

#!/usr/bin/env bash
# Run here (a machine with package access), from the project root, before tests/gpu/run_structured.sh:
# puts into .whl/ what the GPU machine lacks for structured output — xgrammar's manylinux cp312
# wheel and its apache-tvm-ffi wheel (prelude.sh installs them with the rest) — and
# llama3-tokenizer.tgz, a Llama-3 tokenizer (128,256 tokens) for the 8B shape's config-only
# folder, converted from the vocabulary-only GGUF that llama-cpp-python's source package ships.
#   bash tests/gpu/stage_structured.sh        # then carry ".whl" as usual
set -euo pipefail
dest="${1:-.whl}"
mkdir -p "$dest"
python="${PYTHON:-python3}"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$python" -m pip download -q --no-deps "${plat[@]}" -d "$dest" "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
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
ls -l "$dest"/xgrammar-*.whl "$dest"/apache_tvm_ffi-*.whl "$dest/llama3-tokenizer.tgz"

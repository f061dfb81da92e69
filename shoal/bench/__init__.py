"""`shoal bench`: offline throughput, batch latency and online serving benchmarks.

    shoal bench throughput --model DIR --dataset random-nano          # requests/s, tokens/s
    shoal bench latency --model DIR --batch-size 1 --input-len 128 --output-len 512
    shoal bench serve --base-url http://127.0.0.1:8000 --request-rate 4

One module per benchmark (`throughput`, `latency`, `serve`); `workloads` builds the requests
(fixed lengths, the nano-vllm protocol, ShareGPT), `hardware` measures the device's copy
bandwidth and GEMM rate and turns a workload into the time no engine could beat, `hf_backend`
runs the same workload through transformers' `generate`, `common` holds what the two offline
benchmarks share (flags, engine set-up, the bound of a workload), and `report` writes JSON and
tables.
Nothing here imports torch at module level: `shoal --help` stays fast.
"""

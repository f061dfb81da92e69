"""`gumbel_sample` as a Triton kernel (semantics and reference: shoal/kernels/gumbel_sample.py).

Each program walks one chunk of one row's vocabulary in tiles, adds Gumbel noise to
logits / temperature and keeps the running maximum and its index: the logits are read once,
nothing is written but the winner. The noise is Philox (`tl.rand4x`, keyed by the step's seed
and the element's position): one Philox call yields four uniforms, used for the four quarters
of a tile, because the generator, not memory, bounds this kernel (~100 integer operations per
call). A batch with enough rows to fill the GPU runs one chunk per row and writes the sampled
id directly; a smaller batch (below 16 rows per SM; batch 1: one row of 128k logits) splits each
row into chunks and a second, tiny kernel picks the best chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.triton import num_sms

_QUARTER = 256  # tile = 4 quarters of 256 logits
_TILE = 4 * _QUARTER
_MIN_CHUNK = 2 * _TILE  # a chunk shorter than this costs more in its partial write than it saves


@triton.jit
def _consider(best_value, best_index, row_logits, offs, end, inv_temperature, uniform):
    """Fold one quarter tile into the per-lane running (maximum, index)."""
    valid = offs < end
    logits = tl.load(row_logits + offs, mask=valid, other=float("-inf"))
    uniform = tl.minimum(tl.maximum(uniform, 1e-20), 1.0 - 1e-7)
    value = logits.to(tl.float32) * inv_temperature - tl.log(-tl.log(uniform))
    value = tl.where(valid, value, float("-inf"))
    better = value > best_value
    return tl.where(better, value, best_value), tl.where(better, offs, best_index)


@triton.jit(do_not_specialize=["seed", "chunk_size", "num_chunks"])
def _gumbel_max_kernel(
    out_ptr,  # [rows] int64, when each row is one chunk
    chunk_value_ptr,  # [rows, num_chunks] float32, otherwise
    chunk_index_ptr,  # [rows, num_chunks] int32
    logits_ptr,
    temperature_ptr,
    seed,
    vocab_size,
    stride_row,
    chunk_size,
    num_chunks,
    QUARTER: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temperature = 1.0 / tl.load(temperature_ptr + row)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    chunk_start = chunk * chunk_size
    end = tl.minimum(vocab_size, chunk_start + chunk_size)
    lane = tl.arange(0, QUARTER)
    best_value = tl.full([QUARTER], float("-inf"), tl.float32)
    best_index = tl.zeros([QUARTER], tl.int32)
    for start in range(chunk_start, end, 4 * QUARTER):
        # Counters start + lane, unique per (row, tile, lane); each gives the tile's four quarters.
        u0, u1, u2, u3 = tl.rand4x(seed, row * vocab_size + start + lane)
        best_value, best_index = _consider(best_value, best_index, row_logits, start + lane, end, inv_temperature, u0)
        offs = start + QUARTER + lane
        best_value, best_index = _consider(best_value, best_index, row_logits, offs, end, inv_temperature, u1)
        offs = start + 2 * QUARTER + lane
        best_value, best_index = _consider(best_value, best_index, row_logits, offs, end, inv_temperature, u2)
        offs = start + 3 * QUARTER + lane
        best_value, best_index = _consider(best_value, best_index, row_logits, offs, end, inv_temperature, u3)
    # The lanes hold per-lane maxima; the chunk's is the best of them (ties: the lowest index).
    chunk_best = tl.max(best_value, 0)
    index = tl.min(tl.where(best_value == chunk_best, best_index, vocab_size), 0)
    if CHUNKED:
        tl.store(chunk_value_ptr + row * num_chunks + chunk, chunk_best)
        tl.store(chunk_index_ptr + row * num_chunks + chunk, index)
    else:
        tl.store(out_ptr + row, index.to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks"])
def _best_chunk_kernel(out_ptr, chunk_value_ptr, chunk_index_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)
    valid = offs < num_chunks
    value = tl.load(chunk_value_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
    index = tl.load(chunk_index_ptr + row * num_chunks + offs, mask=valid, other=2**30)
    best = tl.max(value, 0)
    tl.store(out_ptr + row, tl.min(tl.where(value == best, index, 2**30), 0).to(tl.int64))


# Programs per SM the chunks aim for: each program is a serial chain of Philox rounds, so the SMs
# need many at once (H200, benchmarks/bench_sampling.py --sweep-chunks: 256 rows x 152k logits
# take 161 us as one chunk per row, 2 programs per SM, and 137 us as 8 chunks, 16 per SM).
PROGRAMS_PER_SM = 16


def choose_num_chunks(rows: int, vocab_size: int, device: torch.device) -> int:
    """One chunk per row once the rows alone give every SM PROGRAMS_PER_SM programs; else split
    the rows into chunks of at least _MIN_CHUNK logits until they do."""
    target = PROGRAMS_PER_SM * num_sms(device)
    if rows >= target:
        return 1
    return max(1, min(triton.cdiv(vocab_size, _MIN_CHUNK), triton.cdiv(target, rows)))


def _chunks_pad(num_chunks: int, vocab_size: int) -> int:
    """The best-chunk kernel's width, compiled once per vocabulary: as many chunks as the rule
    above can choose, so that the batch shrinking over a run never compiles a new variant."""
    return max(triton.next_power_of_2(num_chunks), triton.next_power_of_2(triton.cdiv(vocab_size, _MIN_CHUNK)))


def triton_gumbel_sample(
    out: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, seed: int, num_chunks: int = 0
) -> None:
    """out [rows] int64; logits [rows, vocab] (rows contiguous); temperature [rows] float32;
    num_chunks: pieces each row is split into (0: choose)."""
    rows, vocab_size = logits.shape
    if rows == 0:
        return
    if num_chunks <= 0:
        num_chunks = choose_num_chunks(rows, vocab_size, logits.device)
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), _TILE) * _TILE  # whole tiles
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    chunked = num_chunks > 1
    chunk_value = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device) if chunked else out
    chunk_index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device) if chunked else out
    _gumbel_max_kernel[(rows, num_chunks)](
        out,
        chunk_value,
        chunk_index,
        logits,
        temperature,
        seed,
        vocab_size,
        logits.stride(0),
        chunk_size,
        num_chunks,
        QUARTER=_QUARTER,
        CHUNKED=chunked,
        num_warps=4,
    )
    if chunked:
        _best_chunk_kernel[(rows,)](
            out, chunk_value, chunk_index, num_chunks, CHUNKS_PAD=_chunks_pad(num_chunks, vocab_size), num_warps=1
        )

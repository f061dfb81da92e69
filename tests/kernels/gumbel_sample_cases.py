"""Checks any `gumbel_sample` implementation must pass (the reference, the Triton kernel under
the interpreter, and the kernel on a GPU): samples follow softmax(logits / T) per row, masked
tokens never come out, one seed gives one result, another seed another."""

from __future__ import annotations

from collections.abc import Callable

import torch


def check_gumbel_sampler(
    sample: Callable[..., None], device: torch.device, num_rows: int, temperatures: tuple[float, ...] = (0.6, 1.0, 1.7)
) -> list[str]:
    failures = []
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5])
    for temperature in temperatures:
        logits = base.repeat(num_rows, 1).to(device)
        temperatures = torch.full((num_rows,), temperature, device=device)
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
        sample(out, logits, temperatures, 1234)
        counts = torch.bincount(out.cpu(), minlength=len(base)).float()
        expected = torch.softmax(base / temperature, dim=-1)
        error = (counts / num_rows - expected).abs().max().item()
        # Three standard deviations of a frequency estimated from num_rows draws.
        if error > 3 * (0.25 / num_rows) ** 0.5:
            failures.append(f"T={temperature}: frequencies {counts / num_rows} vs {expected} (max error {error:.3f})")
        if counts[5] != 0:
            failures.append(f"T={temperature}: a -inf logit was sampled")
        # Seeds, on the first rows only (the same rows draw the same way in a shorter batch).
        rows = min(num_rows, 32)
        again = torch.empty_like(out[:rows])
        sample(again, logits[:rows], temperatures[:rows], 1234)
        if not torch.equal(out[:rows], again):
            failures.append(f"T={temperature}: the same seed gave different samples")
        sample(again, logits[:rows], temperatures[:rows], 4321)
        if torch.equal(out[:rows], again):
            failures.append(f"T={temperature}: another seed gave the same samples")
    return failures


def check_across_chunks(sample: Callable[..., None], device: torch.device, num_rows: int) -> list[str]:
    """A vocabulary of 3,000 with two strong tokens far apart (in different chunks of a split
    row): each comes out with its softmax probability, and the best of them is found wherever
    it lies."""
    failures = []
    logits = torch.zeros(num_rows, 3000, device=device)
    logits[:, 100] = logits[:, 2900] = 8.0
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    sample(out, logits, torch.ones(num_rows, device=device), 99)
    expected = torch.softmax(logits[0].cpu(), dim=-1)[100].item()  # the same for token 2900
    for token in (100, 2900):
        frequency = (out.cpu() == token).float().mean().item()
        if abs(frequency - expected) > 3 * (0.25 / num_rows) ** 0.5:
            failures.append(f"token {token}: frequency {frequency:.3f}, expected {expected:.3f}")
    logits[:, 2900] = 60.0  # certain, in the last chunk
    sample(out, logits, torch.ones(num_rows, device=device), 99)
    if not bool((out == 2900).all()):
        failures.append(f"a certain token in the last chunk lost: {out.unique().tolist()}")
    return failures

"""`sbd.mask_scatter_`: entropy-bounded acceptance of a set of block positions, in place.

Backends: C++ on CPU (csrc/cpu/scatter.cpp), Triton on CUDA (`triton.py`, loaded on first CUDA call),
pure-PyTorch oracle in `naive.py`.
"""
from __future__ import annotations

import torch

from sbd_kernels.ops._cuda import register_triton_kernel

__all__ = ["mask_scatter_"]


def mask_scatter_(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                  entropy: torch.Tensor, gamma: torch.Tensor | None = None, gamma_val: float = 0.1,
                  rule: str = "eb", valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reveals, in every row, the set of still-masked block positions chosen by the EB or threshold rule.

    Candidates of row b: positions j with ``is_masked[b, j]`` and ``valid[b, j]``. They are ranked by
    entropy ascending, ties by lower position first; a NaN entropy ranks as +inf. With
    ``g = gamma[b]`` (or ``gamma_val``, rounded to fp32):

    - ``rule="eb"`` (SBD paper eq. 8): the candidate of rank r is accepted iff r == 0 or
      ``H(i_0) + ... + H(i_{r-1}) <= g``, the sum taken in fp32, one term at a time in rank order (all
      backends use this order, so they agree exactly at the boundary). For entropies >= 0 this reveals
      the first s candidates, s >= 1 the largest with ``H(i_1) + ... + H(i_{s-1}) <= g``.
    - ``rule="threshold"``: the candidate of rank r is accepted iff r == 0 or ``H(i_r) < g``.

    +inf is an ordinary value of these formulas: it ranks after every finite entropy; under "eb" an
    +inf candidate is accepted when the entropies ranked before it sum to <= g, and it blocks every
    candidate ranked after it (their sums are +inf) unless g = +inf; under "threshold" it is accepted
    only as the forced first. The lowest-ranked candidate is always accepted, even with an +inf entropy.
    Rows without candidates (nothing masked, or every masked position invalid) accept nothing. Pass the
    ``valid`` output of ``entropy_sample`` so that positions it did not compute (entropy +inf) are
    never revealed.

    Args:
        block_tokens: ``[B, K]`` int64, updated in place: accepted positions get ``sampled``.
            May be a non-contiguous view, not one whose elements share memory (expanded).
        is_masked: ``[B, K]`` bool, updated in place: accepted positions become False.
        sampled: ``[B, K]`` int64 token chosen at each position.
        entropy: ``[B, K]`` float32 entropy of each position's predictive distribution.
        gamma: ``[B]`` float32 per-row threshold (>= 0), or None to use ``gamma_val`` for all rows.
        gamma_val: scalar threshold (>= 0) used when ``gamma`` is None.
        rule: ``"eb"`` or ``"threshold"``.
        valid: ``[B, K]`` bool; False positions are never accepted. None means all True.

    Returns:
        ``accepted [B, K]`` bool (positions revealed by this call), ``num_accepted [B]`` int32,
        ``block_done [B]`` bool (no position of the row is still masked after the update).

    Errors (RuntimeError naming the argument): wrong dtype, shape or device; an in-place argument whose
    elements share memory; ``rule`` not in
    {"eb", "threshold"}; gamma < 0 or NaN (on CUDA checked without a host sync, raised at the next sync).

    Example:
        >>> import torch, sbd_kernels
        >>> tokens = torch.full((1, 4), -1, dtype=torch.int64)
        >>> masked = torch.ones(1, 4, dtype=torch.bool)
        >>> sampled = torch.tensor([[10, 11, 12, 13]])
        >>> entropy = torch.tensor([[0.30, 0.05, 0.02, 0.90]])
        >>> accepted, n, done = sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy, gamma_val=0.1)
        >>> tokens.tolist(), n.tolist(), done.tolist()
        ([[10, 11, 12, -1]], [3], [False])
    """
    return torch.ops.sbd.mask_scatter_(block_tokens, is_masked, sampled, entropy, gamma, gamma_val, rule,
                                       valid)


@torch.library.register_fake("sbd::mask_scatter_")
def _mask_scatter_fake(block_tokens, is_masked, sampled, entropy, gamma=None, gamma_val=0.1, rule="eb",
                       valid=None):
    batch, k = block_tokens.shape
    accepted = block_tokens.new_empty((batch, k), dtype=torch.bool)
    num_accepted = block_tokens.new_empty((batch,), dtype=torch.int32)
    block_done = block_tokens.new_empty((batch,), dtype=torch.bool)
    return accepted, num_accepted, block_done


register_triton_kernel("mask_scatter_", "scatter")

"""`sbd.mask_scatter_`: entropy-bounded acceptance of a set of block positions, in place.

Backends: C++ on CPU (csrc/cpu/scatter.cpp), Triton on CUDA (`triton.py`, loaded on first CUDA call),
pure-PyTorch oracle in `naive.py`. The fake (meta) kernel below runs the argument checks of the Python
backends (`_checks.py`), so a bad call fails at `torch.compile` trace time as it would when run.
"""
from __future__ import annotations

import numbers

import torch

from sbd_kernels.ops._cuda import register_triton_kernel
from sbd_kernels.ops.scatter._checks import check_mask_scatter_args

__all__ = ["mask_scatter_"]

DEFAULT_GAMMA = 0.1  # the schema's default gamma_val


def mask_scatter_(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                  entropy: torch.Tensor, gamma: torch.Tensor | float | None = None, gamma_val: float | None = None,
                  rule: str = "eb", valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reveals, in every row, the set of still-masked block positions chosen by the EB or threshold rule.

    Candidates of row b: positions j with ``is_masked[b, j]`` and ``valid[b, j]``. They are ranked by
    entropy ascending, ties by lower position first; a NaN entropy ranks as +inf. With ``g`` the row's
    gamma (``gamma[b]`` for a tensor, else the number, rounded to fp32: beyond the fp32 range it is +inf):

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
        is_masked: ``[B, K]`` bool, updated in place: accepted positions become False.
        sampled: ``[B, K]`` int64 token chosen at each position.
        entropy: ``[B, K]`` float32 entropy of each position's predictive distribution.
        gamma: the threshold, >= 0: a ``[B]`` float32 tensor (one per row, read on the device: no host
            sync, CUDA-graph safe), a number (every row; the same as ``gamma_val``), or None to use
            ``gamma_val``.
        gamma_val: the threshold for every row when ``gamma`` is None (default 0.1). Maps with ``gamma``
            onto the op's schema ``Tensor? gamma, float gamma_val``.
        rule: ``"eb"`` or ``"threshold"``.
        valid: ``[B, K]`` bool; False positions are never accepted. None means all True.

    Returns:
        ``accepted [B, K]`` bool (positions revealed by this call), ``num_accepted [B]`` int32,
        ``block_done [B]`` bool (no position of the row is still masked after the update).

    Strides and aliasing:
        Every tensor argument may be any strided view (offset, non-contiguous, transposed). Read-only
        arguments (sampled, entropy, valid, gamma) may also be expanded (stride 0) and share memory with
        each other. ``block_tokens`` and ``is_masked`` are written through their strides, only at accepted
        positions; nothing outside them is written. They must have no two elements sharing memory, and
        share no memory with each other or with a read-only argument, except that ``sampled`` may be
        ``block_tokens`` itself and ``valid`` may be ``is_masked`` itself (same elements index for index).
        These layout checks read sizes, strides and data pointers only: exact for strided views (two
        disjoint halves or interleaved columns of one allocation are accepted), and an error when a
        layout built with ``as_strided`` is too irregular to decide.

    Errors:
        RuntimeError ``"sbd.mask_scatter_: <argument> ..."``, raised by every backend before anything
        is written:

        - ``block_tokens`` not a 2-D tensor; a tensor argument of the wrong dtype (block_tokens and
          sampled int64, is_masked and valid bool, entropy and gamma float32), shape (``[B, K]``, gamma
          ``[B]``) or device (not that of block_tokens; meta included);
        - ``block_tokens`` or ``is_masked`` with elements sharing memory (an expanded view, overlapping
          rows), or that may (undecidable layout);
        - ``block_tokens`` or ``is_masked`` sharing memory, or possibly sharing it, with each other or
          with ``sampled``, ``entropy``, ``valid`` or ``gamma`` (beyond the identical pairs above);
        - ``rule`` not in {"eb", "threshold"};
        - ``gamma_val`` < 0 or NaN; a ``gamma`` tensor entry < 0 or NaN (on CUDA checked without a host
          sync, raised at the next synchronisation). Inside ``sbd_kernels.ops.trusted_values()`` the check of
          the tensor's entries is skipped (for a caller that validated gamma once); gamma only enters
          comparisons, never an address, so nothing is written out of bounds: a NaN or negative entry accepts
          the first-ranked candidate of its row only (entropies >= 0). The C++ CPU kernel checks it on the host regardless;
        - on CUDA (Triton): K > 256, B > 2^31 - 1, or Triton not installed.

        Under ``torch.compile`` and on meta tensors the fake kernel raises the same errors at trace time,
        except those that need data: aliasing between arguments (fake tensors have no data pointers) and
        the values of a ``gamma`` tensor; the real kernel raises those when it runs.

        TypeError from this wrapper: ``gamma`` given as a number together with ``gamma_val``, or a
        ``gamma`` that is neither a tensor, a number nor None.

    Example:
        >>> import torch, sbd_kernels
        >>> tokens = torch.full((1, 4), -1, dtype=torch.int64)
        >>> masked = torch.ones(1, 4, dtype=torch.bool)
        >>> sampled = torch.tensor([[10, 11, 12, 13]])
        >>> entropy = torch.tensor([[0.30, 0.05, 0.02, 0.90]])
        >>> accepted, n, done = sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy, gamma=0.1)
        >>> tokens.tolist(), n.tolist(), done.tolist()
        ([[10, 11, 12, -1]], [3], [False])
        >>> per_row = torch.tensor([0.0])  # one gamma per row, on the device
        >>> accepted, n, done = sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy, per_row)
        >>> tokens.tolist(), n.tolist(), done.tolist()
        ([[10, 11, 12, 13]], [1], [True])
    """
    gamma_tensor, value = _schema_gamma(gamma, gamma_val)
    return torch.ops.sbd.mask_scatter_(block_tokens, is_masked, sampled, entropy, gamma_tensor, value, rule, valid)


def _schema_gamma(gamma: torch.Tensor | float | None, gamma_val: float | None
                  ) -> tuple[torch.Tensor | None, float]:
    """The schema's (``Tensor? gamma``, ``float gamma_val``) pair for the wrapper's ``gamma``/``gamma_val``."""
    if isinstance(gamma, torch.Tensor) or gamma is None:
        return gamma, DEFAULT_GAMMA if gamma_val is None else gamma_val
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"sbd.mask_scatter_: gamma must be a [B] float32 tensor, a number or None, "
                        f"got {type(gamma).__name__}")
    if gamma_val is not None:
        raise TypeError(f"sbd.mask_scatter_: gamma={gamma} is a number, so gamma_val={gamma_val} cannot also "
                        "be given; pass one of them")
    return None, float(gamma)


@torch.library.register_fake("sbd::mask_scatter_")
def _mask_scatter_fake(block_tokens, is_masked, sampled, entropy, gamma=None, gamma_val=0.1, rule="eb",
                       valid=None):
    batch, k = check_mask_scatter_args(block_tokens, is_masked, sampled, entropy, gamma, gamma_val, rule, valid)
    accepted = block_tokens.new_empty((batch, k), dtype=torch.bool)
    num_accepted = block_tokens.new_empty((batch,), dtype=torch.int32)
    block_done = block_tokens.new_empty((batch,), dtype=torch.bool)
    return accepted, num_accepted, block_done


register_triton_kernel("mask_scatter_", "scatter")

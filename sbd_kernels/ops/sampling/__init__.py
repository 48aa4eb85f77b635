"""`sbd.entropy_sample`: entropy, sampled token and its log-probability in one pass over the vocabulary.

Backends: C++ on CPU (csrc/cpu/sampling.cpp), Triton on CUDA (`triton.py`, loaded on first CUDA call),
pure-PyTorch oracle in `naive.py` (which also defines the random generator exactly).
"""
from __future__ import annotations

import torch

from sbd_kernels.ops._cuda import register_triton_kernel
from sbd_kernels.ops.sampling._checks import check_entropy_sample_args

__all__ = ["entropy_sample"]


def entropy_sample(logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                   temperature: torch.Tensor | None = None, temperature_val: float = 0.0,
                   compute_mask: torch.Tensor | None = None, mask_token_id: int = -1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy of softmax(logits), a sampled (or greedy) token and its log-probability, per position.

    For each position (b, j) with x = logits[b, j] (entry ``mask_token_id`` excluded, i.e. set to -inf)
    and T = temperature[b] (or ``temperature_val``):

        entropy = -sum_v p_v log p_v,   p = softmax(x)          (always temperature 1)
        token   = argmax_v x_v                    if T == 0     (lowest index on ties)
                  argmax_v (x_v / T + g_v)        if T > 0      (Gumbel-max: a draw from softmax(x / T))
        logprob = log p_token                                   (under softmax(x), temperature 1)

    g_v = -log(-log(u_v)) with u_v from Philox4x32-10 keyed on (seed[b], offset[b], j, v), defined bit for
    bit in `sbd_kernels.ops.sampling.naive`: the same (seed, offset, j, logits) give the same token on
    every backend (rare float near-ties aside) whatever the batch around the row. ``offset`` is meant to be
    the caller's step counter. The logits are read once; the math is fp32.

    Sentinels:
        - compute_mask[b, j] False: token -1, entropy +inf, logprob -inf, valid False (logits not read).
        - invalid position (a NaN or +inf logit, or no finite logit, e.g. V == 1 with that entry masked):
          token 0 (an in-range placeholder), entropy +inf, logprob -inf, valid False.
        - -inf logits have probability 0 and are never drawn; the mask token is never drawn.

    Args:
        logits: ``[B, K, V]`` float32 / float16 / bfloat16, any strides (vocabulary-contiguous is read in
            place, other layouts are copied once).
        seed: int64 ``[B]``, or one element (shape ``[]`` or ``[1]``) shared by every row.
        offset: int64 ``[B]``, or one element (shape ``[]`` or ``[1]``) shared by every row.
        temperature: float32 ``[B]`` (finite, >= 0), or None to use ``temperature_val`` for every row.
        temperature_val: scalar temperature (finite, >= 0) used when ``temperature`` is None.
        compute_mask: bool ``[B, K]``, positions to compute; None computes all.
        mask_token_id: -1 (none) or a vocabulary id in [0, V) never drawn and excluded from the entropy.

    Returns:
        ``tokens [B, K]`` int64, ``entropy [B, K]`` float32, ``logprob [B, K]`` float32,
        ``valid [B, K]`` bool.

    Errors (RuntimeError naming the argument): wrong dtype, shape or device; ``mask_token_id`` not -1 and
    not in [0, V); a temperature that is negative, NaN or infinite (on CUDA checked without a host sync,
    raised at the next synchronisation).

    Example:
        >>> import torch, sbd_kernels
        >>> logits = torch.tensor([[[0.0, 5.0, 1.0, 9.0], [2.0, 2.0, 0.0, 0.0]]])
        >>> seed, offset = torch.tensor([1234]), torch.tensor([0])
        >>> tokens, entropy, logprob, valid = sbd_kernels.entropy_sample(logits, seed, offset,
        ...                                                              mask_token_id=3)
        >>> tokens.tolist(), valid.tolist()
        ([[1, 0]], [[True, True]])
        >>> [round(h, 4) for h in entropy[0].tolist()]
        [0.1291, 0.8854]
    """
    return torch.ops.sbd.entropy_sample(logits, seed, offset, temperature, temperature_val, compute_mask,
                                        mask_token_id)


@torch.library.register_fake("sbd::entropy_sample")
def _entropy_sample_fake(logits, seed, offset, temperature=None, temperature_val=0.0, compute_mask=None,
                         mask_token_id=-1):
    batch, positions, _ = check_entropy_sample_args(logits, seed, offset, temperature, temperature_val,
                                                    compute_mask, mask_token_id)
    tokens = logits.new_empty((batch, positions), dtype=torch.int64)
    entropy = logits.new_empty((batch, positions), dtype=torch.float32)
    logprob = logits.new_empty((batch, positions), dtype=torch.float32)
    valid = logits.new_empty((batch, positions), dtype=torch.bool)
    return tokens, entropy, logprob, valid


register_triton_kernel("entropy_sample", "sampling")

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
                   temperature: torch.Tensor | float | None = None, temperature_val: float | None = None,
                   compute_mask: torch.Tensor | None = None, mask_token_id: int = -1,
                   top_k: torch.Tensor | int = 0, top_p: torch.Tensor | float = 1.0,
                   min_p: torch.Tensor | float = 0.0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy of softmax(logits), a sampled (or greedy) token and its log-probability, per position.

    For each position (b, j) with x = logits[b, j] (entry ``mask_token_id`` excluded, i.e. set to -inf)
    and T = temperature[b] (or the scalar temperature):

        entropy = -sum_v p_v log p_v,   p = softmax(x)          (always temperature 1)
        token   = argmax_v x_v                    if T == 0     (lowest index on ties)
                  argmax_{v kept} (x_v / T + g_v) if T > 0      (Gumbel-max: a draw from softmax(x / T)
                                                                 restricted to the kept tokens)
        logprob = log p_token                                   (under softmax(x), temperature 1)

    g_v = -log(-log(u_v)) with u_v from Philox4x32-10 keyed on (seed[b], offset[b], j, v), defined bit for
    bit in `sbd_kernels.ops.sampling.naive`: the same (seed, offset, j, logits) give the same token on
    every backend (rare float near-ties aside) whatever the batch around the row. ``offset`` is meant to be
    the caller's step counter. The logits are read once; the math is fp32, at fp32(T); x_v / T is a
    division in fp32 (no 1 / T that a subnormal T would overflow).

    Overflow rule: when the race's best score is +inf or -inf, i.e. x_m / T overflowed fp32 for the maximum
    m of the kept entries (tied maxima at 1 and T = 1e-40 all score +inf; every logit near -3e38 at T = 0.5
    scores -inf), the race is run again over the same kept entries with the same noise on
    (x_v - m) / T + g_v: tied maxima stay equally likely and a larger logit beats a smaller one. A race
    whose best score is finite is never rerun, so the tokens of such rows do not depend on this rule. Short
    of an overflow the race is the plain fp32 one: once |x_m / T| is so large that the sum rounds the noise
    (from ~2^22, e.g. logit 1 at T < 2e-7), tied maxima lean to the lowest index, and past ~2^28 (logit 1
    at T = 1e-38: x / T = 1e38, finite) the lowest index always wins, as at T == 0.

    Filters, per request like vLLM's and FlashInfer's (a [B] tensor, or a number for every row), applied
    in Hugging Face's order to softmax(x / T): top-k keeps the k largest logits; top-p then keeps the
    smallest set of most probable remaining tokens whose (renormalised) mass reaches top_p; min-p then
    keeps the tokens with probability >= min_p * the largest. Every cut-off keeps all the tokens tied with
    it (a threshold on the logit: the same set on every backend, found without sorting; Hugging Face's
    top-k rule). The largest logit is always kept; a filter that keeps everything draws exactly the
    unfiltered token; T == 0 ignores the filters; entropy and logprob stay unfiltered (temperature 1).
    Exact definitions: `sbd_kernels.ops.sampling.naive`.

    Sentinels:
        - compute_mask[b, j] False: token -1, entropy +inf, logprob -inf, valid False (logits not read).
        - invalid position (a NaN or +inf logit, or no finite logit, e.g. V == 1 with that entry masked):
          token 0 (an in-range placeholder), entropy +inf, logprob -inf, valid False.
        - -inf logits have probability 0 and are never drawn; the mask token is never drawn. Finite huge
          negative logits (e.g. ``torch.finfo(dtype).min`` as a mask value) are ordinary logits whose
          probability underflows to 0 beside any ordinary logit: such rows stay valid, with the entropy
          of the remaining entries.

    Args:
        logits: ``[B, K, V]`` float32 / float16 / bfloat16.
        seed: int64 ``[B]``, or one element (shape ``[]`` or ``[1]``) shared by every row.
        offset: int64 ``[B]``, or one element (shape ``[]`` or ``[1]``) shared by every row.
        temperature: float32 ``[B]`` tensor (finite, >= 0), or a Python number used for every row (as
            FlashInfer's sampling API takes it), or None to use ``temperature_val``.
        temperature_val: scalar temperature used when ``temperature`` is None (default 0.0: greedy); the
            schema's own scalar argument, kept so that ``temperature=None, temperature_val=0.7`` works.
        compute_mask: bool ``[B, K]``, positions to compute; None computes all.
        mask_token_id: -1 (none) or a vocabulary id in [0, V) never drawn and excluded from the entropy.
        top_k: int64 ``[B]`` tensor or a number, >= 0; 0 (or >= V) is off.
        top_p: float32 ``[B]`` tensor or a number, in (0, 1]; 1 is off.
        min_p: float32 ``[B]`` tensor or a number, in [0, 1); 0 is off.

    Returns:
        ``tokens [B, K]`` int64, ``entropy [B, K]`` float32, ``logprob [B, K]`` float32,
        ``valid [B, K]`` bool: new contiguous tensors on the device of ``logits``.

    Strides: every tensor argument may have any strides, including a storage offset and stride 0 (e.g.
    ``torch.tensor([7]).expand(B)`` for seed, offset, temperature or a filter); ``logits`` whose vocabulary is
    contiguous (stride(2) == 1) is read in place whatever its row strides, any other layout (and a
    non-contiguous ``compute_mask``) is copied once. No argument is ever written.

    Errors (RuntimeError naming the argument, the same words on every backend):
        - ``logits`` not 3-D, not float32 / float16 / bfloat16, or with V == 0 (on CUDA also V > 2^31 - 2^16, or
          B * K > 2^31 - 1 rows);
        - ``seed`` / ``offset`` not int64, not on the device of logits, or not of shape [B], [] or [1];
        - ``temperature`` not float32, not on the device of logits, or not of shape [B];
        - a ``temperature`` entry that is negative, NaN or infinite (on CUDA checked without a host sync,
          raised at the next synchronisation);
        - ``temperature_val`` (or a number passed as ``temperature``) negative, NaN, or infinite as a float32:
          the kernels run at fp32(T), so a number is checked as that float32, like a tensor entry (a double
          from 2^128 - 2^103 = 3.4028235677973366e+38 up is inf; 3.4028235e+38 rounds to the largest float32
          and is accepted);
        - ``compute_mask`` not bool, not on the device of logits, or not of shape [B, K];
        - ``mask_token_id`` not -1 and not in [0, V);
        - ``top_k`` / ``top_p`` / ``min_p`` tensors not int64 / float32 / float32, not on the device of
          logits, or not of shape [B]; an entry out of range (top_k < 0, top_p outside (0, 1], min_p
          outside [0, 1), NaN): on CUDA checked without a host sync, like the temperature;
        - a number out of those ranges (the schema's ``top_k_val`` / ``top_p_val`` / ``min_p_val``), top_p and
          min_p checked as float32s like the temperature (top_p 1e-50 is 0 as a float32, min_p 1 - 1e-12 is 1;
          the message then gives that float32).
        Inside ``sbd_kernels.ops.trusted_values()`` the checks of tensor entries (temperature, top_k, top_p,
        min_p) are skipped (for a caller that validated them once); these values only enter comparisons,
        never an address (every read stays in [0, V) of its row, every write at its position), so nothing is
        read or written out of bounds: a bad entry gives an unspecified token for its row instead of an
        error. The C++ CPU kernel checks them on the host regardless.
      ValueError from this wrapper: a number passed as ``temperature`` together with ``temperature_val``.

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
        >>> tokens, *_ = sbd_kernels.entropy_sample(logits, seed, offset, temperature=0.0)  # a number
        >>> tokens.tolist()
        [[3, 0]]

        Sampling at T = 1 with filters (a [B] tensor or a number each): top-k 1 keeps the largest logit,
        with every token tied with it, so the second row draws 0 or 1 and never 2 or 3; the entropy is
        still the unfiltered one.

        >>> draws = [sbd_kernels.entropy_sample(logits, torch.tensor([s]), offset, temperature=1.0,
        ...                                     top_k=torch.tensor([1]), top_p=0.9)
        ...          for s in range(20)]
        >>> sorted({int(tokens[0, 1]) for tokens, *_ in draws}), {int(tokens[0, 0]) for tokens, *_ in draws}
        ([0, 1], {3})
        >>> torch.allclose(draws[0][1], sbd_kernels.entropy_sample(logits, seed, offset)[1])
        True
    """
    temperature, temperature_val = _tensor_or_scalar("temperature", temperature, temperature_val, 0.0)
    top_k, top_k_val = _tensor_or_scalar("top_k", top_k, None, 0)
    top_p, top_p_val = _tensor_or_scalar("top_p", top_p, None, 1.0)
    min_p, min_p_val = _tensor_or_scalar("min_p", min_p, None, 0.0)
    return torch.ops.sbd.entropy_sample(logits, seed, offset, temperature, temperature_val, compute_mask,
                                        mask_token_id, top_k, top_k_val, top_p, top_p_val, min_p, min_p_val)


def _tensor_or_scalar(name: str, value, value_val, default):
    """The schema's (Tensor? name, name_val) pair from a tensor, a Python number, or None + name_val."""
    if isinstance(value, torch.Tensor):
        return value, default if value_val is None else value_val
    if value is None:
        return None, default if value_val is None else value_val
    if value_val is not None:
        raise ValueError(f"sbd.entropy_sample: pass {name} either as a number or as {name}_val, not both "
                         f"(got {name}={value!r}, {name}_val={value_val!r})")
    return None, value


@torch.library.register_fake("sbd::entropy_sample")
def _entropy_sample_fake(logits, seed, offset, temperature=None, temperature_val=0.0, compute_mask=None,
                         mask_token_id=-1, top_k=None, top_k_val=0, top_p=None, top_p_val=1.0, min_p=None,
                         min_p_val=0.0):
    batch, positions, _ = check_entropy_sample_args(logits, seed, offset, temperature, temperature_val,
                                                    compute_mask, mask_token_id, top_k, top_k_val, top_p,
                                                    top_p_val, min_p, min_p_val)
    tokens = logits.new_empty((batch, positions), dtype=torch.int64)
    entropy = logits.new_empty((batch, positions), dtype=torch.float32)
    logprob = logits.new_empty((batch, positions), dtype=torch.float32)
    valid = logits.new_empty((batch, positions), dtype=torch.bool)
    return tokens, entropy, logprob, valid


register_triton_kernel("entropy_sample", "sampling")

"""Pure-PyTorch oracle of `sbd.entropy_sample`, and the public definition of its random generator.

Math (per computed position (b, j), x = logits[b, j, :] in fp32, the entry `mask_token_id` set to -inf):

    valid   = no x_v is NaN or +inf, and some x_v is finite
    p       = softmax(x)                       (temperature 1, fp64 here)
    entropy = -sum_v p_v log p_v               (terms with p_v = 0 count 0)
    token   = argmax_v x_v                                   if T == 0 (lowest index on ties)
              argmax_{v kept} (x_v / T + g_v)  (fp32, lowest index on ties)   if T > 0
    logprob = log p_token

Overflow rule (T > 0): x_v / T can overflow fp32 for the largest logits (tied maxima at 1 and T = 1e-38
all score +inf, and the first would always win), or for every logit (all of them near -3e38 at T = 0.5
score -inf). When the race's best score is +inf or -inf, i.e. when x_m / T overflowed for the maximum m
of the kept entries (the row's maximum, the mask token excluded; the filters never remove it), the race
is run again over the same kept entries with the same noise on the scores

    s_v = (x_v - m) / T + g_v        (fp32; x_v - m then / T, lowest index on ties)

the limit of the race as the scale of x / T shrinks: tied maxima score g_v alone and stay equally likely,
a larger logit beats a smaller one, and the maximum's score is finite, so a sampled valid row always
draws a token. A race whose best score is finite is never rerun: its token does not depend on this rule
(short of an overflow, a huge finite x_m / T rounds the noise away and tied maxima go to the lowest index).
Invalid positions: token 0, entropy +inf, logprob -inf, valid False. Positions not computed
(compute_mask False): token -1, entropy +inf, logprob -inf, valid False.

Filters (T > 0 only; Hugging Face's order and meaning: temperature, then top-k, then top-p, then min-p),
on q = softmax(x / T) over the entries not -inf; each keeps the entries whose logit is >= a threshold:

    top-k (k > 0 and k < V):  tau_k = the k-th largest x_v, ties counted (-inf if fewer than k are > -inf)
    top-p (p < 1):            tau_p = the largest logit t with  sum_{x_v >= t} q'_v >= p,  q' = q restricted
                              to {x_v >= tau_k} and renormalised: the smallest set of most probable tokens
                              whose mass reaches p, completed with every token tied with its last one
    min-p (min_p > 0):        keep q_v >= min_p * max q, i.e. x_v >= max x + T ln(min_p)
    kept = {v : x_v >= max(tau_k, tau_p, tau_m)}

Ties at a cut-off are all kept ("every token whose logit equals the threshold"): a threshold on the logit
is what a selection or pivot search finds without sorting, it is the same set on every backend whatever
their summation or index order, and it is Hugging Face's top-k rule (scores < the k-th value removed);
Hugging Face's top-p splits a tie group at the cut-off in sort order, this keeps the whole group. Kept
sets are ranked by logit, the order of x / T. The filters never remove the largest logit. The draw is
the same Gumbel-max with the same noise, restricted to the kept set: a filter that keeps every token
gives exactly the unfiltered token. entropy and logprob stay those of softmax(x), unfiltered.

Random generator (a public contract: every backend draws these exact numbers, so tokens can be reproduced
from (seed, offset) alone, whatever the batch around a row):

    Philox4x32-10 (Salmon et al. 2011; cuRAND's and Triton's `tl.philox`), multipliers 0xD2511F53 and
    0xCD9E8D57, key increments 0x9E3779B9 and 0xBB67AE85.
    key     = (s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF)           s = seed[b] as 64 bits
    counter = (c0, j, o & 0xFFFFFFFF, (o >> 32) & 0xFFFFFFFF)    o = offset[b] as 64 bits, j = position
    c0      = (v >> 6) * 16 + (v & 15)                           v = vocabulary index
    r       = word (v >> 4) & 3 of Philox4x32-10(counter, key)   (words 0..3 in output order)
    u       = (2 * (r >> 9) + 1) * 2^-24                         fp32, exact, in [2^-24, 1 - 2^-24]
    g_v     = -log(-log(u))                                      fp32 (Gumbel(0, 1))

One Philox call yields the noise of 4 vocabulary entries, 16 apart, so a block of 64 consecutive entries
takes 16 calls on consecutive counters (one SIMD register of counters on AVX-512). u keeps 23 random bits
so that 2 * (r >> 9) + 1 < 2^24 converts to fp32 exactly on every backend and u is never 0 or 1.
"""
from __future__ import annotations

import torch

from sbd_kernels.ops._float32 import as_float32
from sbd_kernels.ops.sampling._checks import (
    check_entropy_sample_args,
    filters_requested,
    per_row_value_checks,
)

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a uint32 constant a and int64 tensor b < 2^32, without overflow.

    b is split in 16-bit halves so that every partial product stays below 2^49.
    """
    low = a * (b & 0xFFFF)
    high = a * (b >> 16)
    mid = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (mid >> 32), mid & MASK32


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcast together); returns 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, positions: int, vocab: int) -> torch.Tensor:
    """u[b, j, v] in (0, 1), fp32, as defined in the module docstring; seed, offset: int64 [B]."""
    v = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    c0 = (((v >> 6) << 4) | (v & 15)).view(1, 1, -1)
    c1 = torch.arange(positions, dtype=torch.int64, device=seed.device).view(1, -1, 1)
    c2 = (offset & MASK32).view(-1, 1, 1)
    c3 = ((offset >> 32) & MASK32).view(-1, 1, 1)
    key = ((seed & MASK32).view(-1, 1, 1), ((seed >> 32) & MASK32).view(-1, 1, 1))
    words = philox4x32_10((c0, c1, c2, c3), key)
    word_of_v = ((v >> 4) & 3).view(1, 1, -1)
    r = torch.zeros(torch.broadcast_shapes(*(w.shape for w in words)), dtype=torch.int64, device=seed.device)
    for w, word in enumerate(words):
        r = torch.where(word_of_v == w, word.expand_as(r), r)
    return (2 * (r >> 9) + 1).to(torch.float32) * 2.0**-24


def gumbel_noise(seed: torch.Tensor, offset: torch.Tensor, positions: int, vocab: int) -> torch.Tensor:
    """g[b, j, v] = -log(-log(u)) in fp32, shape [B, K, V]."""
    u = philox_uniform(seed, offset, positions, vocab)
    return -torch.log(-torch.log(u))


def kept_by_filters(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Bool [B, K, V]: the entries the filters keep (module docstring), literally: sort, cumsum, mask.

    x: fp32 [B, K, V] (mask token at -inf); temperature, top_p, min_p: fp32 [B]; top_k: int64 [B].
    Every entry of a row with T == 0 is kept (greedy ignores the filters).
    """
    vocab = x.shape[-1]
    t = torch.where(temperature > 0, temperature, 1.0).double().view(-1, 1, 1)
    x64 = x.double()
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)                  # [B, K, V]

    k = top_k.view(-1, 1, 1)
    kth = sorted_x.gather(-1, (k - 1).clamp(0, vocab - 1).expand(*x.shape[:2], 1))    # k-th largest
    keep = torch.where((k > 0) & (k < vocab), x >= kth, True)

    q = torch.softmax(torch.where(keep, x64 / t, float("-inf")), dim=-1)            # fp64, renormalised
    cumulative = q.gather(-1, order).cumsum(-1)                                      # mass of the top i + 1
    p = top_p.double().view(-1, 1, 1)
    first = (cumulative >= p * cumulative[..., -1:]).to(torch.int8).argmax(-1, keepdim=True)
    keep &= torch.where(p < 1, x >= sorted_x.gather(-1, first), True)

    q = torch.softmax(torch.where(keep, x64 / t, float("-inf")), dim=-1)
    min_p = min_p.double().view(-1, 1, 1)
    keep &= torch.where(min_p > 0, q >= min_p * q.amax(-1, keepdim=True), True)
    return keep | (temperature.view(-1, 1, 1) == 0)


def entropy_sample(logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                   temperature: torch.Tensor | None = None, temperature_val: float = 0.0,
                   compute_mask: torch.Tensor | None = None, mask_token_id: int = -1,
                   top_k: torch.Tensor | None = None, top_k_val: int = 0,
                   top_p: torch.Tensor | None = None, top_p_val: float = 1.0,
                   min_p: torch.Tensor | None = None, min_p_val: float = 0.0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle of `sbd.entropy_sample` (same arguments, same returns; see the module docstring)."""
    batch, positions, vocab = check_entropy_sample_args(logits, seed, offset, temperature, temperature_val,
                                                        compute_mask, mask_token_id, top_k, top_k_val,
                                                        top_p, top_p_val, min_p, min_p_val)
    for ok, message in per_row_value_checks(temperature, top_k, top_p, min_p):
        if not bool(ok):
            raise RuntimeError(message)
    device = logits.device
    seed = seed.reshape(-1).expand(batch)
    offset = offset.reshape(-1).expand(batch)

    def per_row(t, value, dtype):
        return t if t is not None else torch.full((batch,), value, dtype=dtype, device=device)

    # Numbers are rounded first: torch.full refuses a double above the largest float32 (3.4028235e38)
    # that rounds to it.
    temperature = per_row(temperature, as_float32(temperature_val), torch.float32)
    filters = filters_requested(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val)
    top_k = per_row(top_k, top_k_val, torch.int64)
    top_p = per_row(top_p, as_float32(top_p_val), torch.float32)
    min_p = per_row(min_p, as_float32(min_p_val), torch.float32)
    if compute_mask is None:
        compute_mask = torch.ones(batch, positions, dtype=torch.bool, device=device)

    x = logits.to(torch.float32).clone()                       # [B, K, V]
    if mask_token_id >= 0:
        x[..., mask_token_id] = float("-inf")
    valid = compute_mask & ~(torch.isnan(x) | (x == float("inf"))).any(-1) & torch.isfinite(x).any(-1)

    # Entropy and log-probabilities at temperature 1, in fp64; invalid rows are zeroed to keep NaN out.
    x64 = torch.where(valid.unsqueeze(-1), x.double(), torch.zeros((), dtype=torch.float64))
    logp = torch.log_softmax(x64, dim=-1)                      # [B, K, V]
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros((), dtype=torch.float64)).sum(-1)

    greedy = torch.where(valid.unsqueeze(-1), x, torch.zeros(())).argmax(-1)  # first maximum
    t = temperature.view(-1, 1, 1)
    noise = gumbel_noise(seed, offset, positions, vocab)                  # fp32 [B, K, V]
    kept = kept_by_filters(x, temperature, top_k, top_p, min_p) if filters else torch.ones_like(valid[..., None])
    scores = torch.where(kept, x / t + noise, float("-inf"))
    # Overflow rule: rows whose best score is +-inf race again on (x - m) / T + g, m the kept maximum.
    overflowed = torch.isinf(scores.amax(-1, keepdim=True))                           # [B, K, 1]
    m = torch.where(kept, x, float("-inf")).amax(-1, keepdim=True)
    rerun = torch.where(kept, (x - m) / t + noise, float("-inf"))
    sampled = torch.where(overflowed, rerun, scores).argmax(-1)
    tokens = torch.where(temperature.view(-1, 1) > 0, sampled, greedy)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    tokens = torch.where(valid, tokens, torch.where(compute_mask, 0, -1))
    entropy = torch.where(valid, entropy, float("inf")).to(torch.float32)
    logprob = torch.where(valid, logprob, float("-inf")).to(torch.float32)
    return tokens, entropy, logprob, valid

"""Triton kernel of `sbd::mask_scatter_`: one program per sequence, no host sync.

Math (see `naive.py` for the literal version): candidates of row b are the positions with
is_masked & valid, ranked by (entropy, position) ascending with NaN as +inf. Rule "eb": the candidate of
rank r is accepted iff r == 0 or the fp32 sum, term by term in rank order, of the entropies ranked before
it is <= gamma[b]. Rule "threshold": iff r == 0 or its entropy < gamma[b]. Accepted positions get
block_tokens = sampled and is_masked = False.

Ranking without a sort: the EB loop peels the candidates off in rank order, one per iteration: the
smallest remaining entropy (`tl.min`), then the lowest position holding it (`tl.min` over positions).
That is two K-wide reductions per candidate, O(K^2 / 32) work per row with one warp, and it yields the
entropies in exactly the order the fp32 sum must use. The threshold rule needs only the first candidate.

Addresses are int64: a row or position index times a stride typed i32 (any stride below 2^31) passes 2^31
elements in large or strided tensors, e.g. position 255 of a row whose positions lie 2^24 elements apart.
"""
from __future__ import annotations

import torch
import triton.language as tl

from sbd_kernels.ops._aot import (
    MAX_GRID_X,
    KernelLaunch,
    KernelSpec,
    launch,
    next_power_of_2,
    spec_of_launch,
    unique_specs,
    unspecialised_jit,
)
from sbd_kernels.ops.scatter._checks import assert_gamma_values, check_mask_scatter_args, gamma_fp32

# Largest block the launcher accepts. The row lives in registers of one warp: K = 256 is 8 entries per
# thread per tensor, and the EB loop's 256 iterations of two warp-shuffle reductions stay in the few-us
# range. Larger K would need a chunked row; SBD blocks are 16 in the paper, at most 64 in practice.
MAX_BLOCK_K = 256
# Smallest block: one element per thread of a warp at 32, so smaller K just pads the same registers.
MIN_BLOCK_K = 16
# One warp: every reduction of the EB loop is a warp shuffle, with no shared memory and no barrier,
# which matters because the loop runs up to K reductions back to back.
NUM_WARPS = 1


@unspecialised_jit
def _scatter_accept_kernel(
    tokens_ptr, masked_ptr, sampled_ptr, entropy_ptr, valid_ptr, gamma_ptr,
    accepted_ptr, num_accepted_ptr, done_ptr,
    K, gamma_val,
    stride_tokens_b, stride_tokens_k, stride_masked_b, stride_masked_k,
    stride_sampled_b, stride_sampled_k, stride_entropy_b, stride_entropy_k,
    stride_valid_b, stride_valid_k, stride_gamma,
    BLOCK_K: tl.constexpr, IS_EB: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_VALID: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    in_row = offs < K
    # Positions as int64 for the addresses only: the ranking below stays on int32 lanes (int64 reductions
    # would take two warp shuffles each).
    pos = offs.to(tl.int64)

    masked = tl.load(masked_ptr + row * stride_masked_b + pos * stride_masked_k, mask=in_row, other=0) != 0
    candidate = masked
    if HAS_VALID:
        valid = tl.load(valid_ptr + row * stride_valid_b + pos * stride_valid_k, mask=in_row, other=0)
        candidate = candidate & (valid != 0)
    entropy = tl.load(entropy_ptr + row * stride_entropy_b + pos * stride_entropy_k, mask=in_row,
                      other=float("inf")).to(tl.float32)
    is_nan = entropy != entropy  # noqa: PLR0124 (the one value unequal to itself)
    entropy = tl.where(is_nan, float("inf"), entropy)  # NaN ranks as +inf
    if HAS_GAMMA:
        gamma = tl.load(gamma_ptr + row * stride_gamma).to(tl.float32)
    else:
        gamma = gamma_val

    if IS_EB:
        accepted = offs < 0
        remaining = candidate
        before = tl.zeros((), dtype=tl.float32)  # fp32 sum of the entropies ranked before
        num_candidates = tl.sum(candidate.to(tl.int32), axis=0)
        for rank in range(num_candidates):
            smallest = tl.min(tl.where(remaining, entropy, float("inf")), axis=0)
            first = tl.min(tl.where(remaining & (entropy == smallest), offs, BLOCK_K), axis=0)
            take = (rank == 0) | (before <= gamma)
            accepted = accepted | ((offs == first) & take)
            before = before + smallest
            remaining = remaining & (offs != first)
    else:
        smallest = tl.min(tl.where(candidate, entropy, float("inf")), axis=0)
        first = tl.min(tl.where(candidate & (entropy == smallest), offs, BLOCK_K), axis=0)
        accepted = candidate & ((entropy < gamma) | (offs == first))

    sampled = tl.load(sampled_ptr + row * stride_sampled_b + pos * stride_sampled_k, mask=accepted, other=0)
    tl.store(tokens_ptr + row * stride_tokens_b + pos * stride_tokens_k, sampled, mask=accepted)
    tl.store(masked_ptr + row * stride_masked_b + pos * stride_masked_k, offs < 0, mask=accepted)
    tl.store(accepted_ptr + row * K + pos, accepted, mask=in_row)
    tl.store(num_accepted_ptr + row, tl.sum(accepted.to(tl.int32), axis=0))
    still_masked = tl.sum((masked & ~accepted).to(tl.int32), axis=0)
    tl.store(done_ptr + row, still_masked == 0)


def _block_k(k: int) -> int:
    return max(MIN_BLOCK_K, next_power_of_2(k))


def _scatter_launches(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                      entropy: torch.Tensor, gamma: torch.Tensor | None = None, gamma_val: float = 0.1,
                      rule: str = "eb", valid: torch.Tensor | None = None
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[KernelLaunch]]:
    """Everything the launcher does but run the kernel: the checks, the three outputs and the launch (none
    when the batch is empty). On META tensors, the configuration a CUDA call would compile."""
    batch, k = check_mask_scatter_args(block_tokens, is_masked, sampled, entropy, gamma, gamma_val, rule, valid)
    assert_gamma_values(gamma)
    if k > MAX_BLOCK_K:
        raise RuntimeError(f"sbd.mask_scatter_: block_tokens has K = {k} positions; the Triton kernel "
                           f"supports K <= {MAX_BLOCK_K}")
    if batch > MAX_GRID_X:
        raise RuntimeError(f"sbd.mask_scatter_: block_tokens has B = {batch} rows; the Triton kernel supports "
                           f"B <= 2^31 - 1 (one program per row)")
    device = block_tokens.device
    accepted = torch.empty(batch, k, dtype=torch.bool, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    block_done = torch.empty(batch, dtype=torch.bool, device=device)
    outputs = (accepted, num_accepted, block_done)
    if batch == 0:
        return outputs, []
    valid_arg = is_masked if valid is None else valid  # never read when HAS_VALID is False
    gamma_arg = entropy if gamma is None else gamma  # never read when HAS_GAMMA is False
    stride_tokens_b, stride_tokens_k = block_tokens.stride()
    stride_masked_b, stride_masked_k = is_masked.stride()
    stride_sampled_b, stride_sampled_k = sampled.stride()
    stride_entropy_b, stride_entropy_k = entropy.stride()
    stride_valid_b, stride_valid_k = valid_arg.stride()
    accept = KernelLaunch(_scatter_accept_kernel, (batch,), {
        "tokens_ptr": block_tokens, "masked_ptr": is_masked, "sampled_ptr": sampled, "entropy_ptr": entropy,
        "valid_ptr": valid_arg, "gamma_ptr": gamma_arg,
        "accepted_ptr": accepted, "num_accepted_ptr": num_accepted, "done_ptr": block_done,
        # gamma_val is rounded on the host as every backend does, so it compares the same.
        "K": k, "gamma_val": gamma_fp32(gamma_val),
        "stride_tokens_b": stride_tokens_b, "stride_tokens_k": stride_tokens_k,
        "stride_masked_b": stride_masked_b, "stride_masked_k": stride_masked_k,
        "stride_sampled_b": stride_sampled_b, "stride_sampled_k": stride_sampled_k,
        "stride_entropy_b": stride_entropy_b, "stride_entropy_k": stride_entropy_k,
        "stride_valid_b": stride_valid_b, "stride_valid_k": stride_valid_k, "stride_gamma": gamma_arg.stride(0),
    }, {"BLOCK_K": _block_k(k), "IS_EB": rule == "eb", "HAS_GAMMA": gamma is not None,
        "HAS_VALID": valid is not None}, NUM_WARPS)
    return outputs, [accept]


def mask_scatter_(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                  entropy: torch.Tensor, gamma: torch.Tensor | None = None, gamma_val: float = 0.1,
                  rule: str = "eb", valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of `sbd.mask_scatter_` (same signature and contract); K <= 256."""
    outputs, launches = _scatter_launches(block_tokens, is_masked, sampled, entropy, gamma, gamma_val, rule, valid)
    launch(launches)
    return outputs


def _spec_name(kl: KernelLaunch) -> str:
    """Readable id of the configuration a launch compiles: its constexprs."""
    c = kl.constexprs
    return (f"mask_scatter_/accept BLOCK_K={c['BLOCK_K']} rule={'eb' if c['IS_EB'] else 'threshold'} "
            f"gamma={'tensor' if c['HAS_GAMMA'] else 'scalar'} valid={'yes' if c['HAS_VALID'] else 'no'}")


def specs_of_launches(launches: list[KernelLaunch]) -> list[KernelSpec]:
    """The compile job of each launch, named by its configuration."""
    return [spec_of_launch(_spec_name(kl), kl) for kl in launches]


def meta_launches(batch: int, k: int, rule: str = "eb", gamma_tensor: bool = True,
                  valid: bool = False) -> list[KernelLaunch]:
    """The launches of a call on fresh contiguous META tensors (no memory) of [batch, k] positions: int64
    tokens, bool masks, fp32 entropy, gamma a [batch] fp32 tensor or a scalar. What a CUDA call compiles."""
    meta = {"device": "meta"}
    tokens = torch.empty(batch, k, dtype=torch.int64, **meta)
    masks = torch.empty(batch, k, dtype=torch.bool, **meta)
    return _scatter_launches(tokens, masks, torch.empty_like(tokens), torch.empty(batch, k, **meta),
                             torch.empty(batch, **meta) if gamma_tensor else None, 0.1, rule,
                             torch.empty_like(masks) if valid else None)[1]


def aot_specs() -> list[KernelSpec]:
    """Every configuration the launcher can pick, from the launches of representative calls (batch 2):
    BLOCK_K (K = 16, 32, ..., 256) x rule x gamma tensor / scalar x valid given or not."""
    launches = []
    block = MIN_BLOCK_K
    while block <= MAX_BLOCK_K:
        launches += [kl for rule in ("eb", "threshold") for gamma_tensor in (True, False)
                     for valid in (True, False) for kl in meta_launches(2, block, rule, gamma_tensor, valid)]
        block *= 2
    return unique_specs(specs_of_launches(launches))


def picked_specs(batch: int, k: int, rule: str = "eb", gamma_tensor: bool = True, valid: bool = False) -> list[str]:
    """Name (as in `aot_specs()`) of the configuration a CUDA call on fresh contiguous tensors of [batch, k]
    positions compiles (`meta_launches`)."""
    return [spec.name for spec in specs_of_launches(meta_launches(batch, k, rule, gamma_tensor, valid))]

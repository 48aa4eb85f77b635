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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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


@triton.jit
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

    masked = tl.load(masked_ptr + row * stride_masked_b + offs * stride_masked_k, mask=in_row, other=0) != 0
    candidate = masked
    if HAS_VALID:
        valid = tl.load(valid_ptr + row * stride_valid_b + offs * stride_valid_k, mask=in_row, other=0)
        candidate = candidate & (valid != 0)
    entropy = tl.load(entropy_ptr + row * stride_entropy_b + offs * stride_entropy_k, mask=in_row,
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

    sampled = tl.load(sampled_ptr + row * stride_sampled_b + offs * stride_sampled_k, mask=accepted, other=0)
    tl.store(tokens_ptr + row * stride_tokens_b + offs * stride_tokens_k, sampled, mask=accepted)
    tl.store(masked_ptr + row * stride_masked_b + offs * stride_masked_k, offs < 0, mask=accepted)
    tl.store(accepted_ptr + row * K + offs, accepted, mask=in_row)
    tl.store(num_accepted_ptr + row, tl.sum(accepted.to(tl.int32), axis=0))
    still_masked = tl.sum((masked & ~accepted).to(tl.int32), axis=0)
    tl.store(done_ptr + row, still_masked == 0)


def _block_k(k: int) -> int:
    return max(MIN_BLOCK_K, triton.next_power_of_2(k))


def mask_scatter_(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                  entropy: torch.Tensor, gamma: torch.Tensor | None = None, gamma_val: float = 0.1,
                  rule: str = "eb", valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of `sbd.mask_scatter_` (same signature and contract); K <= 256."""
    batch, k = check_mask_scatter_args(block_tokens, is_masked, sampled, entropy, gamma, gamma_val, rule, valid)
    assert_gamma_values(gamma)
    if k > MAX_BLOCK_K:
        raise RuntimeError(f"sbd.mask_scatter_: block_tokens has K = {k} positions; the Triton kernel "
                           f"supports K <= {MAX_BLOCK_K}")
    device = block_tokens.device
    accepted = torch.empty(batch, k, dtype=torch.bool, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    block_done = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return accepted, num_accepted, block_done
    valid_arg = is_masked if valid is None else valid  # never read when HAS_VALID is False
    gamma_arg = entropy if gamma is None else gamma  # never read when HAS_GAMMA is False
    _scatter_accept_kernel[(batch,)](
        block_tokens, is_masked, sampled, entropy, valid_arg, gamma_arg,
        accepted, num_accepted, block_done,
        k, gamma_fp32(gamma_val),  # rounded on the host as every backend does, so it compares the same
        block_tokens.stride(0), block_tokens.stride(1), is_masked.stride(0), is_masked.stride(1),
        sampled.stride(0), sampled.stride(1), entropy.stride(0), entropy.stride(1),
        valid_arg.stride(0), valid_arg.stride(1), gamma_arg.stride(0),
        BLOCK_K=_block_k(k), IS_EB=rule == "eb", HAS_GAMMA=gamma is not None, HAS_VALID=valid is not None,
        num_warps=NUM_WARPS,
    )
    return accepted, num_accepted, block_done


def _accept_name(block: int, is_eb: bool, has_gamma: bool, has_valid: bool) -> str:
    """Readable id of one configuration of `_scatter_accept_kernel` (its constexprs)."""
    return (f"mask_scatter_/accept BLOCK_K={block} rule={'eb' if is_eb else 'threshold'} "
            f"gamma={'tensor' if has_gamma else 'scalar'} valid={'yes' if has_valid else 'no'}")


def aot_specs():
    """Every configuration the launcher can pick: BLOCK_K x rule x gamma tensor/scalar x valid given."""
    from sbd_kernels.ops._aot import KernelSpec

    signature = {
        "tokens_ptr": "*i64", "masked_ptr": "*i1", "sampled_ptr": "*i64", "entropy_ptr": "*fp32",
        "valid_ptr": "*i1", "gamma_ptr": "*fp32",
        "accepted_ptr": "*i1", "num_accepted_ptr": "*i32", "done_ptr": "*i1",
        "K": "i32", "gamma_val": "fp32",
        **{f"stride_{name}_{axis}": "i32" for name in ("tokens", "masked", "sampled", "entropy", "valid")
           for axis in ("b", "k")},
        "stride_gamma": "i32",
        "BLOCK_K": "constexpr", "IS_EB": "constexpr", "HAS_GAMMA": "constexpr", "HAS_VALID": "constexpr",
    }
    specs = []
    block = MIN_BLOCK_K
    while block <= MAX_BLOCK_K:
        for is_eb in (True, False):
            for has_gamma in (True, False):
                for has_valid in (True, False):
                    name = _accept_name(block, is_eb, has_gamma, has_valid)
                    constexprs = {"BLOCK_K": block, "IS_EB": is_eb, "HAS_GAMMA": has_gamma,
                                  "HAS_VALID": has_valid}
                    specs.append(KernelSpec(name, _scatter_accept_kernel, signature, constexprs,
                                            num_warps=NUM_WARPS))
        block *= 2
    return specs


def picked_specs(k: int, rule: str = "eb", gamma_tensor: bool = True, valid: bool = False) -> list[str]:
    """Name (as in `aot_specs()`) of the configuration a launch over blocks of `k` positions compiles,
    BLOCK_K chosen by the launcher's `_block_k`."""
    return [_accept_name(_block_k(k), rule == "eb", gamma_tensor, valid)]

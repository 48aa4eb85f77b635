"""Pure-PyTorch oracle of `sbd::mask_scatter_`: the acceptance rules written out literally, row by row.

For each row b, the candidates are the positions j with is_masked[b, j] and valid[b, j]. They are
ranked by (entropy, position) ascending, a NaN entropy counting as +inf. With gamma = gamma[b] (or
gamma_val rounded to fp32: beyond the fp32 range it is +inf):
- rule "eb" (docs/algorithm.md §3.5): the candidate of rank r is accepted iff r == 0 or
  fl32(...fl32(fl32(0 + H_0) + H_1) ... + H_{r-1}) <= gamma, the entropies of the candidates ranked
  before it summed one by one in fp32, in rank order (every backend sums in this order, so decisions
  agree bit for bit at the boundary).
- rule "threshold": the candidate of rank r is accepted iff r == 0 or H_r < gamma.
Accepted positions: block_tokens[b, j] = sampled[b, j], is_masked[b, j] = False; nothing else is written.
"""
from __future__ import annotations

import torch

from sbd_kernels.ops.scatter._checks import assert_gamma_values, check_mask_scatter_args, gamma_fp32


def _ranked_candidates(masked: torch.Tensor, valid: torch.Tensor, key: torch.Tensor) -> list[int]:
    """Positions of one row's candidates, sorted by (key, position)."""
    candidates = [j for j in range(masked.numel()) if bool(masked[j]) and bool(valid[j])]
    return sorted(candidates, key=lambda j: (float(key[j]), j))


def _accept_row(ranked: list[int], key: torch.Tensor, gamma: torch.Tensor, rule: str) -> list[int]:
    """Accepted positions of one row; `key` is its fp32 entropy with NaN as +inf, `gamma` a 0-d fp32."""
    accepted = []
    before = torch.zeros((), dtype=torch.float32)  # fp32 sum of the entropies ranked before
    for rank, j in enumerate(ranked):
        if rule == "eb":
            take = rank == 0 or bool(before <= gamma)
            before = before + key[j]
        else:
            take = rank == 0 or bool(key[j] < gamma)
        if take:
            accepted.append(j)
    return accepted


def mask_scatter_(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                  entropy: torch.Tensor, gamma: torch.Tensor | None = None, gamma_val: float = 0.1,
                  rule: str = "eb", valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle of `sbd.mask_scatter_` (same signature, same in-place writes, same returns)."""
    batch, k = check_mask_scatter_args(block_tokens, is_masked, sampled, entropy, gamma, gamma_val, rule, valid)
    assert_gamma_values(gamma)
    device = block_tokens.device
    masked_cpu = is_masked.cpu()
    valid_cpu = torch.ones(batch, k, dtype=torch.bool) if valid is None else valid.cpu()
    entropy_cpu = entropy.cpu().to(torch.float32)
    key = torch.where(entropy_cpu.isnan(), float("inf"), entropy_cpu)  # NaN ranks as +inf
    gammas = (torch.full((batch,), gamma_fp32(gamma_val), dtype=torch.float32) if gamma is None
              else gamma.cpu().to(torch.float32))

    accepted = torch.zeros(batch, k, dtype=torch.bool)
    for b in range(batch):
        ranked = _ranked_candidates(masked_cpu[b], valid_cpu[b], key[b])
        for j in _accept_row(ranked, key[b], gammas[b], rule):
            accepted[b, j] = True

    accepted = accepted.to(device)
    block_tokens[accepted] = sampled[accepted]
    is_masked[accepted] = False
    num_accepted = accepted.sum(dim=1, dtype=torch.int32)
    block_done = ~is_masked.any(dim=1)
    return accepted, num_accepted, block_done

"""Autoregressive (NTP) and Set Block Decoding (SBD) with a KV cache and the `sbd` ops, plus the
full-recompute oracle decode that checks them (docs/algorithm.md §3).

NTP: prefill the prompt causally, then one token per forward pass from the causal logits.

SBD with block size K (docs/algorithm.md §3): the answer is cut into K-position blocks aligned to the start of
generation. A block starts as K mask tokens `m` and is filled in over a few passes:
- the first pass of the first block is fused with the prefill: rows `[prompt (causal) ; K masks]`;
- the first pass of every later block is `[previous block (K causal rows, appended to the cache) ; block]`;
- later passes of a block are `[block]` only (nothing is written to the cache);
each pass computes the entropy of every still-masked position (`sbd::entropy_sample`) and reveals the set
chosen by the entropy-bounded rule (`sbd::mask_scatter_`):
    sort masked positions by entropy H ascending, reveal the first s >= 1 with H(i_1)+...+H(i_{s-1}) <= gamma.
EOS (docs/algorithm.md §3.8): once an EOS is revealed and every position before it in its block is too, the
sequence is finished and later positions are dropped.
Invalid logits (docs/algorithm.md §3.6): a position with a NaN or +inf logit is never revealed (NTP: never
emitted). A sequence whose pass has nothing it may reveal would read the same logits again, so it stops there
with the tokens it had completed, flagged in `DecodeResult.stopped_early`; so does a sequence still running at
the pass limit, which only ops breaking their contract reach.
NFE (docs/algorithm.md §3.9): a pass counts 1 for every sequence still running in it (the fused prefill
included, as the NTP prefill that yields the first token is); a finished sequence stops counting.

Batching: sequences of one batch move through their blocks at different speeds, so one pass mixes rows
on the first pass of a new block (`num_causal = K`) with rows on a later pass (`num_causal = 0`) through
the per-row `num_causal` of `sbd::block_attention_with_kvcache`. The step functions (`ntp_prefill`,
`ntp_decode_step`, `sbd_prefill`, `sbd_block_step`) have no host sync and compile with
`torch.compile(fullgraph=True)`; the outer loop reads two flags once per pass (see `_decode_sbd_batch`).

Oracle (`oracle_decode`): no cache and the naive ops. For every pass it recomputes the whole sequence
`[prompt ; answer so far ; block]` with the model's forward, mask of docs/algorithm.md §3.10 (causal up to
the block, block rows see everything) and applies the EOS rule in plain Python, one sequence at a time.
With temperature 0 it must give the same tokens as the cached decode.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sbd_kernels.ops import trusted_values
from sbd_kernels.ops._float32 import FLOAT32_MAX, as_float32
from sbd_kernels.ops.scatter._checks import RULES
from sbd_kernels.protocol import DecodeCache, SbdModel

METHODS = ("ntp", "sbd")
INTEGER_FIELDS = ("block_size", "max_new_tokens", "seed", "top_k")  # of DecodeConfig
REAL_FIELDS = ("gamma", "temperature", "top_p", "min_p")
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def integer(owner: str, name: str, value: object) -> int:
    """`value` as an int: Python and NumPy integers and one-element integer tensors (anything with __index__),
    not bools (nor bool tensors). Raises TypeError naming `owner` and `name` otherwise."""
    if not isinstance(value, bool) and getattr(value, "dtype", None) != torch.bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{owner}: {name} must be an integer, got {value!r} ({type(value).__name__})")


def real(owner: str, name: str, value: object) -> float:
    """`value` as a float: Python and NumPy reals, not bools. Raises TypeError naming `owner` and `name`."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{owner}: {name} must be a real number, got {value!r} ({type(value).__name__})")


def seeds_overflow(name: str, seed: int, count: int) -> str | None:
    """Why the seeds seed + i of `count` sequences leave int64 (the sampler's seed dtype), naming the seed as
    `name` ("seed", "--seed"); None when seed + count - 1 is at most 2**63 - 1."""
    last = seed + count - 1
    if count > 0 and last > INT64_MAX:
        return (f"{name} {seed}: prompt i samples with seed + i, and with {count} prompts the last seed, {last}, "
                f"does not fit in int64 (use {name} <= {INT64_MAX - count + 1})")
    return None


def check_seeds(caller: str, seed: int, count: int) -> None:
    """ValueError naming `caller` and the seed when the seeds seed + i of `count` sequences leave int64
    (`seeds_overflow`)."""
    problem = seeds_overflow("seed", seed, count)
    if problem:
        raise ValueError(f"{caller}: {problem}")


def token_ids(caller: str, eos_id: object) -> tuple[int, ...]:
    """`generate`'s eos_id as a tuple of ints: one id (an integer, see `integer`) or a non-empty sequence of them,
    each within int64 (the dtype the decode compares tokens in). A negative id matches no token (no EOS)."""
    if eos_id is None:
        raise TypeError(f"{caller}: eos_id must be a token id or a sequence of token ids, got None (pass -1 for "
                        "no EOS)")
    if hasattr(eos_id, "__index__") and not getattr(eos_id, "ndim", 0):
        ids = (integer(caller, "eos_id", eos_id),)
    elif isinstance(eos_id, (str, bytes)) or not hasattr(eos_id, "__iter__"):
        raise TypeError(f"{caller}: eos_id must be a token id or a sequence of token ids, got {eos_id!r}")
    else:
        ids = tuple(integer(caller, f"eos_id[{i}]", e) for i, e in enumerate(eos_id))
    if not ids:
        raise ValueError(f"{caller}: eos_id must name at least one token id")
    for i, e in enumerate(ids):
        if not INT64_MIN <= e <= INT64_MAX:
            raise ValueError(f"{caller}: eos_id {e} does not fit in int64, the dtype of the decoded tokens")
    return ids


# ----------------------------------------------------------------------------------------------------
# Configuration, kernels, results
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """How to decode.

    method: "ntp" (one token per pass) or "sbd" (blocks of `block_size` positions).
    gamma: entropy budget of the EB rule (SBD only; paper: 0.1 reasoning, 0.35 faster); >= 0, +inf allowed.
    temperature: 0 = greedy; T > 0 samples from softmax(logits / T) (the EB entropy stays at T = 1); finite
        as a float32, the precision the sampler runs at.
    rule: the acceptance rule of SBD, "eb" or "threshold" (docs/algorithm.md §3.5).
    top_k, top_p, min_p: filters applied before sampling, as Hugging Face applies them (top-k, then top-p,
        then min-p on softmax(logits / T); see `sbd_kernels.entropy_sample`); 0 / 1.0 / 0.0 = off; ignored
        at T = 0. top_p in (0, 1] and min_p in [0, 1) as float32s, as the sampler checks them.
    max_new_tokens: answer budget per sequence, EOS included; SBD block positions past it are never
        revealed (they stay mask tokens in the model input).
    seed: sequence i of a `generate` call samples with seed `seed + i`, whatever its batch; within int64, and so
        must seed + i be for every prompt (`check_seeds`).
    """

    method: str = "sbd"
    block_size: int = 16
    gamma: float = 0.1
    temperature: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    rule: str = "eb"
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        # Types first: a float budget (4.5) would be compared as such by the decode loop (5 positions revealed)
        # and clamped as an int64 tensor elsewhere (4 reported), and a float block size fails inside torch.
        for name in INTEGER_FIELDS:
            object.__setattr__(self, name, integer("DecodeConfig", name, getattr(self, name)))
        for name in REAL_FIELDS:
            object.__setattr__(self, name, real("DecodeConfig", name, getattr(self, name)))
        if self.method not in METHODS:
            raise ValueError(f"DecodeConfig: method must be one of {METHODS}, got {self.method!r}")
        if self.block_size < 1:
            raise ValueError(f"DecodeConfig: block_size must be >= 1, got {self.block_size}")
        if not self.gamma >= 0:                                  # written so that NaN fails too
            raise ValueError(f"DecodeConfig: gamma must be >= 0, got {self.gamma}")
        if not 0.0 <= as_float32(self.temperature) <= FLOAT32_MAX:  # the sampler's check
            raise ValueError(f"DecodeConfig: temperature must be finite and >= 0 as a float32 (at most "
                             f"{FLOAT32_MAX:.8g}), got {self.temperature}")
        if self.rule not in RULES:
            raise ValueError(f"DecodeConfig: rule must be one of {RULES}, got {self.rule!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"DecodeConfig: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not INT64_MIN <= self.seed <= INT64_MAX:                # the dtype of the sampler's seed tensor
            raise ValueError(f"DecodeConfig: seed must be within int64 [-2**63, 2**63 - 1], got {self.seed}")
        if not 0 <= self.top_k <= INT64_MAX:                       # the op's top_k_val is an int64
            raise ValueError(f"DecodeConfig: top_k must be within [0, 2**63 - 1], got {self.top_k}")
        if not 0.0 < as_float32(self.top_p) <= 1.0:
            raise ValueError(f"DecodeConfig: top_p must be in (0, 1] as a float32, got {self.top_p}")
        if not 0.0 <= as_float32(self.min_p) < 1.0:
            raise ValueError(f"DecodeConfig: min_p must be in [0, 1) as a float32, got {self.min_p}")


@dataclass(frozen=True)
class DecodeOps:
    """The three kernels a decode calls: the fused `torch.ops.sbd` ops or their pure-PyTorch oracles."""

    attention: Callable
    entropy_sample: Callable
    mask_scatter_: Callable


def fused_ops() -> DecodeOps:
    """The `torch.ops.sbd` kernels (C++ on CPU tensors, Triton on CUDA tensors)."""
    return DecodeOps(torch.ops.sbd.block_attention_with_kvcache, torch.ops.sbd.entropy_sample,
                     torch.ops.sbd.mask_scatter_)


def naive_ops() -> DecodeOps:
    """The pure-PyTorch oracles of the three ops (same names and signatures)."""
    from sbd_kernels.ops.attention.naive import block_attention_with_kvcache
    from sbd_kernels.ops.sampling.naive import entropy_sample
    from sbd_kernels.ops.scatter.naive import mask_scatter_

    return DecodeOps(block_attention_with_kvcache, entropy_sample, mask_scatter_)


@dataclass
class DecodeResult:
    """Tokens and statistics of one decode of N prompts.

    answers: N token lists, EOS and everything after it removed.
    tokens: N token lists as generated: the answer, then the EOS that ended it (if one did).
    nfe: [N] int64, forward passes each sequence took part in (docs/algorithm.md §3.9).
    generated: [N] int64, tokens each sequence produced, EOS included (what the passes paid for).
    accepted_hist: [K + 1] int64, accepted_hist[a] = passes (per sequence) that revealed a tokens
        (NTP: K = 1, every pass with valid logits reveals 1).
    wall_s: seconds spent decoding (prefill included), summed over batches.
    stopped_early: [N] bool, True where a sequence stopped before its end (EOS or budget): a pass found no
        valid logits at any position it could reveal (a NaN or +inf logit, docs/algorithm.md §3.6), or the
        decode reached its pass limit. Its `tokens` are those it had completed (NTP: the tokens before that
        pass; SBD: its completed blocks and the revealed prefix of its current block). None (the default)
        means no sequence did.
    """

    answers: list[list[int]]
    nfe: torch.Tensor
    generated: torch.Tensor
    accepted_hist: torch.Tensor
    wall_s: float = 0.0
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    stopped_early: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.stopped_early is None:
            self.stopped_early = torch.zeros(len(self.answers), dtype=torch.bool)

    @property
    def total_nfe(self) -> int:
        return int(self.nfe.sum())

    @property
    def total_generated(self) -> int:
        return int(self.generated.sum())

    @property
    def nfe_per_token(self) -> float:
        """Forward passes per generated token: 1 for NTP, 1 / (tokens revealed per pass) for SBD."""
        return self.total_nfe / max(self.total_generated, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.total_generated / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def num_stopped_early(self) -> int:
        """Sequences that stopped before their end (see `stopped_early`)."""
        return int(self.stopped_early.sum())

    def require_complete(self, what: str) -> None:
        """Raises RuntimeError naming `what` when a sequence stopped early: measurements (accuracy, NFE, speed)
        of a model whose logits went NaN / +inf would be silently wrong."""
        if self.num_stopped_early:
            rows = self.stopped_early.nonzero().flatten().tolist()
            raise RuntimeError(f"{what}: {self.num_stopped_early} of {len(self.answers)} sequences stopped early on "
                               f"invalid (NaN / +inf) logits (rows {rows[:10]}{' ...' if len(rows) > 10 else ''})")

    @staticmethod
    def empty(block_size: int) -> DecodeResult:
        """The result of decoding no prompt (accepted_hist of K + 1 zeros)."""
        none = torch.zeros(0, dtype=torch.int64)
        return DecodeResult([], none, none.clone(), torch.zeros(block_size + 1, dtype=torch.int64))

    @staticmethod
    def concat(parts: list[DecodeResult]) -> DecodeResult:
        """One result for prompts decoded in several batches (in order)."""
        return DecodeResult(
            answers=[a for p in parts for a in p.answers],
            nfe=torch.cat([p.nfe for p in parts]),
            generated=torch.cat([p.generated for p in parts]),
            accepted_hist=torch.stack([p.accepted_hist for p in parts]).sum(0),
            wall_s=sum(p.wall_s for p in parts),
            tokens=[t for p in parts for t in p.tokens],
            stopped_early=torch.cat([p.stopped_early for p in parts]),
        )


@dataclass(frozen=True)
class DecodeConstants:
    """Everything a decode step needs besides tensors: token ids and the decode settings, as Python values
    (constants under torch.compile, so one compiled step serves a whole decode).

    eos_ids: every id that ends a sequence (HF models often have several, e.g. Llama 3's 128001 / 128009).
    pad_id: written into answers after the end. mask_id: the mask token m of the model.
    block_size: K of SBD (1 for NTP). Other fields: see `DecodeConfig`.
    """

    eos_ids: tuple[int, ...]
    pad_id: int
    mask_id: int
    block_size: int
    max_new_tokens: int
    gamma: float
    temperature: float
    rule: str
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @staticmethod
    def of(model_mask_id: int, cfg: DecodeConfig, eos_id: int | Sequence[int], pad_id: int,
           caller: str = "generate") -> DecodeConstants:
        """The constants of decoding with `cfg` (block size 1 for NTP); TypeError / ValueError naming `caller`
        and the argument for an eos_id or pad_id that is not a token id (see `token_ids`)."""
        eos_ids = token_ids(caller, eos_id)
        pad_id = integer(caller, "pad_id", pad_id)
        return DecodeConstants(eos_ids=eos_ids, pad_id=pad_id, mask_id=model_mask_id,
                               block_size=cfg.block_size if cfg.method == "sbd" else 1,
                               max_new_tokens=cfg.max_new_tokens, gamma=cfg.gamma, temperature=cfg.temperature,
                               rule=cfg.rule, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """Bool tensor of tokens' shape: which tokens are one of `eos_ids`."""
        hit = tokens == self.eos_ids[0]
        for eos in self.eos_ids[1:]:
            hit = hit | (tokens == eos)
        return hit


# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------
def vocab_size_of(model: SbdModel) -> int | None:
    """The vocabulary size in the model's config (`ModelConfig`, or the HF config behind the adapter), or None
    for a model without one (the `SbdModel` protocol does not ask for it)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def check_prompts(model: SbdModel, prompts: list[list[int]], pad_id: int, caller: str) -> None:
    """Raises ValueError naming the argument and the value when a prompt is empty, or a prompt id or pad_id
    lies outside the model's vocabulary [0, V): the embedding lookup would otherwise fail mid-decode with a
    bare IndexError (on CUDA a device-side assert). Checked on the host, where the token lists already are,
    once for every batch of the call."""
    vocab = vocab_size_of(model)
    if vocab is not None and not 0 <= pad_id < vocab:
        raise ValueError(f"{caller}: pad_id {pad_id} is outside the model's vocabulary [0, {vocab})")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"{caller}: prompts[{i}] is empty; every prompt needs at least one token")
        _check_prompt_ids(caller, i, prompt)
        if vocab is None:
            continue
        bad = next((t for t in (min(prompt), max(prompt)) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{caller}: prompts[{i}] holds token id {bad}, outside the model's vocabulary "
                             f"[0, {vocab})")


def _check_prompt_ids(caller: str, i: int, prompt: Sequence[int]) -> None:
    """TypeError naming prompts[i][j] for an id that is not an integer (a float 5.9 would be read as 5, a bool
    as 0 / 1): a 1-D integer tensor or array passes on its dtype, a list of Python ints on a type test, anything
    else id by id (`integer`)."""
    dtype = getattr(prompt, "dtype", None)
    if dtype is not None and getattr(prompt, "ndim", 1) == 1:
        is_int = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
                  if isinstance(dtype, torch.dtype) else dtype.kind in "iu")
        if is_int:
            return
    elif all(type(t) is int for t in prompt):
        return
    for j, t in enumerate(prompt):
        integer(caller, f"prompts[{i}][{j}]", t)


def pad_prompts(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: returns tokens [B, P] int64 (P = longest prompt) and lengths [B] int32."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.as_tensor(p, dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    return tokens.to(device), lengths.to(device)


def mask_column(mask_id: int, vocab: int) -> int | None:
    """The mask token's column in logits [..., V], or None where they have none: a model whose LM head covers only
    the first V ids of its embeddings (Apertus 1.5's heads, pruned to the text ids) draws no id past them, the mask
    token included, so there is nothing to leave out. V is a static size: no host sync."""
    return mask_id if mask_id < vocab else None


def _sample(ops: DecodeOps, logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
            compute: torch.Tensor, sp: DecodeConstants) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """entropy_sample over logits [B, K, V] -> (tokens [B, K] int64, entropy [B, K] fp32, valid [B, K]), the mask
    token's column (`mask_column`) left out."""
    column = mask_column(sp.mask_id, logits.shape[-1])
    tokens, entropy, _, valid = ops.entropy_sample(
        logits, seed, offset, temperature_val=sp.temperature, compute_mask=compute,
        mask_token_id=-1 if column is None else column,
        top_k_val=sp.top_k, top_p_val=sp.top_p, min_p_val=sp.min_p)
    return tokens, entropy, valid


def _strip_after_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """tokens up to (not including) the first of `eos_ids`."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return tokens


def _answers(buffer: torch.Tensor, generated: torch.Tensor, eos_ids: tuple[int, ...]) -> list[list[int]]:
    """Host copy of the answers: the first `generated[b]` tokens of each row, cut at the first EOS."""
    return [_strip_after_eos(row, eos_ids) for row in _generated_tokens(buffer, generated)]


def _generated_tokens(buffer: torch.Tensor, generated: torch.Tensor) -> list[list[int]]:
    """Host copy of the first `generated[b]` tokens of each row (EOS included)."""
    return [row[:n] for row, n in zip(buffer.cpu().tolist(), generated.cpu().tolist())]


def _result(state: NtpState | SbdState, hist: torch.Tensor, wall: float, eos_ids: tuple[int, ...]) -> DecodeResult:
    """The DecodeResult of a finished batch (one device-to-host copy of each state tensor)."""
    tokens = _generated_tokens(state.answer, state.generated)
    return DecodeResult([_strip_after_eos(t, eos_ids) for t in tokens], state.nfe.cpu(), state.generated.cpu(),
                        hist.cpu(), wall, tokens, state.stopped_early.cpu())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------
# NTP decoding
# ----------------------------------------------------------------------------------------------------
@dataclass
class NtpState:
    """Per-sequence NTP decode state, all on the model's device (B sequences, W = max_new_tokens + 1).

    last: [B] int64 token to feed next. answer: [B, W] int64 tokens so far (slot W-1 absorbs the pad
    writes of finished rows). generated: [B] int64 tokens produced (EOS included). finished: [B] bool.
    stopped_early: [B] bool, finished on invalid logits (see `DecodeResult`).
    nfe: [B] int64. seed, offset: [B] int64 sampling keys (offset = passes done so far).
    """

    last: torch.Tensor
    answer: torch.Tensor
    generated: torch.Tensor
    finished: torch.Tensor
    stopped_early: torch.Tensor
    nfe: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor

    @staticmethod
    def empty(batch: int, sp: DecodeConstants, seed: torch.Tensor) -> NtpState:
        dev = seed.device
        zeros = torch.zeros(batch, dtype=torch.int64, device=dev)
        return NtpState(
            last=zeros.clone(),
            answer=torch.full((batch, sp.max_new_tokens + 1), sp.pad_id, dtype=torch.int64, device=dev),
            generated=zeros.clone(), finished=torch.zeros(batch, dtype=torch.bool, device=dev),
            stopped_early=torch.zeros(batch, dtype=torch.bool, device=dev), nfe=zeros.clone(), seed=seed,
            offset=zeros.clone())


def _ntp_accept(state: NtpState, logits: torch.Tensor, ops: DecodeOps, sp: DecodeConstants) -> None:
    """Sample one token per running row from logits [B, 1, V] and append it to the answer.

    A row whose logits are invalid (a NaN or +inf logit, docs/algorithm.md §3.6) emits nothing and stops,
    flagged in `stopped_early`: its next pass would read the same logits. The pass still counts in its NFE."""
    running = ~state.finished
    tokens, _, valid = _sample(ops, logits, state.seed, state.offset, running[:, None], sp)
    emit = running & valid[:, 0]
    token = torch.where(emit, tokens[:, 0], sp.pad_id)                             # [B]
    state.answer.scatter_(1, state.generated[:, None], token[:, None])
    step = running.long()
    state.nfe.add_(step)
    state.offset.add_(step)
    state.generated.add_(emit.long())
    invalid = running & ~valid[:, 0]
    state.stopped_early.logical_or_(invalid)
    state.finished.logical_or_(invalid | (emit & (sp.is_eos(token) | (state.generated >= sp.max_new_tokens))))
    state.last.copy_(torch.where(emit, token, state.last))


def ntp_prefill(model: SbdModel, cache: DecodeCache, state: NtpState, prompt: torch.Tensor,
                prompt_lens: torch.Tensor, ops: DecodeOps, sp: DecodeConstants) -> None:
    """Pass 1: prompt [B, P] (right-padded, lengths [B] int32) into the cache; first token from row len-1."""
    logits = model.decode_pass(prompt, prompt_lens, 0, cache, attention_op=ops.attention)   # [B, P, V]
    last_row = (prompt_lens.long() - 1)[:, None, None].expand(-1, 1, logits.shape[-1])
    _ntp_accept(state, logits.gather(1, last_row), ops, sp)


def ntp_decode_step(model: SbdModel, cache: DecodeCache, state: NtpState, ops: DecodeOps, sp: DecodeConstants) -> None:
    """One pass: the last token of every running row is appended to the cache and predicts the next."""
    num_causal = (~state.finished).int()                       # finished rows: padding, nothing cached
    logits = model.decode_pass(state.last[:, None], num_causal, 0, cache, attention_op=ops.attention,
                               keep_last=1)                                                 # [B, 1, V]
    _ntp_accept(state, logits, ops, sp)


def new_decode_cache(model: SbdModel, batch: int, max_len: int, caller: str) -> tuple[DecodeCache, bool]:
    """`model.new_cache(batch, max_len)` and whether the decode may skip the ops' per-call value checks.

    The decode loops build every length the ops read (cache sized for prompt + answer budget, num_causal of
    0 / 1 / K) and DecodeConfig validated gamma, temperature and the filters, so inside `trusted_values()` the
    value checks (4-6 small kernels per attention call, i.e. per layer and pass, on CUDA) are skipped. That
    holds only if the cache has the slots asked for: the GPU kernels clamp an overflowing append instead of
    failing. A cache that states its slots per row (`max_len`, as `KVCache` and `SbdCache` do) is checked here,
    once, on the host (ValueError naming the model when it holds fewer); one that does not keeps the checks,
    which catch an overflow at the op."""
    cache = model.new_cache(batch, max_len)
    slots = getattr(cache, "max_len", None)
    if slots is None:
        return cache, False
    if slots < max_len:
        raise ValueError(f"{caller}: {type(model).__name__}.new_cache({batch}, {max_len}) returned a cache of "
                         f"{slots} slots per row; the decode writes up to {max_len} (prompt + answer budget)")
    return cache, True


def _decode_ntp_batch(model: SbdModel, prompts: list[list[int]], seed: torch.Tensor, ops: DecodeOps,
                      sp: DecodeConstants, steps: StepFunctions) -> DecodeResult:
    device = seed.device
    prompt, prompt_lens = pad_prompts(prompts, sp.pad_id, device)
    cache, sized = new_decode_cache(model, len(prompts), prompt.shape[1] + sp.max_new_tokens, "generate")
    state = NtpState.empty(len(prompts), sp, seed)
    with trusted_values() if sized else contextlib.nullcontext():
        start = time.perf_counter()
        steps.ntp_prefill(model, cache, state, prompt, prompt_lens, ops, sp)
        for _ in range(sp.max_new_tokens - 1):
            # The loop's only host sync, one bool per pass: stop as soon as every sequence has finished
            # (running up to max_new_tokens passes instead would waste most of them on short answers).
            if bool(state.finished.all()):
                break
            steps.ntp_decode_step(model, cache, state, ops, sp)
        _sync(device)
        wall = time.perf_counter() - start
    # Every pass reveals one token, except a pass with invalid logits, which reveals none and stops its row.
    hist = torch.stack([(state.nfe - state.generated).sum(), state.generated.sum()])
    return _result(state, hist, wall, sp.eos_ids)


# ----------------------------------------------------------------------------------------------------
# SBD decoding
# ----------------------------------------------------------------------------------------------------
@dataclass
class SbdState:
    """Per-sequence SBD decode state, all on the model's device (B sequences, K = block size,
    W = K * ceil(max_new_tokens / K)).

    block: [B, K] int64 current block, mask id where still masked. is_masked: [B, K] bool.
    pending: [B, K] int64 the last completed block, appended to the cache by the next pass.
    num_pending: [B] int32, K right after a block completed, else 0 (the next pass's num_causal).
    answer: [B, W] int64 answer tokens. block_start: [B] int64 answer index of block[:, 0].
    generated: [B] int64 tokens produced (EOS included), set when the row finishes. finished: [B] bool.
    stopped_early: [B] bool, finished on invalid logits or at the pass limit (see `DecodeResult`).
    nfe: [B] int64. accepted_hist: [K + 1] int64. seed, offset: [B] int64 (offset = passes done so far).
    """

    block: torch.Tensor
    is_masked: torch.Tensor
    pending: torch.Tensor
    num_pending: torch.Tensor
    answer: torch.Tensor
    block_start: torch.Tensor
    generated: torch.Tensor
    finished: torch.Tensor
    stopped_early: torch.Tensor
    nfe: torch.Tensor
    accepted_hist: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor

    @staticmethod
    def empty(batch: int, sp: DecodeConstants, seed: torch.Tensor) -> SbdState:
        dev, k = seed.device, sp.block_size
        width = k * math.ceil(sp.max_new_tokens / k)
        zeros = torch.zeros(batch, dtype=torch.int64, device=dev)
        return SbdState(
            block=torch.full((batch, k), sp.mask_id, dtype=torch.int64, device=dev),
            is_masked=_in_budget(zeros, sp),
            pending=torch.full((batch, k), sp.pad_id, dtype=torch.int64, device=dev),
            num_pending=torch.zeros(batch, dtype=torch.int32, device=dev),
            answer=torch.full((batch, width), sp.pad_id, dtype=torch.int64, device=dev),
            block_start=zeros.clone(), generated=zeros.clone(),
            finished=torch.zeros(batch, dtype=torch.bool, device=dev),
            stopped_early=torch.zeros(batch, dtype=torch.bool, device=dev), nfe=zeros.clone(),
            accepted_hist=torch.zeros(k + 1, dtype=torch.int64, device=dev), seed=seed, offset=zeros.clone())


def sbd_max_passes(sp: DecodeConstants) -> int:
    """The pass limit of an SBD decode, per sequence: W = K * ceil(max_new_tokens / K), the answer width."""
    return sp.block_size * math.ceil(sp.max_new_tokens / sp.block_size)


def _in_budget(block_start: torch.Tensor, sp: DecodeConstants) -> torch.Tensor:
    """[B, K] bool: block positions inside the answer budget. Positions past it keep their mask token as
    model input but are never candidates (an answer budget of 33 with K = 16 costs no passes for the 15
    positions past it)."""
    cols = block_start[:, None] + torch.arange(sp.block_size, device=block_start.device)
    return cols < sp.max_new_tokens


def _revealed_prefix(is_masked: torch.Tensor) -> torch.Tensor:
    """[B, K] bool: the block positions before the first still-masked one."""
    return (~is_masked).int().cumprod(1).bool()


def _sbd_accept(state: SbdState, block_logits: torch.Tensor, ops: DecodeOps, sp: DecodeConstants) -> None:
    """Reveal a set of block positions from block_logits [B, K, V], then apply the EOS rule and move rows
    whose block is complete to a fresh block. Everything is batched tensor math: no host sync.

    A running row whose pass reveals nothing had no valid logits at any masked position (both rules reveal
    the first-ranked candidate whenever there is one; docs/algorithm.md §3.6: an invalid position is never
    revealed). Its next pass would read the same logits, so it stops now, flagged in `stopped_early`, with
    its completed blocks and the revealed prefix of its block as its tokens."""
    k = sp.block_size
    running = ~state.finished
    sampled, entropy, valid = _sample(ops, block_logits, state.seed, state.offset,
                                      state.is_masked & running[:, None], sp)
    _, num_accepted, _ = ops.mask_scatter_(state.block, state.is_masked, sampled, entropy,
                                           gamma_val=sp.gamma, rule=sp.rule, valid=valid)
    step = running.long()
    state.nfe.add_(step)
    state.offset.add_(step)
    state.accepted_hist.index_add_(0, num_accepted.long(), step)
    cols = state.block_start[:, None] + torch.arange(k, device=state.block.device)          # [B, K]
    state.answer.scatter_(1, cols, state.block)

    # EOS rule: a revealed EOS whose block prefix is fully revealed ends the sequence.
    prefix_revealed = _revealed_prefix(state.is_masked)                                     # [B, K]
    eos_hit = sp.is_eos(state.block) & prefix_revealed
    has_eos = eos_hit.any(1)
    first_eos = eos_hit.int().argmax(1)                                                     # [B]
    block_full = prefix_revealed[:, -1]
    # Without an EOS a row ends after its revealed prefix: the whole block when it is full (positions past
    # the budget count as revealed; the clamp drops them), the prefix before the stuck position otherwise.
    end = torch.where(has_eos, state.block_start + first_eos + 1, state.block_start + prefix_revealed.sum(1))
    finishing = running & (has_eos | (block_full & (state.block_start + k >= sp.max_new_tokens)))
    stuck = running & ~finishing & (num_accepted == 0)
    completing = running & block_full & ~finishing
    state.generated.copy_(torch.where(finishing | stuck, end.clamp(max=sp.max_new_tokens), state.generated))
    state.finished.logical_or_(finishing | stuck)
    state.stopped_early.logical_or_(stuck)

    # A completed block becomes the causal prefix of the next pass; its slot restarts as K masks.
    state.pending.copy_(torch.where(completing[:, None], state.block, state.pending))
    state.num_pending.copy_(completing.int() * k)
    state.block_start.add_(completing.long() * k)
    state.block.copy_(torch.where(completing[:, None], sp.mask_id, state.block))
    state.is_masked.copy_(torch.where(completing[:, None], _in_budget(state.block_start, sp), state.is_masked)
                          & ~state.finished[:, None])


def sbd_prefill(model: SbdModel, cache: DecodeCache, state: SbdState, prompt: torch.Tensor,
                prompt_lens: torch.Tensor, ops: DecodeOps, sp: DecodeConstants) -> None:
    """Pass 1, fused: rows [prompt [B, P] causal (lengths [B] int32) ; first block of K masks]."""
    tokens = torch.cat([prompt, state.block], dim=1)                                        # [B, P + K]
    block_logits = model.decode_pass(tokens, prompt_lens, sp.block_size, cache, attention_op=ops.attention,
                                     keep_last=sp.block_size)                               # [B, K, V]
    _sbd_accept(state, block_logits, ops, sp)


def sbd_block_step(model: SbdModel, cache: DecodeCache, state: SbdState, ops: DecodeOps, sp: DecodeConstants,
                   causal_slots: int) -> None:
    """One pass over every row's current block.

    causal_slots = K: rows [pending block (num_pending[b] = K or 0 causal rows) ; block], 2K tokens, for a
    batch where some row starts a new block; its previous block's K/V are appended to the cache.
    causal_slots = 0: rows [block] only, K tokens, when no row has a pending block.
    """
    if causal_slots:
        tokens = torch.cat([state.pending, state.block], dim=1)                             # [B, 2K]
        num_causal = state.num_pending
    else:
        tokens = state.block                                                                # [B, K]
        num_causal = torch.zeros_like(state.num_pending)
    block_logits = model.decode_pass(tokens, num_causal, sp.block_size, cache, attention_op=ops.attention,
                                     keep_last=sp.block_size)                               # [B, K, V]
    _sbd_accept(state, block_logits, ops, sp)


def _decode_sbd_batch(model: SbdModel, prompts: list[list[int]], seed: torch.Tensor, ops: DecodeOps,
                      sp: DecodeConstants, steps: StepFunctions) -> DecodeResult:
    device, k = seed.device, sp.block_size
    prompt, prompt_lens = pad_prompts(prompts, sp.pad_id, device)
    state = SbdState.empty(len(prompts), sp, seed)
    cache, sized = new_decode_cache(model, len(prompts), prompt.shape[1] + state.answer.shape[1], "generate")
    # Every pass of a running row reveals >= 1 token or stops the row (no valid logits), so W passes finish
    # every row; the bound only matters for ops that break that contract (`_stop_running_rows`).
    max_passes = sbd_max_passes(sp)
    with trusted_values() if sized else contextlib.nullcontext():
        start = time.perf_counter()
        steps.sbd_prefill(model, cache, state, prompt, prompt_lens, ops, sp)
        for _ in range(max_passes - 1):
            # The loop's only host sync, two bools per pass: stop once every row has finished, and run the
            # 2K-row layout only when some row has a completed block to append (otherwise K rows: half the
            # tokens, and at batch 1 most passes are later passes of a block). On a GPU this read costs tens
            # of microseconds against a forward pass of milliseconds.
            all_done, any_pending = torch.stack([state.finished.all(), (state.num_pending > 0).any()]).tolist()
            if all_done:
                break
            steps.sbd_block_step(model, cache, state, ops, sp, k if any_pending else 0)
        _stop_running_rows(state, sp)
        _sync(device)
        wall = time.perf_counter() - start
    return _result(state, state.accepted_hist, wall, sp.eos_ids)


def _stop_running_rows(state: SbdState, sp: DecodeConstants) -> None:
    """Ends the rows still running after the pass limit, flagged in `stopped_early`, with their completed
    blocks and the revealed prefix of their block as tokens (as a row stopped by invalid logits). A decode
    with ops that keep the contract never gets here: each pass reveals a token of a row or stops it."""
    running = ~state.finished
    end = (state.block_start + _revealed_prefix(state.is_masked).sum(1)).clamp(max=sp.max_new_tokens)
    state.generated.copy_(torch.where(running, end, state.generated))
    state.stopped_early.logical_or_(running)
    state.finished.logical_or_(running)


# ----------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepFunctions:
    """The four step functions a decode runs: eager (`EAGER_STEPS`) or compiled (`compiled_steps()`).
    A test or an engine can swap one, e.g. `dataclasses.replace(EAGER_STEPS, sbd_block_step=my_step)`."""

    ntp_prefill: Callable
    ntp_decode_step: Callable
    sbd_prefill: Callable
    sbd_block_step: Callable

    def for_batch(self) -> StepFunctions:
        """The steps one batch of a decode runs: a step bound to one batch's buffers (a graphed step of
        `sbd_kernels.graphs`) gives a fresh copy through its `for_new_batch()`; the others are shared."""
        fresh = {f.name: getattr(self, f.name).for_new_batch() for f in dataclasses.fields(self)
                 if hasattr(getattr(self, f.name), "for_new_batch")}
        return dataclasses.replace(self, **fresh)


EAGER_STEPS = StepFunctions(ntp_prefill=ntp_prefill, ntp_decode_step=ntp_decode_step, sbd_prefill=sbd_prefill,
                            sbd_block_step=sbd_block_step)


def compiled_steps() -> StepFunctions:
    """The step functions under `torch.compile(fullgraph=True)` (one graph per shape and layout)."""
    return StepFunctions(**{f.name: torch.compile(getattr(EAGER_STEPS, f.name), fullgraph=True)
                            for f in dataclasses.fields(StepFunctions)})


@torch.inference_mode()
def generate(model: SbdModel, prompts: list[list[int]], cfg: DecodeConfig, *, eos_id: int | Sequence[int],
             pad_id: int, batch_size: int | None = None, ops: DecodeOps | None = None,
             steps: StepFunctions | None = None, cuda_graph: bool = False) -> DecodeResult:
    """Decode every prompt (token-id lists) with the KV cache, `batch_size` prompts per batch (default all).
    No prompt gives an empty result. Prompt ids and pad_id must lie in the model's vocabulary (ValueError);
    eos_id is one id or a sequence of ids, of any integer type (TypeError); an id no token has (-1) never
    ends a sequence, as in Hugging Face's generate.

    ops: the kernels (default `fused_ops()`; `naive_ops()` runs the same loop on the oracles).
    steps: the step functions (default eager; `compiled_steps()` for torch.compile; `graphs.graphed_steps(...)`,
        captured afresh for every batch).
    cuda_graph: replay the repeated decode steps from CUDA graphs (`sbd_kernels.graphs`; the model must be on a
        CUDA device): same tokens, far less host overhead per pass.
    Prompt i samples with seed `cfg.seed + i` so that results do not depend on the batching.

    >>> from sbd_kernels.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig.preset("tiny")).eval()
    >>> out = generate(model, [[5, 6, 7]], DecodeConfig(method="sbd", block_size=4, max_new_tokens=8),
    ...                eos_id=2, pad_id=0, ops=naive_ops())
    >>> len(out.answers), int(out.nfe[0]) <= 8
    (1, True)
    """
    ops = ops or fused_ops()
    steps = steps or EAGER_STEPS
    sp = DecodeConstants.of(model.mask_token_id, cfg, eos_id, pad_id)
    device = next(model.parameters()).device
    if cuda_graph and _oracle_ops(ops):
        raise ValueError(f"generate: cuda_graph=True captures the decode steps, and the oracle ops "
                         f"({', '.join(_oracle_ops(ops))}, naive_ops) read values on the host, a sync that a CUDA "
                         "graph capture refuses; decode them without cuda_graph")
    graph_mode = _graph_mode(device) if cuda_graph else None
    batch_size = None if batch_size is None else integer("generate", "batch_size", batch_size)
    if batch_size is not None and not batch_size >= 1:
        raise ValueError(f"generate: batch_size must be >= 1 (or None: one batch), got {batch_size}")
    check_prompts(model, prompts, sp.pad_id, "generate")
    check_seeds("generate", cfg.seed, len(prompts))
    if not prompts:
        return DecodeResult.empty(sp.block_size)
    batch_size = batch_size or len(prompts)
    decode_batch = _decode_sbd_batch if cfg.method == "sbd" else _decode_ntp_batch
    parts = []
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first: first + batch_size]
        # seeds seed + first + i; arange(seed + first, seed + first + len) would overflow on its exclusive end
        # when the last seed is 2**63 - 1.
        seed = torch.arange(len(chunk), dtype=torch.int64, device=device) + (cfg.seed + first)
        batch_steps = _graphed(steps, graph_mode) if graph_mode else steps.for_batch()
        parts.append(decode_batch(model, chunk, seed, ops, sp, batch_steps))
    return DecodeResult.concat(parts)


def _oracle_ops(ops: DecodeOps) -> list[str]:
    """The fields of `ops` that hold an oracle of `naive_ops()`."""
    oracles = naive_ops()
    return [f.name for f in dataclasses.fields(ops) if getattr(ops, f.name) is getattr(oracles, f.name)]


def _graph_mode(device: torch.device) -> str:
    """The `graphs.graphed_steps` mode of a `cuda_graph=True` decode on `device`: "cuda" (captured and replayed);
    ValueError elsewhere. Tests put "check" in its place to run a CUDA-graph test's decodes on the CPU, eagerly
    under the same static-buffer checks (`sbd_kernels.testing.rehearse_cuda_graphs`)."""
    if device.type != "cuda":
        raise ValueError(f"generate: cuda_graph=True needs the model on a CUDA device, it is on {device}")
    return "cuda"


def _graphed(steps: StepFunctions, mode: str) -> StepFunctions:
    """`steps` for one batch under `graphs.graphed_steps(steps, mode)` (a fresh capture per batch: new state and
    cache buffers)."""
    from sbd_kernels.graphs import graphed_steps  # it imports this module

    return graphed_steps(steps, mode)


# ----------------------------------------------------------------------------------------------------
# Full-recompute oracle decode (docs/algorithm.md §3.10)
# ----------------------------------------------------------------------------------------------------
def block_recompute_mask(prefix_len: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """[L + K, L + K] bool (True = may attend): causal over the L prefix rows; the K block rows see all."""
    n = prefix_len + block_size
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask[prefix_len:, :] = True
    return mask


def _oracle_logits(model: SbdModel, sequence: list[int], block_size: int) -> torch.Tensor:
    """Logits [1, T, V] of `sequence` (T tokens, the last block_size of them a block) without a cache."""
    device = next(model.parameters()).device
    tokens = torch.tensor([sequence], dtype=torch.int64, device=device)
    positions = torch.arange(len(sequence), device=device)[None]
    mask = block_recompute_mask(len(sequence) - block_size, block_size, device)[None]
    return model(tokens, positions, mask)


@dataclass(frozen=True)
class OraclePass:
    """One pass of `oracle_decode`, as its observer sees it (`sbd_kernels.checks` judges near-ties from it).

    prompt: index of the prompt decoded. start: answer tokens committed before the positions of the pass (NTP:
    before its token; SBD: before its block). logits: [K, V] fp32 logits of the pass's positions (NTP: K = 1),
    the mask token's column included. entropy: [K] fp32 entropies the sampler computed: of the softmax over
    the logits without the mask token's column (docs/algorithm.md §3.6), +inf at an invalid position.
    candidates: [K] bool, the positions the pass could reveal (still masked, valid logits). accepted: [K] bool,
    those it revealed. mask_token_id: the column the sampler leaves out (never drawn, not in the entropy);
    None: none is.
    """

    prompt: int
    start: int
    logits: torch.Tensor
    entropy: torch.Tensor
    candidates: torch.Tensor
    accepted: torch.Tensor
    mask_token_id: int | None = None


PassObserver = Callable[[OraclePass], None]
# What the oracle loops call after each pass: (start, logits [K, V], entropy [K], candidates [K], accepted [K]).
_PassHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


# What an oracle loop returns for one prompt: (tokens, NFE, accepted_hist counts, stopped early).
_OracleRun = tuple[list[int], int, list[int], bool]


def _oracle_ntp(model: SbdModel, prompt: list[int], seed: int, ops: DecodeOps, sp: DecodeConstants,
                observe: _PassHook) -> _OracleRun:
    device = next(model.parameters()).device
    seq, answer, nfe = list(prompt), [], 0
    one = torch.ones(1, dtype=torch.bool, device=device)
    while len(answer) < sp.max_new_tokens:
        logits = _oracle_logits(model, seq, 0)[:, -1:]                                    # [1, 1, V]
        key = torch.tensor([seed], device=device), torch.tensor([nfe], device=device)
        tokens, entropy, valid = _sample(ops, logits, *key, one[None], sp)
        observe(len(answer), logits[0], entropy[0], valid[0], valid[0])
        nfe += 1
        if not bool(valid[0, 0]):                                # invalid logits: nothing emitted, stop
            return answer, nfe, [nfe - len(answer), len(answer)], True
        token = int(tokens[0])
        answer.append(token)
        seq.append(token)
        if token in sp.eos_ids:
            break
    return answer, nfe, [0, nfe], False


def _oracle_prefix(block: list[int], is_masked: list[bool]) -> list[int]:
    """The tokens of the block positions before its first still-masked one."""
    prefix = []
    for token, masked in zip(block, is_masked):
        if masked:
            break
        prefix.append(token)
    return prefix


def _oracle_sbd(model: SbdModel, prompt: list[int], seed: int, ops: DecodeOps, sp: DecodeConstants,
                observe: _PassHook) -> _OracleRun:
    device, k = next(model.parameters()).device, sp.block_size
    answer, nfe, hist = [], 0, [0] * (k + 1)
    while True:
        block = torch.full((1, k), sp.mask_id, dtype=torch.int64, device=device)
        in_budget = [len(answer) + j < sp.max_new_tokens for j in range(k)]
        is_masked = torch.tensor([in_budget], dtype=torch.bool, device=device)
        while bool(is_masked.any()):
            if nfe == sbd_max_passes(sp):                        # the cached loop's pass limit
                prefix = _oracle_prefix(block[0].tolist(), is_masked[0].tolist())
                return (answer + prefix)[: sp.max_new_tokens], nfe, hist, True
            logits = _oracle_logits(model, list(prompt) + answer + block[0].tolist(), k)[:, -k:]
            key = torch.tensor([seed], device=device), torch.tensor([nfe], device=device)
            sampled, entropy, valid = _sample(ops, logits, *key, is_masked.clone(), sp)
            candidates = is_masked[0] & valid[0]
            accepted, num_accepted, _ = ops.mask_scatter_(block, is_masked, sampled, entropy, gamma_val=sp.gamma,
                                                          rule=sp.rule, valid=valid)
            observe(len(answer), logits[0], entropy[0], candidates, accepted[0])
            nfe += 1
            hist[int(num_accepted[0])] += 1
            prefix = _oracle_prefix(block[0].tolist(), is_masked[0].tolist())
            eos = next((j for j, token in enumerate(prefix) if token in sp.eos_ids), None)   # EOS rule, literally
            if eos is not None:
                return (answer + prefix[: eos + 1])[: sp.max_new_tokens], nfe, hist, False
            if int(num_accepted[0]) == 0:                        # no valid logits at any masked position
                return (answer + prefix)[: sp.max_new_tokens], nfe, hist, True
        answer += block[0].tolist()
        if len(answer) >= sp.max_new_tokens:
            return answer[: sp.max_new_tokens], nfe, hist, False


@torch.inference_mode()
def block_logit_error(model: SbdModel, prompt: list[int], answer: list[int], block_size: int,
                      ops: DecodeOps | None = None) -> tuple[float, float]:
    """Exact-KV property (docs/algorithm.md §3.10), one prompt: (max |cached - recomputed| over block logits,
    max |recomputed|).

    Cached: prefill `prompt`; a first block pass `[answer[:K] causal (appended) ; K masks]`; a later pass
    `[answer[K:2K] with every other position masked]`. Recomputed: the model's forward (no cache) over the whole
    sequence with the block-recompute mask. `answer` is padded with its last token to 2K if shorter.
    """
    ops = ops or fused_ops()
    k, mask_id = block_size, model.mask_token_id
    answer = (list(answer) + [answer[-1]] * 2 * k)[: 2 * k]
    committed = answer[:k]
    block = [t if j % 2 == 0 else mask_id for j, t in enumerate(answer[k:])]
    device = next(model.parameters()).device
    cache = model.new_cache(1, len(prompt) + k)

    def row(tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.int64, device=device)

    def count(n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int32, device=device)

    model.decode_pass(row(prompt), count(len(prompt)), 0, cache, attention_op=ops.attention)
    first = model.decode_pass(row(committed + [mask_id] * k), count(k), k, cache, attention_op=ops.attention)
    later = model.decode_pass(row(block), count(0), k, cache, attention_op=ops.attention)
    cached = torch.cat([first[:, k:], later], dim=1)                                      # [1, 2K, V]
    recomputed = torch.cat([_oracle_logits(model, prompt + committed + [mask_id] * k, k)[:, -k:],
                            _oracle_logits(model, prompt + committed + block, k)[:, -k:]], dim=1)
    return float((cached - recomputed).abs().max()), float(recomputed.abs().max())


@torch.inference_mode()
def oracle_decode(model: SbdModel, prompts: list[list[int]], cfg: DecodeConfig, *,
                  eos_id: int | Sequence[int], pad_id: int, ops: DecodeOps | None = None,
                  observer: PassObserver | None = None) -> DecodeResult:
    """Reference decode: no KV cache, each pass recomputes the sequence (docs/algorithm.md §3.10 mask), one
    prompt at a time, with the naive ops by default. Same seeds, NFE accounting, EOS rule, invalid-logits stop
    and pass limit as `generate`. `observer`, if given, is called after every pass with its `OraclePass`."""
    ops = ops or naive_ops()
    sp = DecodeConstants.of(model.mask_token_id, cfg, eos_id, pad_id, "oracle_decode")
    check_prompts(model, prompts, sp.pad_id, "oracle_decode")
    check_seeds("oracle_decode", cfg.seed, len(prompts))
    decode_one = _oracle_sbd if cfg.method == "sbd" else _oracle_ntp
    answers, all_tokens, nfes, generated, stopped = [], [], [], [], []
    hist = torch.zeros(sp.block_size + 1, dtype=torch.int64)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        def observe(answer_len, logits, entropy, candidates, accepted, i=i):
            if observer is not None:
                observer(OraclePass(i, answer_len, logits.float(), entropy.float(), candidates, accepted,
                                    mask_column(sp.mask_id, logits.shape[-1])))
        tokens, nfe, counts, stopped_early = decode_one(model, prompt, cfg.seed + i, ops, sp, observe)
        answers.append(_strip_after_eos(tokens, sp.eos_ids))
        all_tokens.append(tokens)
        nfes.append(nfe)
        generated.append(len(tokens))
        stopped.append(stopped_early)
        hist += torch.tensor(counts, dtype=torch.int64)
    return DecodeResult(answers, torch.tensor(nfes, dtype=torch.int64),
                        torch.tensor(generated, dtype=torch.int64), hist, time.perf_counter() - start, all_tokens,
                        torch.tensor(stopped, dtype=torch.bool))

"""Triton kernels of `sbd.entropy_sample`: split-vocabulary partials, then one combine program per row.

Math (oracle and generator: `sbd_kernels.ops.sampling.naive`), per row x = logits[b, j] (mask entry -inf):

    m = max x,  S = sum exp(x - m),  U = sum exp(x - m) (x - m)
    entropy = log S - U / S,  logprob(token) = x_token - m - log S
    token = argmax x (T == 0)  or  argmax x / T + g,  g = -log(-log u),  u from Philox4x32-10 (T > 0)

Stage 1 (`_sampling_partial_kernel`, grid rows x splits): a row is cut into chunks of whole tiles whose bounds
depend on V alone (`_chunk_plan`); each program walks a contiguous run of chunks and keeps (m, S, U) online
per chunk, plus the first argmax of x and of the Gumbel score over its run; a handful of rows still spreads
over the whole GPU. Stage 2 (`_sampling_combine_kernel`, grid rows) rescales the chunks' partial sums to the
row max, takes the lowest index among equal maxima (chunks are in vocabulary order) and writes the four
outputs. Only the grouping of chunks into programs depends on B * K and the SM count, so a row's entropy and
logprob are the same bits in any batch and whatever the SM count. A sampled row whose best score is +-inf
(x_max / T overflowed fp32) gets the oracle's overflow rule there, where the row max is known: the combine
program races again over the row on (x - m) / T + g (a loop of zero trips for every other row: no host sync,
no extra launch). A tile is laid out [BLOCK_V / 64, 4, 16] so that one Philox call on counter (v >> 6) * 16 +
(v & 15) yields the noise of its 4 entries v, v + 16, v + 32, v + 48, exactly as on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sbd_kernels.ops._aot import (
    MAX_GRID_X,
    KernelLaunch,
    KernelSpec,
    cdiv,
    launch,
    rows_aligned,
    sm_count,
    spec_of_launch,
    unique_specs,
    unspecialised_jit,
)
from sbd_kernels.ops.sampling._checks import (
    check_entropy_sample_args,
    filters_requested,
    per_row_value_checks,
)

# Vocabulary entries per tile: 1024 = 16 Philox blocks of 64, with 8 warps: each thread holds 4 logits
# and 1 Philox counter per tile, 48-62 registers and no spill on sm_80 / sm_90 (with 4 warps, 72 registers
# and a 20-byte spill on sm_90 for fp32 with compute_mask, per ptxas).
BLOCK_V = 1024
NUM_WARPS = 8
# Tile for vocabularies below SMALL_VOCAB: 128 entries (2 Philox blocks), so that a 50-entry row does not
# draw 1024 entries' noise for nothing; 4 warps, one entry per thread.
SMALL_BLOCK_V = 128
SMALL_NUM_WARPS = 4
SMALL_VOCAB = 4096
# Programs aimed at per launch: 4 per SM of the input's GPU (528 on a 132-SM H100), so that B * K = 16
# rows still fill the GPU.
PROGRAMS_PER_SM = 4
# Smallest chunk of tiles (4096 entries), the unit of the partial sums and of a program's work: below that
# the partials' round trip costs more than the extra parallelism gains.
MIN_TILES_PER_CHUNK = 4
# Most chunks per row; the combine program reads their partials as one block. 151936 / (4 * 1024) = 38 < 64.
MAX_CHUNKS = 64
# Largest Gumbel noise any u gives, -log(-log(1 - 2^-24)) = 16.6355, rounded up: a tile whose max logit / T
# plus this is below the best score so far cannot hold the winner and skips its Philox draws.
GUMBEL_MAX = tl.constexpr(16.64)
# Tile of the overflow rule's race in the combine program (one warp): SMALL_BLOCK_V entries, 4 logits and 1
# Philox counter per thread, so that the rare rerun (tiny T, logits near +-3e38) adds no registers to the
# combine kernel every row runs.
RERUN_BLOCK = SMALL_BLOCK_V
# Filters' threshold search (one program per row): a tile of THRESHOLD_BLOCK entries is compared with
# THRESHOLD_PIVOTS pivots at once, [16, 1024] = 16384 pairs (32 per thread at 16 warps). The first pass
# spreads the pivots in value over the row's logits, the later ones in key, each of those narrowing the range
# of 32-bit keys 17-fold, so 1 + 8 passes always end it (17^8 > 2^32), most rows sooner (3.2 on average, 8
# at most, for top-k 1-1000 and top-p 0.5-0.99 on rows of 128256: tools/threshold_passes.py). One program
# walks a whole row (16 rows keep 16 SMs busy) and does 16 compares and sums per entry and pass; most
# searches run over the row's THRESHOLD_CANDIDATES x 1024 candidates instead (8 tiles a pass, not 126). On
# an H200 the former [256, 16] tile at 4 warps took 3.0 ms for top-k 50 and 4.9 ms for top-p 0.9 on 16 rows of
# 128256 (CUDA-graph time), 7-10x slower than eager torch. A tile of the search now takes 96-99 SASS
# instructions per warp for top-k and 137-145 for top-p on sm_90 (triton 3.8), against 254-264 and 303-315
# with int64 keys and a block reduction per tile: 2 per pair (`_sampling_key_search`). 109-114 registers
# (fp32, fp16) and 128 (bf16) on sm_90 with triton 3.8, 128 on sm_80 (the most 512 threads can have), no
# spill (triton 3.6: see THRESHOLD_FIRST_PASS_TILES); a 2048-entry tile spilled 280-428 bytes.
THRESHOLD_BLOCK = 1024
THRESHOLD_PIVOTS = 16
THRESHOLD_NUM_WARPS = 16
THRESHOLD_MAX_ROUNDS = 9  # one pass with pivots in value, then 8 in key
# Tiles a step of the threshold kernel's loops over a row, their loads issued together. Its one program per
# row (one per SM: 512 threads x 109-128 registers, two would not fit the register file) has no other loads
# to hide its own behind, and a step of the first design took 0.8 us (H200: 0.4 ms for a pass of 501 steps
# of 1 KB), about a memory round trip. The first pass takes 8 tiles a step: 32 KB in flight per SM in fp32,
# 16 KB in bf16 (a full GPU of rows keeps 132 x 32 KB = 4.2 MB in flight, about an H100's 3.35 TB/s x 1 us),
# all 16 loads of a thread hoisted to the step's top by ptxas, with no register more than at 2 tiles (sm_90,
# triton 3.8). The searches take 2 tiles a step (4 spilled 64 bytes in bf16: their [16, 1024] sums hold 32
# registers a thread), 8 KB in flight in fp32. Per tile, the steps take as many SASS instructions as
# before: 93-98 per warp for the first pass (98-104 at 2 tiles a step), 96-99 for a top-k pass and 137-145
# for top-p (sm_90, triton 3.8; 24 configurations). Triton 3.6 (the GPU machines' version) spills 124-220
# bytes with the searches' 2 tiles (24 and 0 with 1, sm_90 and sm_80), none of it in a loop over tiles:
# 31-51 local loads and stores in the code around a search's passes.
THRESHOLD_FIRST_PASS_TILES = 8
_FIRST_PASS_TILES = tl.constexpr(THRESHOLD_FIRST_PASS_TILES)
# Largest logits each lane of the threshold kernel's first pass keeps (`_sampling_threshold_kernel`; 8 or
# 0, none): 8 x 1024 = 8192 candidates a row, searched instead of the row when they hold the answer. With 8,
# the top 1000 of a row of 128256 fit in every lane (an even spread puts 1 in a lane; 9 in one lane is a
# 1e-6 chance per lane); the compare-exchange chain costs 16 instructions per entry in the first pass, and
# the candidates take 8 x 1024 x the logits' element size per row of workspace (32 KB in fp32).
THRESHOLD_CANDIDATES = 8
# Entries per chunk of the workspaces: (m, S, U, greedy value, best score, bad, race threshold) and
# (greedy index, best index). The threshold (-inf: no filter) is the same in every chunk: the partial
# kernel passes it on so that the combine kernel's overflow rerun keeps the same entries without a filtered
# configuration of its own.
PARTIAL_FLOATS = 7
PARTIAL_INTS = 2
_PARTIAL_FLOATS = tl.constexpr(PARTIAL_FLOATS)
_PARTIAL_INTS = tl.constexpr(PARTIAL_INTS)
INT32_MAX = 2**31 - 1
_INT32_MAX = tl.constexpr(INT32_MAX)
# Largest V the kernels take: entry indices and loop counters are int32, and a loop's counter goes one step
# (at most THRESHOLD_FIRST_PASS_TILES x 1024 = 8192 entries) past V before it stops; 2^16 of headroom.
MAX_VOCAB = 2**31 - 2**16
_FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)
# _sampling_key(-3.4028235e38): the smallest key of a finite float; the key of -inf is one below.
_LOWEST_KEY = tl.constexpr(-2139095040)
_NEG_INF_KEY = tl.constexpr(-2139095041)
# Lower clamp of the shift between two maxima: below ln(smallest denormal) = -103.3, so exp(shift) = 0 as
# without the clamp, while sum * shift stays finite (sums over a run of finfo.min logits shift by -3.4e38
# when ordinary logits follow: 128 * -3.4e38 = -inf, and -inf * 0 = NaN).
_EXP_FLOOR = tl.constexpr(-128.0)


@triton.jit
def _sampling_row_coordinates(positions):
    """(row, b, j) of this program's row of logits, row = b * positions + j (grid axis 0): row and b int64,
    j int32. Every address is taken in int64 but an entry's index in a row (below MAX_VOCAB) or a lane's in a
    tile: an int32 product wraps once it passes 2^31, e.g. row * chunks * 7 floats of the partials past 306M
    rows, or b times the stride of a strided seed, offset or filter view (a stride typed i32 below 2^31)."""
    row = tl.program_id(0)
    return row.to(tl.int64), (row // positions).to(tl.int64), row % positions


@triton.jit
def _sampling_gumbel_tile(x, v, start, temperature, seed, c1, c2, c3, ROWS: tl.constexpr):
    """Gumbel scores x / T + g of one tile laid out [ROWS, 4, 16] (v: vocabulary index of each entry)."""
    r = tl.arange(0, ROWS)[:, None, None]
    w = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 16)[None, None, :]
    c0 = (start // 4 + r * 16 + lane).to(tl.uint32)                        # [ROWS, 1, 16]
    o0, o1, o2, o3 = tl.philox(seed, c0, c1, c2, c3)
    word = tl.where(w == 0, o0, tl.where(w == 1, o1, tl.where(w == 2, o2, o3)))  # [ROWS, 4, 16]
    k = (2 * (word >> 9) + 1).to(tl.int32)
    u = k.to(tl.float32) * 5.9604644775390625e-08                           # 2^-24, exact
    g = -tl.log(-tl.log(u))
    return tl.div_rn(x, temperature) + g


@triton.jit
def _sampling_key(x):
    """Order-preserving int64 key of fp32 x (not NaN): key(a) < key(b) <=> a < b; -0.0 and 0.0 share one."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into 0.0
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _sampling_key_value(key):
    """The fp32 value of a key of `_sampling_key`."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _sampling_row_tile(row_ptr, start, vocab, mask_token_id, BLOCK: tl.constexpr):
    """Logits of entries start + [0, BLOCK) in fp32, -inf beyond V and at the mask token (threshold kernel).

    Loaded entry by entry, one per thread and step: the layout of the search's pivot sums
    (`_sampling_key_search`). Triton's coalescing gives a load the widest vectors of any load of the same
    shape its values connect it to, so 16-byte hints on the other passes' loads would send the search's tiles
    through shared memory too (sm_90: 106 and 196 SASS instructions a tile for top-k and top-p, against 95
    and 145)."""
    v = start + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + v, mask=v < vocab, other=-float("inf")).to(tl.float32)
    return tl.where(v == mask_token_id, -float("inf"), x)


@triton.jit
def _sampling_tile_pair(row_ptr, start, vocab, mask_token_id, BLOCK: tl.constexpr):
    """The two tiles at start and start + BLOCK of a search pass's step (`_sampling_row_tile`), both loaded
    before the caller uses either: ptxas then issues a thread's 4 loads together (sm_90; a second tile loaded
    after the first tile's sums waited for them in a bf16 top-p pass). Entries past V load as -inf, which
    has no weight and no key in a search's range."""
    return (_sampling_row_tile(row_ptr, start, vocab, mask_token_id, BLOCK),
            _sampling_row_tile(row_ptr, start + BLOCK, vocab, mask_token_id, BLOCK))


@triton.jit
def _sampling_tile_ptrs(row_ptr, v, vocab, ALIGNED: tl.constexpr):
    """(pointers, in-row mask) of a tile of entries v laid out [ROWS, 4, 16]. ALIGNED (checked by the
    launcher: 16-byte aligned rows, V * element size a multiple of 16) tells the compiler that each run of
    16 entries starts on 16 bytes and that the mask is constant over 16 bytes, so the tile loads as 16-byte
    vectors (fp32: 4 entries per thread in one load). The kernels compile without Triton's specialisation
    on pointer alignment and V % 16 (`unspecialised_jit`), which had given them that knowledge."""
    ptrs = row_ptr + v
    in_row = v < vocab
    if ALIGNED:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 1, 16]), [1, 1, 16])
        in_row = tl.max_constancy(in_row, [1, 1, 128 // row_ptr.dtype.element_ty.primitive_bitwidth])
    return ptrs, in_row


@triton.jit
def _sampling_top_p_weight(x, m, temperature):
    """q = exp((x - max) / T), 0 for -inf; the division (not x * (1/T)) keeps a subnormal T exact."""
    return tl.exp(tl.maximum(tl.div_rn(x - m, temperature), _EXP_FLOOR))


@triton.jit
def _sampling_extremes_in_range(x, lo_value, hi_value, x_min, x_max, inside_extra):
    """Per-lane running (smallest, largest) logit of the entries in [lo_value, hi_value) and inside_extra."""
    inside = (x >= lo_value) & (x < hi_value) & inside_extra
    return tl.minimum(x_min, tl.where(inside, x, float("inf"))), tl.maximum(x_max, tl.where(inside, x, -float("inf")))


@triton.jit
def _sampling_extreme_keys(x_min, x_max, lo, hi):
    """(key of the smallest, key of the largest) entry of per-lane extremes; (hi, lo - 1) if none."""
    any_inside = tl.max(x_max) >= tl.min(x_min)
    key_min = tl.where(any_inside, _sampling_key(tl.min(x_min)), hi)
    key_max = tl.where(any_inside, _sampling_key(tl.max(x_max)), lo - 1)
    return key_min, key_max


@triton.jit
def _sampling_key_search(row_ptr, vocab, mask_token_id, m, temperature, lo, hi, target, count_lo, total, x_low,
                         x_high, MASS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                         MAX_ROUNDS: tl.constexpr):
    """The largest key K in [lo, hi) with W(K) >= goal, where W(K) = sum of w over the entries whose key
    is >= K, w = 1 for entries above -inf (MASS False) or the top-p weight (MASS True); goal = target
    (MASS False) or target * W(lo) (MASS True: target is the fraction top_p); needs W(lo) >= goal > W(hi).
    hi <= lo + 1 on entry returns lo at once. [x_low, x_high]: bounds of the logits with weight (none below
    x_low), where the first pass places its pivots. count_lo: W(lo) when MASS is False (W(hi) is 0), an int32
    the search ignores with MASS. total (MASS): W(lo) when known (> 0), else 0 and the first pass measures it.

    Each pass over the row evaluates W at PIVOTS pivot keys in [lo, hi) and narrows the range to the two
    pivots around the answer, and ends the search as soon as a single key with weight is left in the range
    (FlashInfer's pivot search). The first pass spreads its pivots evenly in value over the logits' bounds,
    where the answer's neighbours lie; the later ones evenly in key, so that 8 more always end it
    (17^8 > 2^32): MAX_ROUNDS = 9. With MASS, the first pass's lowest pivot sits at the low bound, where W
    is W(lo), the total mass the goal is a fraction of: that sum needs no pass of its own (a search over a
    row's candidates is given the row's total instead).
    The entries are compared with the pivots' float values, which order them exactly as the keys do.

    Counts (MASS False) are exact, so the search knows how many entries its range holds and the rank of the
    answer among them. When that rank is 1 or the last, the answer is the range's largest or smallest entry,
    and the pass takes only the range's extremes (`_sampling_range_extreme`: a third of a pivot pass's SASS
    instructions per tile on sm_90, and the last pass), most often on a range the previous pass narrowed
    to a single entry.

    On rows of 128256 (N(0, s^2), s = 1, 2.5, 5, and 20 outliers; fp32 and bf16) a replay in numpy
    (tools/threshold_passes.py) counts 2.7-4.5 passes on average for top-k 20-1000 (0.5-1 of them
    extremes only) and 2.7-5.2 for top-p 0.5-0.99 (8 at most), against 4.8-6.0 and 5.7-7.0 with every pass
    in key and top-p's mass summed by a pass apart (for a row whose largest logit is 10 to 20, the first
    pass in key puts its 16 pivots below -2e4 or within 4e-3 of zero).
    """
    count_hi = tl.zeros_like(count_lo)
    rounds = 0
    while (hi - lo > 1) & (rounds < MAX_ROUNDS):
        if MASS:
            lo, hi, count_lo, count_hi, target = _sampling_pivot_pass(
                row_ptr, vocab, mask_token_id, m, temperature, lo, hi, target, count_lo, count_hi, total, x_low,
                x_high, rounds == 0, MASS, BLOCK, PIVOTS)
        else:
            rank = target - count_hi  # the answer is the rank-th largest of the count_lo - count_hi in range
            if (rank == 1) | (rank == count_lo - count_hi):
                lo = _sampling_range_extreme(row_ptr, vocab, mask_token_id, lo, hi, rank == 1, BLOCK)
                hi = lo + 1
            else:
                lo, hi, count_lo, count_hi, target = _sampling_pivot_pass(
                    row_ptr, vocab, mask_token_id, m, temperature, lo, hi, target, count_lo, count_hi, total,
                    x_low, x_high, rounds == 0, MASS, BLOCK, PIVOTS)
        rounds += 1
    return lo


@triton.jit
def _sampling_range_extreme(row_ptr, vocab, mask_token_id, lo, hi, largest, BLOCK: tl.constexpr):
    """Key of the largest (or, largest False, the smallest) entry with key in [lo, hi): one pass that takes
    only the range's extremes."""
    lo_value = _sampling_key_value(lo)
    hi_value = _sampling_key_value(hi)
    x_min = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    x_max = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
    for start in range(0, vocab, 2 * BLOCK):
        x0, x1 = _sampling_tile_pair(row_ptr, start, vocab, mask_token_id, BLOCK)
        x_min, x_max = _sampling_extremes_in_range(x0, lo_value, hi_value, x_min, x_max, True)
        x_min, x_max = _sampling_extremes_in_range(x1, lo_value, hi_value, x_min, x_max, True)
    key_min, key_max = _sampling_extreme_keys(x_min, x_max, lo, hi)
    return tl.where(largest, key_max, key_min)


@triton.jit
def _sampling_pivot_sums(x, reach_lane, x_min, x_max, pivot_values, lo_value, hi_value, m, temperature,
                         MASS: tl.constexpr):
    """A tile x [BLOCK] added to a pivot pass's per-lane sums (reach_lane [PIVOTS, BLOCK]: the weight of the
    lane's entries >= each pivot) and to its per-lane extremes of the entries with weight and key in
    [lo, hi)."""
    above = (x[None, :] >= pivot_values[:, None]).to(tl.float32)
    if MASS:
        w = _sampling_top_p_weight(x, m, temperature)
        reach_lane += above * w[None, :]
        x_min, x_max = _sampling_extremes_in_range(x, lo_value, hi_value, x_min, x_max, w > 0)
    else:
        reach_lane += above  # a pivot value is finite: an entry above it has weight 1
        x_min, x_max = _sampling_extremes_in_range(x, lo_value, hi_value, x_min, x_max, True)
    return reach_lane, x_min, x_max


@triton.jit
def _sampling_pivot_pass(row_ptr, vocab, mask_token_id, m, temperature, lo, hi, target, count_lo, count_hi,
                         total, x_low, x_high, first, MASS: tl.constexpr, BLOCK: tl.constexpr,
                         PIVOTS: tl.constexpr):
    """One pass of `_sampling_key_search` with PIVOTS pivots: (lo, hi, count_lo, count_hi, target) after it."""
    steps = tl.arange(0, PIVOTS).to(tl.int64) + 1
    if MASS:
        fractions = (steps - 1).to(tl.float32) / PIVOTS  # pivot 0 at the low bound: W there is W(lo)
    else:
        fractions = steps.to(tl.float32) / (PIVOTS + 1)
    # Pivots: [PIVOTS] keys in [lo, hi). a (1 - f) + b f stays finite for any finite a <= b.
    a = tl.maximum(_sampling_key_value(lo), x_low)
    b = tl.minimum(_sampling_key_value(hi - 1), x_high)
    by_value = tl.minimum(tl.maximum(_sampling_key(a * (1 - fractions) + b * fractions), lo), hi - 1)
    by_key = lo + ((hi - lo) * steps) // (PIVOTS + 1)
    pivots = tl.where(first, by_value, by_key)
    # Keys compared as floats: key(x) >= p <=> x >= value(p) for every x that is not NaN and every p
    # in [key(-max float), key(+inf)] (the key -1 is -0.0, which no x has: -0.0 and 0.0 share key 0).
    # Per pair, one float compare instead of an int64 one and the key of every entry.
    pivot_values = _sampling_key_value(pivots)
    lo_value = _sampling_key_value(lo)
    hi_value = _sampling_key_value(hi)
    # Sums per lane [PIVOTS, BLOCK], and the smallest and largest logit with weight and key in [lo, hi)
    # per lane: one block reduction per pass instead of one per tile. Both sums are kept in fp32 as
    # above * w + sum, which compiles to two instructions per (entry, pivot) on sm_90, a compare that
    # writes 1.0 or 0.0 and an FMA (an int32 count took about 4: a select, an add and register moves).
    # A lane counts at most V / BLOCK entries, exact in fp32; the counts are summed as int32.
    reach_lane = tl.zeros([PIVOTS, BLOCK], dtype=tl.float32)
    x_min = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    x_max = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
    for start in range(0, vocab, 2 * BLOCK):
        x0, x1 = _sampling_tile_pair(row_ptr, start, vocab, mask_token_id, BLOCK)
        reach_lane, x_min, x_max = _sampling_pivot_sums(x0, reach_lane, x_min, x_max, pivot_values, lo_value,
                                                        hi_value, m, temperature, MASS)
        reach_lane, x_min, x_max = _sampling_pivot_sums(x1, reach_lane, x_min, x_max, pivot_values, lo_value,
                                                        hi_value, m, temperature, MASS)
    if MASS:
        reach = tl.sum(reach_lane, axis=1)
        # The first pass's pivot 0 is key(max(value(lo), x_low)): no weight lies between it and lo. The
        # fraction becomes the goal in place (a register of its own spilled 8-20 bytes on sm_80).
        total = tl.where(total > 0, total, tl.sum(tl.where(steps == 1, reach, 0.0)))
        target = tl.where(first, target * total, target)
    else:
        reach = tl.sum(reach_lane.to(tl.int32), axis=1)
    key_min, key_max = _sampling_extreme_keys(x_min, x_max, lo, hi)
    enough = reach >= target
    if not MASS:
        # W is non-increasing in the key: W(new lo) is the least reach with enough, W(new hi) the largest without.
        count_lo = tl.min(tl.where(enough, reach, count_lo))
        count_hi = tl.max(tl.where(enough, count_hi, reach))
    single = key_min == key_max  # one key with weight left in [lo, hi): it is the answer
    new_lo = tl.max(tl.where(enough, pivots, lo))
    new_hi = tl.min(tl.where(enough, hi, pivots))
    return (tl.where(single, key_min, new_lo), tl.where(single, key_min + 1, new_hi), count_lo, count_hi, target)


@triton.jit
def _sampling_keep_largest(c0, c1, c2, c3, c4, c5, c6, c7, x):
    """Per lane, x inserted into the descending c0 >= c1 >= ... >= c7, the smallest of the nine dropped: a chain
    of compare-exchanges, 16 instructions per entry."""
    c0, x = tl.maximum(c0, x), tl.minimum(c0, x)
    c1, x = tl.maximum(c1, x), tl.minimum(c1, x)
    c2, x = tl.maximum(c2, x), tl.minimum(c2, x)
    c3, x = tl.maximum(c3, x), tl.minimum(c3, x)
    c4, x = tl.maximum(c4, x), tl.minimum(c4, x)
    c5, x = tl.maximum(c5, x), tl.minimum(c5, x)
    c6, x = tl.maximum(c6, x), tl.minimum(c6, x)
    return c0, c1, c2, c3, c4, c5, c6, tl.maximum(c7, x)


@triton.jit
def _sampling_count_above(c0, c1, c2, c3, c4, c5, c6, c7, bound):
    """Per lane, how many of its candidates are above bound."""
    return ((c0 > bound).to(tl.int32) + (c1 > bound).to(tl.int32) + (c2 > bound).to(tl.int32)
            + (c3 > bound).to(tl.int32) + (c4 > bound).to(tl.int32) + (c5 > bound).to(tl.int32)
            + (c6 > bound).to(tl.int32) + (c7 > bound).to(tl.int32))


@triton.jit
def _sampling_mass_above(c0, c1, c2, c3, c4, c5, c6, c7, bound, m, temperature):
    """Per lane, the top-p weight of its candidates above bound."""
    return (tl.where(c0 > bound, _sampling_top_p_weight(c0, m, temperature), 0.0)
            + tl.where(c1 > bound, _sampling_top_p_weight(c1, m, temperature), 0.0)
            + tl.where(c2 > bound, _sampling_top_p_weight(c2, m, temperature), 0.0)
            + tl.where(c3 > bound, _sampling_top_p_weight(c3, m, temperature), 0.0)
            + tl.where(c4 > bound, _sampling_top_p_weight(c4, m, temperature), 0.0)
            + tl.where(c5 > bound, _sampling_top_p_weight(c5, m, temperature), 0.0)
            + tl.where(c6 > bound, _sampling_top_p_weight(c6, m, temperature), 0.0)
            + tl.where(c7 > bound, _sampling_top_p_weight(c7, m, temperature), 0.0))


@triton.jit
def _sampling_online_mass(mass_y, mass_s, x, inv_temperature):
    """Per lane (y_max, sum of exp(y - y_max)) over the entries seen, y = x / T, updated with x (-inf: no
    weight); y_max starts at the lowest float, the sum at 0. One multiply by 1 / T (a division per entry,
    rounded to nearest, took 2.5x the instructions of this update on sm_90) and one exp per entry:
    exp(-|y - y_max|) is the new entry's weight or the old sum's rescaling. y = +inf (x / T overflows, or
    1 / T does for a subnormal T) leaves y_max = +inf, which the caller rejects."""
    y = x * inv_temperature
    live = x > -float("inf")
    d = tl.where(live, y - mass_y, -float("inf"))
    e = tl.exp(-tl.abs(d))
    mass_s = tl.where(d > 0, mass_s * e + 1.0, mass_s + e)
    return tl.maximum(mass_y, tl.where(live, y, -float("inf"))), mass_s


@triton.jit
def _sampling_search_source(use_candidates, cand_ptr, row_ptr, vocab, mask_token_id, CANDIDATES: tl.constexpr,
                            BLOCK: tl.constexpr):
    """(pointer, length, mask token) of what a search reads: the row's candidates or the row."""
    return (tl.where(use_candidates, cand_ptr, row_ptr), tl.where(use_candidates, CANDIDATES * BLOCK, vocab),
            tl.where(use_candidates, -1, mask_token_id))


@triton.jit
def _sampling_first_pass(row_ptr, cand_ptr, end, vocab, mask_token_id, temperature, keep, mass_on,
                         HAS_CANDIDATES: tl.constexpr, UNROLL: tl.constexpr, BLOCK: tl.constexpr):
    """The threshold kernel's first pass over entries [0, end) of a row: (max, smallest logit above -inf,
    bad (NaN or +inf: such rows are flagged by the partial kernel), entries above -inf, and of the
    candidates: floor, how many lie above -inf and above floor, the row's mass, the candidates' mass above
    floor). Per lane, reduced after the pass (a block reduction per tile would stall every tile's loads).
    keep (with HAS_CANDIDATES): each lane's 8 largest logits are kept; HAS_CANDIDATES: they are written to
    cand_ptr ([8, BLOCK], -inf where none), else none (floor -inf, counts 0). mass_on (with HAS_CANDIDATES):
    the row's top-p mass sum exp((x - m) / T) from online sums (0 when unknown: x / T or the sum overflowed
    fp32); else 0. The extras are uniform branches inside the loop: a loop of its own for each set spilled in
    bf16."""
    m_lane = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
    low_lane = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    bad_lane = tl.zeros([BLOCK], dtype=tl.int32)
    live_lane = tl.zeros([BLOCK], dtype=tl.int32)
    c0 = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    c4 = c0
    c5 = c0
    c6 = c0
    c7 = c0
    mass_y = tl.full([BLOCK], _FLOAT32_LOWEST, dtype=tl.float32)  # finite: no -inf - -inf in the update
    mass_s = tl.zeros([BLOCK], dtype=tl.float32)
    inv_temperature = 1.0 / tl.where(temperature > 0, temperature, 1.0)  # T <= 0: no pass (end = 0)
    # UNROLL tiles a step (THRESHOLD_FIRST_PASS_TILES): their loads are issued together (entries past V load as
    # -inf, which changes nothing here), UNROLL x the bytes in flight of a tile a step while the row comes
    # from HBM.
    for start in range(0, end, UNROLL * BLOCK):
        for u in tl.static_range(UNROLL):
            x = _sampling_row_tile(row_ptr, start + u * BLOCK, vocab, mask_token_id, BLOCK)
            bad_lane = tl.maximum(bad_lane, ((x != x) | (x == float("inf"))).to(tl.int32))  # noqa: PLR0124 (NaN)
            m_lane = tl.maximum(m_lane, x)
            above_inf = x > -float("inf")
            low_lane = tl.minimum(low_lane, tl.where(above_inf, x, float("inf")))
            live_lane += above_inf.to(tl.int32)
            if HAS_CANDIDATES:
                if keep:
                    c0, c1, c2, c3, c4, c5, c6, c7 = _sampling_keep_largest(c0, c1, c2, c3, c4, c5, c6, c7, x)
                if mass_on:
                    mass_y, mass_s = _sampling_online_mass(mass_y, mass_s, x, inv_temperature)
    m = tl.max(m_lane)
    if HAS_CANDIDATES:
        lane = tl.arange(0, BLOCK)
        tl.store(cand_ptr + lane, c0)
        tl.store(cand_ptr + BLOCK + lane, c1)
        tl.store(cand_ptr + 2 * BLOCK + lane, c2)
        tl.store(cand_ptr + 3 * BLOCK + lane, c3)
        tl.store(cand_ptr + 4 * BLOCK + lane, c4)
        tl.store(cand_ptr + 5 * BLOCK + lane, c5)
        tl.store(cand_ptr + 6 * BLOCK + lane, c6)
        tl.store(cand_ptr + 7 * BLOCK + lane, c7)
        tl.debug_barrier()  # the searches read every lane's candidates
    floor = tl.max(c7)
    y_max = tl.max(mass_y)
    mass = tl.sum(mass_s * tl.exp(mass_y - y_max))
    mass = tl.where(mass_on & (y_max < float("inf")) & (mass < float("inf")), mass, 0.0)
    mass_above = _sampling_mass_above(c0, c1, c2, c3, c4, c5, c6, c7, floor, tl.where(m > -float("inf"), m, 0.0),
                                      temperature)
    return (m, tl.min(low_lane), tl.max(bad_lane), tl.sum(live_lane), floor,
            tl.sum(_sampling_count_above(c0, c1, c2, c3, c4, c5, c6, c7, -float("inf"))),
            tl.sum(_sampling_count_above(c0, c1, c2, c3, c4, c5, c6, c7, floor)), mass, tl.sum(mass_above))


@unspecialised_jit
def _sampling_threshold_kernel(
    logits_ptr, stride_b, stride_k, temperature_ptr, temperature_stride, temperature_val, compute_mask_ptr,
    top_k_ptr, top_k_stride, top_k_val, top_p_ptr, top_p_stride, top_p_val, min_p_ptr, min_p_stride,
    min_p_val, threshold_ptr, candidates_ptr, positions, vocab, mask_token_id,
    HAS_TEMPERATURE: tl.constexpr, HAS_COMPUTE_MASK: tl.constexpr, FILTER_TENSORS: tl.constexpr,
    BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_ROUNDS: tl.constexpr, CANDIDATES: tl.constexpr,
):
    """threshold[row] = max(tau_k, tau_p, tau_m) of a sampled row with a filter on, else -inf.

    CANDIDATES (8, or 0 for none): the pass that finds the row's max also keeps, per lane of its BLOCK-entry
    tile, the lane's CANDIDATES largest logits, written to candidates[row] ([CANDIDATES, BLOCK], the logits'
    dtype). A top-k or top-p search runs over these 8192 entries (8 tiles a pass instead of V / BLOCK) when
    they hold its answer, which the first pass tells (`_sampling_first_pass`), else over the row: a row
    where one lane holds more than CANDIDATES of the entries the filter keeps (a flat row's top-p set, a
    top-k of thousands)."""
    tl.static_assert((CANDIDATES == 0) | (CANDIDATES == 8), "the first pass keeps 8 candidates a lane, or none")
    row, b, j = _sampling_row_coordinates(positions)
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + b * temperature_stride)
    else:
        temperature = temperature_val
    if FILTER_TENSORS:
        top_k = tl.load(top_k_ptr + b * top_k_stride)
        top_p = tl.load(top_p_ptr + b * top_p_stride)
        min_p = tl.load(min_p_ptr + b * min_p_stride)
    else:
        top_k = top_k_val
        top_p = top_p_val
        min_p = min_p_val
    computed = True
    if HAS_COMPUTE_MASK:
        computed = tl.load(compute_mask_ptr + row) != 0
    top_k_on = (top_k > 0) & (top_k < vocab)
    wanted = computed & (temperature > 0) & (top_k_on | (top_p < 1) | (min_p > 0))
    row_ptr = logits_ptr + b * stride_b + j.to(tl.int64) * stride_k
    # Candidates for a search (top-k above 1, top-p); the row's mass, when top-p has no top-k set to take
    # its fraction of (the fraction of a top-k set is measured over the candidates, which hold that set).
    keep_candidates = wanted & ((top_k_on & (top_k > 1)) | (top_p < 1))
    keep_mass = wanted & (top_p < 1) & ~top_k_on

    # Pass 1, 8 tiles a step. Every entry that is not a candidate is at most its lane's smallest candidate,
    # so at most floor: the entries above floor are all candidates. A search over the candidates gives the
    # row's answer when that answer lies above floor, which the counts and mass of the candidates above floor
    # tell before it runs.
    end = tl.where(wanted, vocab, 0)
    cand_ptr = candidates_ptr + row * (CANDIDATES * BLOCK)
    m, low, bad, live, floor, live_cand, above_floor, mass, mass_above_floor = _sampling_first_pass(
        row_ptr, cand_ptr, end, vocab, mask_token_id, temperature, keep_candidates & (CANDIDATES > 0),
        keep_mass & (CANDIDATES > 0), CANDIDATES > 0, _FIRST_PASS_TILES, BLOCK)
    active = wanted & (bad == 0) & (m > -float("inf"))
    lowest = tl.full((), _LOWEST_KEY, tl.int64)
    top = _sampling_key(tl.where(active, m, 0.0)) + 1

    # Everything the searches need is settled before them, so that fewer values stay live through their
    # passes (the bf16 configurations use all 128 registers 512 threads may have).
    # min-p: p >= min_p * p_max <=> x >= max + T ln(min_p), in fp64, rounded up to the next float.
    need_m = active & (min_p > 0)
    cut = m.to(tl.float64) + tl.cast(temperature, tl.float64) * tl.log(tl.where(need_m, min_p, 1.0).to(tl.float64))
    cut32 = cut.to(tl.float32)
    cut32 = tl.where(cut32.to(tl.float64) < cut, _sampling_key_value(_sampling_key(cut32) + 1), cut32)
    # The threshold so far goes to threshold[row] after each step and is read back at the next: held in
    # registers through the searches, tau_m (its fp64 cut, the fp32 rounding sunk to the end) and then tau_k
    # were spilled (bf16 with triton 3.8; every dtype with triton 3.6). A scalar store is issued by thread 0
    # alone (Triton predicates it on tid.x == 0), so only thread 0's value is used: it reads back its own
    # write. Every thread loads it, after the search's reductions (14-18 bar.sync between each store and the
    # next load; fp32, sm_90, triton 3.8), so the other threads read the same value, though their maxima are
    # never stored.
    tl.store(threshold_ptr + row, tl.where(need_m, cut32, -float("inf")))
    # top-k: the k-th largest logit (count weights); off, or fewer than k entries above -inf: -inf. The
    # search starts at the largest logit for top-k 1: a range of one key, no pass. Over the candidates when
    # at least k lie above floor.
    need_k = active & top_k_on & (live >= top_k)
    lo_k = tl.where(need_k & (top_k == 1), top - 1, lowest)
    k_on_candidates = need_k & (above_floor >= top_k)
    # top-p over the entries >= tau_k: the largest logit whose upper set holds top_p of their mass (the
    # search measures that mass in its first pass). Over the candidates when they hold top-k's whole set
    # (which then holds every entry top-p keeps), or, top-k off, when their mass above floor reaches top_p of
    # the row's (the search is then given the row's mass, and places its pivots above floor).
    need_p = active & (top_p < 1)
    p_on_candidates = need_p & tl.where(need_k, k_on_candidates, (mass > 0) & (mass_above_floor >= top_p * mass))
    given = p_on_candidates & ~need_k
    # Weights vanish below m - 128 T (_EXP_FLOOR): the mass lies in [max(low, m - 128 T), m].
    mass_low = tl.maximum(low, m + _EXP_FLOOR * temperature)
    x_low_p = tl.where(given, tl.maximum(mass_low, floor), mass_low)
    total_p = tl.where(given, mass, 0.0)

    p_ptr, p_len, p_mask = _sampling_search_source(p_on_candidates, cand_ptr, row_ptr, vocab, mask_token_id,
                                                   CANDIDATES, BLOCK)
    src_ptr, src_len, src_mask = _sampling_search_source(k_on_candidates, cand_ptr, row_ptr, vocab, mask_token_id,
                                                         CANDIDATES, BLOCK)
    key_k = _sampling_key_search(src_ptr, src_len, src_mask, m, temperature, lo_k,
                                 tl.where(need_k, top, lo_k + 1), top_k, tl.where(k_on_candidates, live_cand, live),
                                 0.0, tl.where(k_on_candidates, tl.maximum(low, floor), low), m, False, BLOCK,
                                 PIVOTS, MAX_ROUNDS)
    tl.store(threshold_ptr + row, tl.maximum(tl.load(threshold_ptr + row),
                                             tl.where(need_k, _sampling_key_value(key_k), -float("inf"))))

    # top-p off: the range of the one key of -inf, the answer at once (no flag kept past the search: on sm_80
    # it was spilled).
    lo_p = tl.where(need_p, key_k, _NEG_INF_KEY)  # key_k >= lowest: the search's lower end, or lowest when off
    key_p = _sampling_key_search(p_ptr, p_len, p_mask, m, temperature, lo_p,
                                 tl.where(need_p, top, lo_p + 1), top_p, live, total_p, x_low_p, m, True, BLOCK,
                                 PIVOTS, MAX_ROUNDS)
    tl.store(threshold_ptr + row, tl.maximum(tl.load(threshold_ptr + row), _sampling_key_value(key_p)))


@triton.jit
def _sampling_chunk(row_ptr, local, vocab, mask_token_id, first_tile, num_tiles, temperature, threshold,
                    seed, c1, c2, c3, bad, greedy, greedy_idx, best, best_idx, HAS_THRESHOLD: tl.constexpr,
                    BLOCK: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr):
    """(m, S, U) of tiles [first_tile, first_tile + num_tiles) of a row, and the races and NaN flag carried on
    over them: returns (m, S, U, bad, greedy, greedy_idx, best, best_idx)."""
    m = -float("inf")
    sum_exp = 0.0
    sum_xexp = 0.0
    for t in range(num_tiles):
        start = (first_tile + t) * BLOCK
        v = start + local
        ptrs, in_row = _sampling_tile_ptrs(row_ptr, v, vocab, ALIGNED)
        x = tl.load(ptrs, mask=in_row, other=-float("inf")).to(tl.float32)
        x = tl.where(v == mask_token_id, -float("inf"), x)
        bad = tl.maximum(bad, tl.max(((x != x) | (x == float("inf"))).to(tl.float32)))  # noqa: PLR0124 (NaN test)
        tile_max = tl.max(x)
        tile_arg = tl.min(tl.where(x == tile_max, v, _INT32_MAX))
        greedy_idx = tl.where(tile_max > greedy, tile_arg, greedy_idx)
        greedy = tl.maximum(greedy, tile_max)
        # Online (m, S, U): -inf entries (and an all -inf prefix) add exactly 0, never NaN.
        m_new = tl.maximum(m, tile_max)
        ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        shift = tl.where(m == -float("inf"), 0.0, tl.maximum(m - ref, _EXP_FLOOR))
        scale = tl.where(m == -float("inf"), 0.0, tl.exp(shift))
        d = tl.maximum(x - ref, _FLOAT32_LOWEST)  # -inf -> lowest: exp = 0 and exp * d = 0, not NaN
        e = tl.exp(d)
        sum_xexp = (sum_xexp + sum_exp * shift) * scale + tl.sum(e * d)
        sum_exp = sum_exp * scale + tl.sum(e)
        m = m_new
        if temperature > 0:  # the division below needs T > 0
            race = x
            race_max = tile_max
            if HAS_THRESHOLD:
                race = tl.where(x >= threshold, x, -float("inf"))
                race_max = tl.max(race)
            # A tile with nothing above -inf (padding, masked, filtered out) cannot hold the winner.
            if (tl.div_rn(race_max, temperature) + GUMBEL_MAX >= best) & (race_max > -float("inf")):
                score = _sampling_gumbel_tile(race, v, start, temperature, seed, c1, c2, c3, ROWS)
                score_max = tl.max(score)
                score_arg = tl.min(tl.where(score == score_max, v, _INT32_MAX))
                best_idx = tl.where(score_max > best, score_arg, best_idx)
                best = tl.maximum(best, score_max)
    return m, sum_exp, sum_xexp, bad, greedy, greedy_idx, best, best_idx


@unspecialised_jit
def _sampling_partial_kernel(
    logits_ptr, stride_b, stride_k, seed_ptr, seed_stride, offset_ptr, offset_stride,
    temperature_ptr, temperature_stride, temperature_val, compute_mask_ptr, threshold_ptr, partial_f_ptr,
    partial_i_ptr, positions, vocab, mask_token_id, tiles_per_chunk, num_chunks, chunks_per_split,
    HAS_TEMPERATURE: tl.constexpr, HAS_COMPUTE_MASK: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):
    row, b, j = _sampling_row_coordinates(positions)
    split = tl.program_id(1)
    # This program's chunks [first_chunk, first_chunk + split_chunks): the last split's run may be shorter.
    first_chunk = split * chunks_per_split
    split_chunks = tl.minimum(chunks_per_split, num_chunks - first_chunk)
    last_tile = (vocab - 1) // BLOCK
    computed = True
    if HAS_COMPUTE_MASK:
        computed = tl.load(compute_mask_ptr + row) != 0  # else every chunk gets 0 tiles, its partial still written
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + b * temperature_stride)
    else:
        temperature = temperature_val
    threshold = -float("inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)  # filters: the race keeps x >= threshold only
    seed = tl.load(seed_ptr + b * seed_stride)
    offset = tl.load(offset_ptr + b * offset_stride)
    c1 = j.to(tl.uint32)
    c2 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    row_ptr = logits_ptr + b * stride_b + j.to(tl.int64) * stride_k

    ROWS: tl.constexpr = BLOCK // 64
    local = (tl.arange(0, ROWS)[:, None, None] * 64 + tl.arange(0, 4)[None, :, None] * 16
             + tl.arange(0, 16)[None, None, :])                             # [ROWS, 4, 16]
    # The races (greedy maximum, Gumbel score) and the NaN flag run over the program's whole run of chunks, so
    # later chunks skip more noise; (m, S, U) start afresh in each chunk and end in its partial, whatever
    # the run it belongs to.
    bad = 0.0
    greedy = -float("inf")
    greedy_idx = -1
    best = -float("inf")
    best_idx = -1
    for c in range(split_chunks):
        chunk = first_chunk + c
        # The last chunk stops at the row's last tile (chunks x tiles_per_chunk can pass it), so that no tile
        # starts at 2^31 or beyond, where int32 entry indices wrap to -2^31 and pass `v < vocab`.
        num_tiles = tl.minimum(tiles_per_chunk, last_tile + 1 - chunk * tiles_per_chunk)
        if HAS_COMPUTE_MASK:
            num_tiles = tl.where(computed, num_tiles, 0)
        m, sum_exp, sum_xexp, bad, greedy, greedy_idx, best, best_idx = _sampling_chunk(
            row_ptr, local, vocab, mask_token_id, chunk * tiles_per_chunk, num_tiles, temperature, threshold,
            seed, c1, c2, c3, bad, greedy, greedy_idx, best, best_idx, HAS_THRESHOLD, BLOCK, ALIGNED, ROWS)
        out_f = partial_f_ptr + (row * num_chunks + chunk) * _PARTIAL_FLOATS
        tl.store(out_f + 0, m)
        tl.store(out_f + 1, sum_exp)
        tl.store(out_f + 2, sum_xexp)
        tl.store(out_f + 3, greedy)
        tl.store(out_f + 4, best)
        tl.store(out_f + 5, bad)
        tl.store(out_f + 6, threshold)
        out_i = partial_i_ptr + (row * num_chunks + chunk) * _PARTIAL_INTS
        tl.store(out_i + 0, greedy_idx)
        tl.store(out_i + 1, best_idx)


@unspecialised_jit
def _sampling_combine_kernel(
    logits_ptr, stride_b, stride_k, temperature_ptr, temperature_stride, temperature_val, compute_mask_ptr,
    seed_ptr, seed_stride, offset_ptr, offset_stride,
    partial_f_ptr, partial_i_ptr, tokens_ptr, entropy_ptr, logprob_ptr, valid_ptr,
    positions, vocab, mask_token_id, num_chunks,
    HAS_TEMPERATURE: tl.constexpr, HAS_COMPUTE_MASK: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    # SPLITS (MAX_CHUNKS): the block of a row's chunk partials, read at once; the name keeps the spec names.
    row, b, j = _sampling_row_coordinates(positions)
    computed = True
    if HAS_COMPUTE_MASK:
        computed = tl.load(compute_mask_ptr + row) != 0
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + b * temperature_stride)
    else:
        temperature = temperature_val

    s = tl.arange(0, SPLITS)
    live = s < num_chunks
    part_f = partial_f_ptr + row * num_chunks * _PARTIAL_FLOATS + s * _PARTIAL_FLOATS
    part_i = partial_i_ptr + row * num_chunks * _PARTIAL_INTS + s * _PARTIAL_INTS
    m = tl.load(part_f + 0, mask=live, other=-float("inf"))
    sum_exp = tl.load(part_f + 1, mask=live, other=0.0)
    sum_xexp = tl.load(part_f + 2, mask=live, other=0.0)
    greedy = tl.load(part_f + 3, mask=live, other=-float("inf"))
    best = tl.load(part_f + 4, mask=live, other=-float("inf"))
    bad = tl.max(tl.load(part_f + 5, mask=live, other=0.0))
    greedy_idx = tl.load(part_i + 0, mask=live, other=-1)
    best_idx = tl.load(part_i + 1, mask=live, other=-1)

    row_max = tl.max(m)
    valid = computed & (bad == 0) & (row_max > -float("inf"))
    ref = tl.where(row_max == -float("inf"), 0.0, row_max)
    shift = tl.where(m == -float("inf"), 0.0, tl.maximum(m - ref, _EXP_FLOOR))
    scale = tl.where(m == -float("inf"), 0.0, tl.exp(shift))
    total_exp = tl.sum(sum_exp * scale)
    total_xexp = tl.sum((sum_xexp + sum_exp * shift) * scale)

    greedy_max = tl.max(greedy)
    greedy_token = tl.min(tl.where(greedy == greedy_max, greedy_idx, _INT32_MAX))
    best_max = tl.max(best)
    best_token = tl.min(tl.where((best == best_max) & (best_idx >= 0), best_idx, _INT32_MAX))
    sampled = (temperature > 0) & (best_max > -float("inf"))
    token = tl.where(sampled, best_token, greedy_token)

    # Overflow rule (naive.py): a sampled row whose best score is +-inf races again over its kept entries
    # on (x - m) / T + g; the loop has no trip for any other row.
    row_ptr = logits_ptr + b * stride_b + j.to(tl.int64) * stride_k
    rerun = valid & (temperature > 0) & ((best_max == float("inf")) | (best_max == -float("inf")))
    threshold = tl.load(partial_f_ptr + row * num_chunks * _PARTIAL_FLOATS + 6)
    seed = tl.load(seed_ptr + b * seed_stride)
    offset = tl.load(offset_ptr + b * offset_stride)
    c1 = j.to(tl.uint32)
    c2 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    ROWS: tl.constexpr = BLOCK // 64
    local = (tl.arange(0, ROWS)[:, None, None] * 64 + tl.arange(0, 4)[None, :, None] * 16
             + tl.arange(0, 16)[None, None, :])                             # [ROWS, 4, 16]
    rerun_best = -float("inf")
    rerun_idx = -1
    for start in range(0, tl.where(rerun, vocab, 0), BLOCK):
        v = start + local
        x = tl.load(row_ptr + v, mask=v < vocab, other=-float("inf")).to(tl.float32)
        x = tl.where((v == mask_token_id) | (x < threshold), -float("inf"), x)
        score = _sampling_gumbel_tile(x - ref, v, start, temperature, seed, c1, c2, c3, ROWS)
        score_max = tl.max(score)
        score_arg = tl.min(tl.where(score == score_max, v, _INT32_MAX))
        rerun_idx = tl.where(score_max > rerun_best, score_arg, rerun_idx)
        rerun_best = tl.maximum(rerun_best, score_max)
    token = tl.where(rerun & (rerun_idx >= 0), rerun_idx, token)
    token = tl.where(valid, token, 0)

    x_token = tl.load(row_ptr + token, mask=valid, other=0.0).to(tl.float32)
    log_z = tl.log(tl.where(valid, total_exp, 1.0))
    entropy = log_z - total_xexp / tl.where(valid, total_exp, 1.0)
    logprob = x_token - ref - log_z

    tl.store(tokens_ptr + row, tl.where(valid, token, tl.where(computed, 0, -1)).to(tl.int64))
    tl.store(entropy_ptr + row, tl.where(valid, entropy, float("inf")))
    tl.store(logprob_ptr + row, tl.where(valid, logprob, -float("inf")))
    tl.store(valid_ptr + row, valid.to(tl.int8))


def _block_size(vocab: int) -> int:
    return BLOCK_V if vocab >= SMALL_VOCAB else SMALL_BLOCK_V


def _num_warps(block: int) -> int:
    return NUM_WARPS if block == BLOCK_V else SMALL_NUM_WARPS


def _chunk_plan(vocab: int) -> tuple[int, int]:
    """(tiles per chunk, number of chunks) of a row of `vocab` entries: V alone fixes them, so that a row's
    partial sums, and so its entropy and logprob, do not depend on the batch or the GPU. At least
    MIN_TILES_PER_CHUNK tiles a chunk, at most MAX_CHUNKS chunks a row."""
    num_tiles = cdiv(vocab, _block_size(vocab))
    tiles_per_chunk = max(MIN_TILES_PER_CHUNK, cdiv(num_tiles, MAX_CHUNKS))
    return tiles_per_chunk, cdiv(num_tiles, tiles_per_chunk)


def _split_plan(rows: int, num_chunks: int, target_programs: int) -> tuple[int, int]:
    """(chunks per split, number of splits) for rows of `num_chunks` chunks: about `target_programs`
    programs (PROGRAMS_PER_SM per SM), each a run of whole chunks."""
    wanted = max(1, min(num_chunks, cdiv(target_programs, rows)))
    chunks_per_split = cdiv(num_chunks, wanted)
    return chunks_per_split, cdiv(num_chunks, chunks_per_split)


FLOAT32_MIN_NORMAL = 2.0**-126


def _fp32_scalar_argument(value: float, batch: int, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """(tensor, scalar) kernel arguments for a host scalar, rounded to fp32 as the oracle and the C++ kernel
    round it. Compiled, Triton (3.4, 3.6 and 3.8) types every Python float argument fp32, whatever its
    value. Under TRITON_INTERPRET (3.6 and 3.8 alike) the argument stays a Python float and each op types it
    by value: fp64 when it is not 0, inf, NaN or a normal fp32 value, e.g. a subnormal 1e-40, so the
    interpreted kernels would run in fp64 what the GPU runs in fp32. Such a value goes to the kernel as a [B]
    fp32 tensor instead, the same on both paths (rare: no speed concern; the rounded values here are never
    above FLT_MAX)."""
    value32 = torch.tensor(value, dtype=torch.float32).item()
    if value32 != 0.0 and abs(value32) < FLOAT32_MIN_NORMAL:
        return torch.full((batch,), value32, dtype=torch.float32, device=device), 0.0
    return None, value32


def _per_row_stride(t: torch.Tensor) -> int:
    """Row stride of a [B] / [] / [1] tensor: 0 broadcasts its single element."""
    return t.stride(0) if t.dim() == 1 and t.numel() > 1 else 0


def _filter_arguments(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val, batch, device):
    """(FILTER_TENSORS, (top_k, top_p, min_p) tensors or Nones, (top_k_val, top_p_val, min_p_val)): the
    threshold kernel reads all three filters from [B] tensors or all three from scalars. When only some
    come as tensors (or a scalar must go as a tensor, see `_fp32_scalar_argument`) the others are filled
    into [B] tensors (a fill kernel each, no host sync), which keeps the compiled configurations at two."""
    if top_p is None:
        top_p, top_p_val = _fp32_scalar_argument(top_p_val, batch, device)
    if min_p is None:
        min_p, min_p_val = _fp32_scalar_argument(min_p_val, batch, device)
    if top_k is None and top_p is None and min_p is None:
        return False, (None, None, None), (top_k_val, top_p_val, min_p_val)
    if top_k is None:
        top_k = torch.full((batch,), top_k_val, dtype=torch.int64, device=device)
    if top_p is None:
        top_p = torch.full((batch,), top_p_val, dtype=torch.float32, device=device)
    if min_p is None:
        min_p = torch.full((batch,), min_p_val, dtype=torch.float32, device=device)
    return True, (top_k, top_p, min_p), (0, 1.0, 0.0)


def _sampling_launches(logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                       temperature: torch.Tensor | None = None, temperature_val: float = 0.0,
                       compute_mask: torch.Tensor | None = None, mask_token_id: int = -1,
                       top_k: torch.Tensor | None = None, top_k_val: int = 0,
                       top_p: torch.Tensor | None = None, top_p_val: float = 1.0,
                       min_p: torch.Tensor | None = None, min_p_val: float = 0.0,
                       ) -> tuple[tuple[torch.Tensor, ...], list[KernelLaunch]]:
    """Everything the launcher does but run the kernels: the checks, the four outputs and the launches
    (none when there is no row). On META tensors, the configurations a CUDA call would compile."""
    batch, positions, vocab = check_entropy_sample_args(logits, seed, offset, temperature, temperature_val,
                                                        compute_mask, mask_token_id, top_k, top_k_val,
                                                        top_p, top_p_val, min_p, min_p_val)
    if vocab > MAX_VOCAB:
        raise RuntimeError(f"sbd.entropy_sample: logits vocabulary V = {vocab} must be at most 2^31 - 2^16 = "
                           f"{MAX_VOCAB} on this backend (int32 entry indices)")
    if batch * positions > MAX_GRID_X:
        raise RuntimeError(f"sbd.entropy_sample: logits has B * K = {batch * positions} rows; this backend takes "
                           f"at most 2^31 - 1 (one program per row)")
    device = logits.device
    tokens = torch.empty(batch, positions, dtype=torch.int64, device=device)
    entropy = torch.empty(batch, positions, dtype=torch.float32, device=device)
    logprob = torch.empty(batch, positions, dtype=torch.float32, device=device)
    valid = torch.empty(batch, positions, dtype=torch.bool, device=device)
    outputs = (tokens, entropy, logprob, valid)
    # Before the early return: a call with no row (K = 0) still rejects bad per-row values, as the oracle and
    # the C++ kernel do.
    for ok, message in per_row_value_checks(temperature, top_k, top_p, min_p):
        torch._assert_async(ok, message)
    rows = batch * positions
    if rows == 0:
        return outputs, []
    if temperature is None:
        temperature, temperature_val = _fp32_scalar_argument(temperature_val, batch, device)
    if logits.stride(2) != 1:
        logits = logits.contiguous()  # vocabulary-strided rows: one copy, then coalesced tile loads
    # 16-byte vector loads (ALIGNED) need 16-byte aligned rows and V * element size % 16 == 0 (the last
    # tile's mask): most vocabularies (32000, 128256, 151936), not 50257.
    aligned = rows_aligned(logits) and vocab * logits.element_size() % 16 == 0

    tiles_per_chunk, num_chunks = _chunk_plan(vocab)
    chunks_per_split, num_splits = _split_plan(rows, num_chunks, PROGRAMS_PER_SM * sm_count(device))
    partial_f = torch.empty(rows, num_chunks, PARTIAL_FLOATS, dtype=torch.float32, device=device)
    partial_i = torch.empty(rows, num_chunks, PARTIAL_INTS, dtype=torch.int32, device=device)
    # Unused pointer arguments (constexpr flags off) get a workspace of the right element type.
    temperature_arg = temperature if temperature is not None else partial_f
    mask_arg = (compute_mask.contiguous() if compute_mask is not None else valid).view(torch.uint8)
    flags = {"HAS_TEMPERATURE": temperature is not None, "HAS_COMPUTE_MASK": compute_mask is not None}
    # The arguments every kernel takes first: logits rows, temperature, compute_mask.
    row_args = {"logits_ptr": logits, "stride_b": logits.stride(0), "stride_k": logits.stride(1),
                "temperature_ptr": temperature_arg,
                "temperature_stride": temperature.stride(0) if temperature is not None else 0,
                "temperature_val": float(temperature_val), "compute_mask_ptr": mask_arg}
    seed = seed.reshape(-1)
    offset = offset.reshape(-1)

    launches = []
    has_threshold = filters_requested(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val)
    threshold = partial_f
    if has_threshold:
        filter_tensors, (top_k, top_p, min_p), (top_k_val, top_p_val, min_p_val) = _filter_arguments(
            top_k, top_k_val, top_p, top_p_val, min_p, min_p_val, batch, device)
        threshold = torch.empty(rows, dtype=torch.float32, device=device)
        candidates = torch.empty(rows, THRESHOLD_CANDIDATES * THRESHOLD_BLOCK, dtype=logits.dtype, device=device)
        launches.append(KernelLaunch(_sampling_threshold_kernel, (rows,), {
            **row_args,
            "top_k_ptr": top_k if filter_tensors else seed,
            "top_k_stride": _per_row_stride(top_k) if filter_tensors else 0,
            "top_k_val": int(min(top_k_val, vocab)),  # k >= V keeps everything: an i32 argument whatever k
            "top_p_ptr": top_p if filter_tensors else partial_f,
            "top_p_stride": _per_row_stride(top_p) if filter_tensors else 0, "top_p_val": float(top_p_val),
            "min_p_ptr": min_p if filter_tensors else partial_f,
            "min_p_stride": _per_row_stride(min_p) if filter_tensors else 0, "min_p_val": float(min_p_val),
            "threshold_ptr": threshold, "candidates_ptr": candidates, "positions": positions, "vocab": vocab,
            "mask_token_id": mask_token_id,
        }, {**flags, "FILTER_TENSORS": filter_tensors, "BLOCK": THRESHOLD_BLOCK, "PIVOTS": THRESHOLD_PIVOTS,
            "MAX_ROUNDS": THRESHOLD_MAX_ROUNDS, "CANDIDATES": THRESHOLD_CANDIDATES}, THRESHOLD_NUM_WARPS))

    block = _block_size(vocab)
    launches.append(KernelLaunch(_sampling_partial_kernel, (rows, num_splits), {
        **row_args, "seed_ptr": seed, "seed_stride": _per_row_stride(seed), "offset_ptr": offset,
        "offset_stride": _per_row_stride(offset), "threshold_ptr": threshold, "partial_f_ptr": partial_f,
        "partial_i_ptr": partial_i, "positions": positions, "vocab": vocab, "mask_token_id": mask_token_id,
        "tiles_per_chunk": tiles_per_chunk, "num_chunks": num_chunks, "chunks_per_split": chunks_per_split,
    }, {**flags, "HAS_THRESHOLD": has_threshold, "BLOCK": block,
        # The small tile (V < SMALL_VOCAB, 128 entries a step) has one configuration: vectors gain nothing there.
        "ALIGNED": aligned and block == BLOCK_V}, _num_warps(block)))
    launches.append(KernelLaunch(_sampling_combine_kernel, (rows,), {
        **row_args, "seed_ptr": seed, "seed_stride": _per_row_stride(seed), "offset_ptr": offset,
        "offset_stride": _per_row_stride(offset), "partial_f_ptr": partial_f, "partial_i_ptr": partial_i,
        "tokens_ptr": tokens, "entropy_ptr": entropy, "logprob_ptr": logprob, "valid_ptr": valid.view(torch.int8),
        "positions": positions, "vocab": vocab, "mask_token_id": mask_token_id, "num_chunks": num_chunks,
    }, {**flags, "SPLITS": MAX_CHUNKS, "BLOCK": RERUN_BLOCK}, 1))
    return outputs, launches


def entropy_sample(logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                   temperature: torch.Tensor | None = None, temperature_val: float = 0.0,
                   compute_mask: torch.Tensor | None = None, mask_token_id: int = -1,
                   top_k: torch.Tensor | None = None, top_k_val: int = 0,
                   top_p: torch.Tensor | None = None, top_p_val: float = 1.0,
                   min_p: torch.Tensor | None = None, min_p_val: float = 0.0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of `sbd.entropy_sample` (same contract; CUDA tensors, or CPU under TRITON_INTERPRET).

    Filters off (no filter tensor, every scalar off): two launches, the partial and the combine kernel.
    Filters requested: the threshold kernel first (one program per row, with a workspace of 8192 logits a
    row for its candidates), then the partial kernel with its race restricted to x >= threshold. No host
    sync either way: CUDA-graph capturable.
    """
    outputs, launches = _sampling_launches(logits, seed, offset, temperature, temperature_val, compute_mask,
                                           mask_token_id, top_k, top_k_val, top_p, top_p_val, min_p, min_p_val)
    launch(launches)
    return outputs


_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _spec_name(kl: KernelLaunch) -> str:
    """Readable id of the configuration a launch compiles: the logits dtype and its constexprs."""
    c = kl.constexprs
    label = (f"{_TRITON_DTYPES[kl.args['logits_ptr'].dtype]} "
             f"temperature={'tensor' if c['HAS_TEMPERATURE'] else 'scalar'} mask={c['HAS_COMPUTE_MASK']}")
    if kl.kernel is _sampling_combine_kernel:
        return f"entropy_sample/combine {label} SPLITS={c['SPLITS']}"
    if kl.kernel is _sampling_threshold_kernel:
        return (f"entropy_sample/threshold {label} filters={'tensor' if c['FILTER_TENSORS'] else 'scalar'} "
                f"BLOCK={c['BLOCK']} PIVOTS={c['PIVOTS']}")
    return (f"entropy_sample/partial {label}{' filtered' if c['HAS_THRESHOLD'] else ''} BLOCK={c['BLOCK']} "
            f"{'aligned' if c['ALIGNED'] else 'unaligned'}")


def specs_of_launches(launches: list[KernelLaunch]) -> list[KernelSpec]:
    """The compile job of each launch, named by its configuration."""
    return [spec_of_launch(_spec_name(kl), kl) for kl in launches]


def meta_launches(batch: int, positions: int, vocab: int, dtype: torch.dtype, temperature_tensor: bool = False,
                  compute_mask: bool = False, top_k_val: int = 0, top_p_val: float = 1.0, min_p_val: float = 0.0,
                  filter_tensors: bool = False) -> list[KernelLaunch]:
    """The launches of a call on fresh contiguous META tensors (no memory): logits [B, K, V] of `dtype`, [B]
    int64 seed and offset, temperature a [B] fp32 tensor or the scalar 1.0, compute_mask [B, K] or none,
    the filters as scalars or (filter_tensors) as [B] tensors. What a CUDA call compiles."""
    meta = {"device": "meta"}
    seed = torch.empty(batch, dtype=torch.int64, **meta)
    filters = {"top_k_val": top_k_val, "top_p_val": top_p_val, "min_p_val": min_p_val}
    if filter_tensors:
        filters |= {"top_k": torch.empty_like(seed), "top_p": torch.empty(batch, **meta),
                    "min_p": torch.empty(batch, **meta)}
    return _sampling_launches(torch.empty(batch, positions, vocab, dtype=dtype, **meta), seed, torch.empty_like(seed),
                              torch.empty(batch, **meta) if temperature_tensor else None, 1.0,
                              torch.empty(batch, positions, dtype=torch.bool, **meta) if compute_mask else None,
                              **filters)[1]


def aot_specs() -> list[KernelSpec]:
    """Every configuration the launcher can pick, from the launches of representative calls (B = 2, K = 4):
    logits dtype x temperature tensor or scalar x compute_mask x vocabulary below SMALL_VOCAB, 32000 or
    32001 (the partial kernel's two tiles, each with several splits; 16-byte rows or not) x filters off, as
    scalars (top-k 50, top-p 0.9) or as tensors. A partial configuration is dtype x flags x tile (the large
    one aligned or not) x filtered, a combine one dtype x flags, a threshold one (filters only) dtype x
    flags x filters as tensors or scalars."""
    filter_cases = ({}, {"top_k_val": 50, "top_p_val": 0.9}, {"filter_tensors": True})
    launches = [kl for dtype in _TRITON_DTYPES for temperature_tensor in (False, True)
                for compute_mask in (False, True) for vocab in (SMALL_VOCAB - 1, 32000, 32001)
                for filters in filter_cases
                for kl in meta_launches(2, 4, vocab, dtype, temperature_tensor, compute_mask, **filters)]
    return unique_specs(specs_of_launches(launches))


def picked_specs(batch: int, positions: int, vocab: int, dtype: torch.dtype, temperature_tensor: bool = False,
                 compute_mask: bool = False, top_k_val: int = 0, top_p_val: float = 1.0) -> list[str]:
    """Names (as in `aot_specs()`) of the configurations a CUDA call on fresh contiguous tensors of these
    shapes compiles (`meta_launches`): threshold (filters on), partial and combine."""
    return [spec.name for spec in specs_of_launches(meta_launches(batch, positions, vocab, dtype, temperature_tensor,
                                                                  compute_mask, top_k_val, top_p_val))]

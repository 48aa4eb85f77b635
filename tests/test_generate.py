"""NTP and SBD decoding (sbd_kernels.generate): cached decode against the full-recompute oracle, batching,
the EOS rule, NFE accounting, the exact-KV property, torch.compile of the steps.

Models are random `tiny` ones with weights drawn at std 1 (instead of 0.02) so that their predictions
are sharp and varied: entropies spread over [0, log V], several tokens get accepted per pass at
moderate gamma, and greedy answers are not one repeated token. The model decodes on the CPU (C++ kernels),
or on CUDA (Triton kernels) with SBD_TEST_DEVICE=cuda, where the CUDA-graph decode is tested too.
"""
import copy
import dataclasses
import doctest
import functools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sbd_kernels import generate as gen
from sbd_kernels.generate import DecodeConfig, generate, oracle_decode
from sbd_kernels.model import KVCache, ModelConfig, Transformer
from sbd_kernels.testing import cuda_graph_mode_params, rehearse_cuda_graphs, tolerance, triton_test_device

DEVICE = triton_test_device()
EOS, PAD = 1, 0
PROMPT_LENGTHS = (5, 1, 9)          # different lengths: per-row positions and padding rows
BLOCK = 4
BUDGET = 9                              # not a multiple of BLOCK: the last block overhangs the budget


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(1)
    net = Transformer(ModelConfig.preset("tiny")).eval()
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0)
    return net.to(DEVICE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(4, 40, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def oracle(model, prompts):
    """oracle(cfg, eos) -> oracle_decode of the module's prompts, computed once per (cfg, eos)."""
    results = {}

    def run(cfg: DecodeConfig, eos: int) -> gen.DecodeResult:
        if (cfg, eos) not in results:
            results[cfg, eos] = oracle_decode(model, prompts, cfg, eos_id=eos, pad_id=PAD)
        return results[cfg, eos]

    return run


def ops_for(name: str) -> gen.DecodeOps:
    return gen.fused_ops() if name == "fused" else gen.naive_ops()


def first_token_after_start(answers: list[list[int]]) -> int:
    """A token some answer produces at index >= 1: used as EOS so that the EOS rule actually fires."""
    for answer in answers:
        for token in answer[1:]:
            if token not in answer[:1]:
                return token
    raise AssertionError("answers too uniform to pick an EOS token")


def assert_same_decode(actual: gen.DecodeResult, expected: gen.DecodeResult) -> None:
    assert actual.answers == expected.answers
    assert actual.tokens == expected.tokens
    assert actual.nfe.tolist() == expected.nfe.tolist()
    assert actual.generated.tolist() == expected.generated.tolist()
    assert actual.accepted_hist.tolist() == expected.accepted_hist.tolist()
    assert actual.stopped_early.tolist() == expected.stopped_early.tolist()


def pass_limited_observer(limit: int):
    """An oracle observer that fails the test once a prompt has taken more than `limit` passes, so that an
    oracle decode that would never end fails instead of hanging."""
    passes: dict[int, int] = {}

    def observe(step: gen.OraclePass) -> None:
        passes[step.prompt] = passes.get(step.prompt, 0) + 1
        assert passes[step.prompt] <= limit, f"oracle_decode ran past {limit} passes on prompt {step.prompt}"

    return observe


# ----------------------------------------------------------------------------------------------------
# Cached decode == full-recompute oracle decode
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ops", ["fused", "naive"])
@pytest.mark.parametrize("method,gamma", [("ntp", 0.0), ("sbd", 0.0), ("sbd", 0.5), ("sbd", 4.0)])
def test_cached_decode_matches_oracle(model, prompts, oracle, ops, method, gamma):
    """Guards against wrong cache positions, a completed block not appended (or appended twice), block K/V
    leaking into the cache, wrong per-row num_causal, and NFE miscounts: the cached decode with the ops
    must give the oracle's tokens, NFE and acceptance counts (temperature 0)."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=gamma, max_new_tokens=BUDGET)
    cached = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, ops=ops_for(ops))
    assert_same_decode(cached, oracle(cfg, EOS))


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_cached_decode_matches_oracle_with_eos(model, prompts, method):
    """Guards against an EOS rule that differs between the batched tensor version and the literal one
    (answers cut at EOS, NFE of finished rows no longer counted)."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    eos = first_token_after_start(generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD).answers)
    cached = generate(model, prompts, cfg, eos_id=eos, pad_id=PAD)
    assert_same_decode(cached, oracle_decode(model, prompts, cfg, eos_id=eos, pad_id=PAD))
    assert any(n < BUDGET for n in cached.generated.tolist()), "EOS never ended a sequence"


def test_cached_decode_matches_oracle_with_temperature(model, prompts):
    """Guards against seed / offset conventions that differ between the cached loop and the oracle
    (sampling keyed on (seed + prompt index, passes done so far))."""
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, temperature=1.0, max_new_tokens=BUDGET, seed=5)
    cached = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, ops=gen.naive_ops())
    assert_same_decode(cached, oracle_decode(model, prompts, cfg, eos_id=EOS, pad_id=PAD))


# ----------------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_batched_equals_one_by_one(model, prompts, method, temperature):
    """Guards against rows of a batch leaking into each other (padding, per-row phases, per-row seeds):
    decoding all prompts together must give what decoding them one at a time gives."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, temperature=temperature,
                       max_new_tokens=BUDGET)
    together = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD)
    assert_same_decode(together, generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, batch_size=1))


def test_one_pass_mixes_phases(model, prompts):
    """Guards against a batched test that passes only because every row happens to be in the same phase:
    some pass must run rows starting a new block (num_causal = K) beside rows in a later pass (0)."""
    mixed = []

    def spy_step(model_, cache, state, ops, sp, causal_slots):
        running = ~state.finished
        pending = state.num_pending[running]
        mixed.append(bool((pending == BLOCK).any() and (pending == 0).any()))
        gen.sbd_block_step(model_, cache, state, ops, sp, causal_slots)

    steps = dataclasses.replace(gen.EAGER_STEPS, sbd_block_step=spy_step)
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    result = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)
    assert any(mixed)
    assert_same_decode(result, generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, batch_size=1))


# ----------------------------------------------------------------------------------------------------
# EOS rule, budget, NFE accounting
# ----------------------------------------------------------------------------------------------------
def one_hot_logits(tokens: list[int | None], vocab: int) -> torch.Tensor:
    """[1, K, V] logits: a confident prediction of the given token (logit margin 10: entropy ~3e-3, small
    but not 0, so gamma 0 reveals it alone), uniform (entropy ~2) where None."""
    logits = torch.zeros(1, len(tokens), vocab)
    for j, t in enumerate(tokens):
        if t is not None:
            logits[0, j, t] = 10.0
    return logits


def test_eos_waits_for_earlier_positions():
    """Guards against finishing on an EOS revealed while an earlier block position is still masked, and
    against keeping positions after the EOS (docs/algorithm.md §3.8)."""
    vocab, eos, mask = 8, 1, 2
    sp = gen.DecodeConstants(eos_ids=(eos,), pad_id=0, mask_id=mask, block_size=4, max_new_tokens=16,
                             gamma=0.0, temperature=0.0, rule="eb")
    state = gen.SbdState.empty(1, sp, torch.zeros(1, dtype=torch.int64))
    ops = gen.naive_ops()
    gen._sbd_accept(state, one_hot_logits([None, None, eos, None], vocab), ops, sp)   # reveals EOS only
    assert state.block.tolist() == [[mask, mask, eos, mask]]
    assert not bool(state.finished[0])
    sp = dataclasses.replace(sp, gamma=0.01)                                          # reveals 0, 1, 3
    gen._sbd_accept(state, one_hot_logits([5, 6, None, None], vocab), ops, sp)
    assert bool(state.finished[0])
    assert state.generated.tolist() == [3] and state.nfe.tolist() == [2]
    assert gen._answers(state.answer, state.generated, (eos,)) == [[5, 6]]


def test_eos_in_first_position_ends_with_empty_answer():
    """Guards against an off-by-one in the first-EOS search when the EOS is the very first token."""
    sp = gen.DecodeConstants(eos_ids=(1,), pad_id=0, mask_id=2, block_size=4, max_new_tokens=16, gamma=0.0,
                             temperature=0.0, rule="eb")
    state = gen.SbdState.empty(1, sp, torch.zeros(1, dtype=torch.int64))
    gen._sbd_accept(state, one_hot_logits([1, None, None, None], 8), gen.naive_ops(), sp)
    assert bool(state.finished[0]) and state.generated.tolist() == [1]
    assert gen._answers(state.answer, state.generated, (1,)) == [[]]


@pytest.mark.parametrize("budget", [1, 4, 9])
def test_budget_without_eos(model, prompts, budget):
    """Guards against answers longer than max_new_tokens and against passes spent on block positions past
    the budget: with gamma 0 every pass reveals exactly one token, so NFE == budget exactly."""
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.0, max_new_tokens=budget)
    result = generate(model, prompts, cfg, eos_id=-1, pad_id=PAD)
    assert [len(a) for a in result.answers] == [budget] * len(prompts)
    assert result.nfe.tolist() == [budget] * len(prompts)


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_nfe_accounting(model, prompts, method):
    """Guards against counting passes of finished rows or missing the fused prefill pass: NTP pays one
    pass per token; SBD's histogram counts every pass of every sequence once and, without EOS, the
    tokens it reveals are exactly the tokens generated."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=1.0, max_new_tokens=BUDGET)
    result = generate(model, prompts, cfg, eos_id=-1, pad_id=PAD)
    hist = result.accepted_hist
    assert int(hist.sum()) == result.total_nfe
    assert int((hist * torch.arange(len(hist))).sum()) == result.total_generated == BUDGET * len(prompts)
    if method == "ntp":
        assert result.nfe.tolist() == result.generated.tolist()
    else:
        assert result.total_nfe < result.total_generated, "gamma 1.0 never revealed two tokens in a pass"


# ----------------------------------------------------------------------------------------------------
# Exact KV property, compile, arguments
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ops", ["fused", "naive"])
def test_block_logits_equal_full_recompute(model, prompts, ops):
    """Guards against block K/V written to the cache or wrong positions of the appended causal rows: the
    block logits of a first (2K-row) and a later pass equal a full recompute (docs/algorithm.md §3.10)."""
    atol, rtol = tolerance(torch.float32)
    for prompt in prompts:
        err, scale = gen.block_logit_error(model, prompt, list(range(10, 10 + 2 * BLOCK)), BLOCK, ops_for(ops))
        assert err <= atol + rtol * scale, (err, scale)


@pytest.mark.slow
def test_compiled_block_step_matches_eager(model, prompts):
    """Guards against a decode step that graph-breaks or syncs (fullgraph=True fails on either) or that
    computes something else once compiled. Both layouts of the SBD step run (2K rows, then K rows)."""
    torch._dynamo.reset()
    steps = dataclasses.replace(gen.EAGER_STEPS,
                                sbd_block_step=torch.compile(gen.sbd_block_step, fullgraph=True))
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    compiled = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)
    assert_same_decode(compiled, generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD))


@pytest.mark.slow
def test_compiled_ntp_step_and_prefills_match_eager(model, prompts):
    """Guards against the NTP decode step or a prefill that graph-breaks or syncs (fullgraph=True fails on
    either) or that computes something else once compiled: NTP with its prefill and step compiled, and SBD
    with its prefill compiled (its block step: the test above), give the eager decode's answers and counts."""
    torch._dynamo.reset()
    steps = dataclasses.replace(gen.EAGER_STEPS, **{name: torch.compile(getattr(gen, name), fullgraph=True)
                                                    for name in ("ntp_prefill", "ntp_decode_step", "sbd_prefill")})
    for cfg in (DecodeConfig(method="ntp", max_new_tokens=BUDGET),
                DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)):
        compiled = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)
        assert_same_decode(compiled, generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD))


@pytest.mark.parametrize("field,value", [("method", "beam"), ("block_size", 0), ("gamma", -0.1),
                                         ("gamma", math.nan), ("temperature", -1.0), ("temperature", math.nan),
                                         ("temperature", math.inf), ("temperature", 1e39), ("rule", "EB"),
                                         ("rule", "bogus"), ("max_new_tokens", 0)])
def test_bad_config_names_the_field(field, value):
    """Guards against silently decoding with a meaningless setting, NaN and infinities included (a NaN gamma or
    temperature fails only mid-decode, an unknown rule not at all under NTP)."""
    with pytest.raises(ValueError, match=field):
        DecodeConfig(**{field: value})


INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seed_outside_int64_names_the_seed(seed):
    """Guards against a seed that no int64 seed tensor can hold passing the config and failing mid-decode
    with torch's "value cannot be converted to type int64_t without overflow", which names nothing."""
    with pytest.raises(ValueError, match=f"DecodeConfig: seed must be within int64 .*got {seed}"):
        DecodeConfig(seed=seed)


def test_seeds_up_to_the_int64_maximum_decode(model, prompts):
    """Guards against the seeds seed + i of the last prompts overflowing: with seed = 2^63 - 2 and two prompts
    the seeds are 2^63 - 2 and 2^63 - 1, both int64s, but torch.arange(seed, seed + 2) failed on its exclusive
    end 2^63. Sequence i still samples with seed + i (the second prompt decodes as alone with 2^63 - 1)."""
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, temperature=1.0, max_new_tokens=BUDGET,
                       seed=INT64_MAX - 1)
    both = generate(model, prompts[:2], cfg, eos_id=EOS, pad_id=PAD)
    alone = generate(model, prompts[1:2], dataclasses.replace(cfg, seed=INT64_MAX), eos_id=EOS, pad_id=PAD)
    assert both.tokens[1] == alone.tokens[0]
    assert oracle_decode(model, prompts[:2], cfg, eos_id=EOS, pad_id=PAD).tokens == both.tokens


@pytest.mark.parametrize("decode", ["generate", "oracle_decode"])
def test_seed_whose_last_prompt_leaves_int64_names_the_seed(model, prompts, decode):
    """Guards against seed + i leaving int64 for the last prompts (an OverflowError, or a silent wrap to a
    negative seed): the error names the seed, the prompt count and the largest seed that fits."""
    fn = generate if decode == "generate" else oracle_decode
    cfg = DecodeConfig(block_size=BLOCK, max_new_tokens=BUDGET, seed=INT64_MAX - 1)
    with pytest.raises(ValueError, match=re.escape(
            f"{decode}: seed {INT64_MAX - 1}: prompt i samples with seed + i, and with 3 prompts the last seed, "
            f"{INT64_MAX + 1}, does not fit in int64 (use seed <= {INT64_MAX - 2})")):
        fn(model, prompts, cfg, eos_id=EOS, pad_id=PAD)


@pytest.mark.parametrize("field,value", [("max_new_tokens", 4.5), ("block_size", 2.5), ("block_size", True),
                                         ("seed", "1"), ("top_k", 2.0), ("gamma", "0.1"), ("temperature", False),
                                         ("top_p", None)])
def test_config_of_the_wrong_type_names_the_field(field, value):
    """Guards against a float budget decoding silently wrong (max_new_tokens=4.5 revealed 5 positions and
    reported 4), a float block size failing deep inside torch.full, and True passing as a block size of 1."""
    with pytest.raises(TypeError, match=f"DecodeConfig: {field} must be"):
        DecodeConfig(**{field: value})


def test_config_takes_numpy_and_tensor_integers_as_ints():
    """Guards against rejecting the integer types a config is built from in practice (NumPy, one-element
    tensors), and against keeping them: the decode loop and the graph-capture checks compare plain ints."""
    cfg = DecodeConfig(block_size=np.int64(4), max_new_tokens=torch.tensor(8), gamma=np.float32(0.5),
                       top_k=np.int32(3))
    assert (cfg.block_size, cfg.max_new_tokens, cfg.gamma, cfg.top_k) == (4, 8, 0.5, 3)
    assert all(type(getattr(cfg, f)) is int for f in ("block_size", "max_new_tokens", "top_k"))
    assert type(cfg.gamma) is float


@pytest.mark.parametrize("decode", ["generate", "oracle_decode"])
@pytest.mark.parametrize("eos_id,error,words", [
    (None, TypeError, r"eos_id must be a token id or a sequence of token ids, got None"),
    ("2", TypeError, r"eos_id must be a token id or a sequence of token ids, got '2'"),
    ([2, 3.0], TypeError, r"eos_id\[1\] must be an integer, got 3.0"),
    ([], ValueError, r"eos_id must name at least one token id"),
    (10 ** 20, ValueError, r"eos_id 100000000000000000000 does not fit in int64"),
])
def test_bad_eos_id_names_the_argument(model, decode, eos_id, error, words):
    """Guards against a bad eos_id failing as "'NoneType' object is not iterable" or a bare
    OverflowError mid-decode: the error names the argument."""
    fn = generate if decode == "generate" else oracle_decode
    with pytest.raises(error, match=f"{decode}: {words}"):
        fn(model, [[5, 6]], DecodeConfig(block_size=BLOCK, max_new_tokens=4), eos_id=eos_id, pad_id=PAD)


@pytest.mark.parametrize("eos_id", [np.int64(EOS), torch.tensor(EOS), [np.int32(EOS)], torch.tensor([EOS, 40])])
def test_eos_id_of_numpy_or_tensor_type_decodes_as_the_int(model, prompts, eos_id):
    """Guards against rejecting a single NumPy or tensor id as "not iterable" (it was taken for a sequence)."""
    cfg = DecodeConfig(block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    expected = generate(model, prompts, cfg, eos_id=[EOS, 40] if getattr(eos_id, "ndim", 0) else EOS, pad_id=PAD)
    assert_same_decode(generate(model, prompts, cfg, eos_id=eos_id, pad_id=PAD), expected)


def test_empty_prompt_is_rejected(model):
    """Guards against reading logits at row -1 of an empty prompt."""
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [[5, 6], []], DecodeConfig(), eos_id=EOS, pad_id=PAD)


# ----------------------------------------------------------------------------------------------------
# Bundled checkpoint
# ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bundled_checkpoint_cached_matches_oracle():
    """Guards against the exactness property holding on random weights only: on the trained SBD model
    the cached decode with the fused ops gives the oracle's tokens on held-out prompts."""
    from sbd_kernels.demo import SBD_CHECKPOINT
    from sbd_kernels.model import load_checkpoint
    from sbd_kernels.tasks import TOKENIZER, get_task, make_examples

    if not Path(SBD_CHECKPOINT).exists():
        pytest.skip(f"no bundled checkpoint at {SBD_CHECKPOINT}")
    trained, _ = load_checkpoint(SBD_CHECKPOINT)
    # NTP on `add` only: its oracle recomputes the whole sequence for each of the 33 tokens.
    for task, methods in (("add", ("ntp", "sbd")), ("rot13", ("sbd",))):
        prompts = [TOKENIZER.encode_prompt(ex.prompt) for ex in make_examples(task, "held_out", 1)]
        for method in methods:
            cfg = DecodeConfig(method=method, block_size=16, gamma=0.1, max_new_tokens=get_task(task).answer_tokens)
            cached = generate(trained, prompts, cfg, eos_id=TOKENIZER.EOS, pad_id=TOKENIZER.PAD)
            assert_same_decode(cached, oracle_decode(trained, prompts, cfg, eos_id=TOKENIZER.EOS,
                                                     pad_id=TOKENIZER.PAD))


def test_docstring_example_runs():
    """Guards against the `generate` docstring example drifting from what the function returns."""
    result = doctest.testmod(gen, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_any_of_several_eos_ids_ends_the_sequence():
    """Guards against only the first of several EOS ids ending a sequence (HF models list several, e.g.
    Llama 3's end-of-text and end-of-turn), on the SBD step and in the host-side answer cut."""
    sp = gen.DecodeConstants(eos_ids=(1, 7), pad_id=0, mask_id=2, block_size=4, max_new_tokens=16, gamma=0.01,
                             temperature=0.0, rule="eb")
    state = gen.SbdState.empty(1, sp, torch.zeros(1, dtype=torch.int64))
    gen._sbd_accept(state, one_hot_logits([5, 7, 6, 1], 8), gen.naive_ops(), sp)
    assert bool(state.finished[0]) and state.generated.tolist() == [2]
    assert gen._answers(state.answer, state.generated, sp.eos_ids) == [[5]]
    assert sp.is_eos(torch.tensor([0, 1, 7, 3])).tolist() == [False, True, True, False]


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_graph_safe_steps_give_the_eager_tokens(model, prompts, method):
    """Guards against a decode step that rebinds a state or cache buffer (a CUDA graph replay would then read
    stale memory): the graph-replay wrapper's static-buffer checks run on CPU and the tokens equal the eager ones."""
    from sbd_kernels.graphs import graphed_steps

    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    checked = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=graphed_steps(gen.EAGER_STEPS, "check"))
    assert_same_decode(checked, generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD))


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_graphed_steps_serve_every_batch_and_call(model, prompts, method):
    """Guards against graphed steps, bound to the buffers of the first batch they ran, failing on the second batch
    of a call (batch_size=1) and on a second generate call: generate takes a fresh capture for every batch."""
    from sbd_kernels.graphs import graphed_steps

    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    steps = graphed_steps(gen.EAGER_STEPS, "check")
    eager = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD)
    for _ in range(2):
        assert_same_decode(generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, batch_size=1, steps=steps), eager)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without CUDA")
def test_graphed_steps_for_cuda_without_cuda_names_the_mode():
    """Guards against mode 'cuda' on a machine without CUDA failing in torch's private graph-pool class."""
    from sbd_kernels.graphs import graphed_steps

    with pytest.raises(ValueError, match="graphed_steps: mode 'cuda' captures CUDA graphs, and torch sees no CUDA"):
        graphed_steps(gen.EAGER_STEPS, "cuda")


def test_graph_checks_catch_a_step_that_moves_a_buffer(model, prompts):
    """Guards against the static-buffer check passing a step that replaces a state tensor."""
    from sbd_kernels.graphs import graphed_steps

    def rebinding_step(model_, cache, state, ops, sp, causal_slots):
        gen.sbd_block_step(model_, cache, state, ops, sp, causal_slots)
        state.block = state.block.clone()

    steps = graphed_steps(dataclasses.replace(gen.EAGER_STEPS, sbd_block_step=rebinding_step), "check")
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.0, max_new_tokens=BUDGET)
    with pytest.raises(RuntimeError, match="SbdState.block moved"):
        generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)


HOST_SYNC_CASES = {  # name: (a function of a "GPU" tensor x, what `host_syncs` must name)
    "item": (lambda x: x.sum().item(), ["aten._local_scalar_dense.default"]),
    "a Python branch": (lambda x: 1 if x.any() else 0, ["aten._local_scalar_dense.default"]),
    "nonzero": (lambda x: x.nonzero(), ["aten.nonzero.default"]),
    "boolean-mask read": (lambda x: x[x > 2], ["aten.index.Tensor"]),
    "boolean-mask write": (lambda x: x.clone().__setitem__(x > 2, 0.0), ["aten.index_put_.default"]),
    "repeats from a tensor": (lambda x: x.repeat_interleave(x.long()), ["aten.repeat_interleave.Tensor"]),
    "Python data on the device": (lambda x: x + torch.tensor(0.5, device=x.device),
                                  ["torch.tensor(<Python data>, device=...)"]),
    "Python data on the device of a tensor": (lambda x: x + x.new_tensor([0.5] * 6),
                                              ["Tensor.new_tensor(<Python data>) of a tensor on the device"]),
    "a CPU tensor moved to the device": (lambda x: x + torch.arange(6.0).to(x.device),
                                         ["Tensor.to(<a device>) of a CPU tensor"]),
    "tolist": (lambda x: x.tolist(), ["Tensor.tolist() of a tensor on the device"]),
    "a copy to the CPU": (lambda x: (x.cpu(), x.to("cpu"), x.to(device="cpu:0")),
                          ["Tensor.cpu() of a tensor on the device", "Tensor.to() of a tensor on the device"]),
    "a CPU tensor's own read-back": (lambda x: x * len(torch.arange(3).tolist()), []),
    "device factories and in-place writes": (lambda x: torch.zeros(6, device=x.device).index_copy_(
        0, torch.arange(6, device=x.device), x).masked_fill_(x > 2, 1.0), []),
    "repeats with output_size": (lambda x: x.repeat_interleave(x.long(), output_size=15), []),
    "host tensors' own values": (lambda x: x * torch.distributions.Normal(0, 1).icdf(torch.tensor(0.9)), []),
    "a 0-dim CPU tensor as a scalar": (lambda x: x * torch.tensor(0.5), []),
    "Python data beside a CPU tensor": (lambda x: x * torch.tensor(0.5).new_tensor(2.0).item(), []),
}


@pytest.mark.parametrize("case", HOST_SYNC_CASES)
def test_host_syncs_names_what_a_capture_refuses(case):
    """Guards against the host-sync scan of graphed_steps(mode="check") missing what a CUDA graph capture refuses on
    a tensor of the step (a host read, an output sized by values, host data copied to the device), or naming what
    stays on the device or on the host alone (CPU tensors built without a device, as torch.distributions' checks)."""
    from sbd_kernels.graphs import host_syncs

    fn, expected = HOST_SYNC_CASES[case]
    assert host_syncs(fn, torch.arange(6.0))[1] == expected


def test_graph_checks_catch_a_step_that_syncs(model, prompts):
    """Guards against mode "check" passing a step that a capture would refuse: its second call (the first a capture
    takes; the first runs eagerly on a GPU too) raises naming the step and the operation."""
    from sbd_kernels.graphs import graphed_steps

    def syncing_step(model_, cache, state, ops, sp, causal_slots):
        gen.sbd_block_step(model_, cache, state, ops, sp, causal_slots)
        if state.finished.all():
            pass

    steps = graphed_steps(dataclasses.replace(gen.EAGER_STEPS, sbd_block_step=syncing_step), "check")
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.0, max_new_tokens=BUDGET)
    # generate runs under inference mode, where bool() of a tensor dispatches aten.is_nonzero (else aten._local_scalar_dense)
    with pytest.raises(RuntimeError, match=re.escape("syncing_step: the step ran aten.is_nonzero.default, which a "
                                                     "CUDA graph capture refuses")):
        generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)


def test_a_step_that_cannot_be_captured_names_the_step_and_the_cause(model, prompts, monkeypatch):
    """Guards against a model whose forward syncs with the host (an MoE layer looping over the experts hit) failing
    the capture with CUDA's bare "operation not permitted when stream is capturing": the error names the step, the
    likely cause and the way out, and chains CUDA's. The capture is faked (no GPU here): torch.cuda.graph raises
    inside the step's second call, where a real capture would."""
    import contextlib

    from sbd_kernels import graphs

    cuda_error = RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")

    @contextlib.contextmanager
    def failing_capture(graph, pool=None):
        yield
        raise cuda_error

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    step = graphs._GraphedStep(gen.sbd_block_step, "cuda", pool=None)
    steps = dataclasses.replace(gen.EAGER_STEPS, sbd_block_step=step)
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.0, max_new_tokens=BUDGET)
    with pytest.raises(RuntimeError, match=re.escape(
            "sbd_block_step: capturing the decode step in a CUDA graph failed (CUDA error: operation not permitted "
            "when stream is capturing). A graph cannot hold a host synchronisation")) as info:
        generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)
    assert info.value.__cause__ is cuda_error and "Decode with cuda_graph=False" in str(info.value)


def test_cuda_graph_refuses_the_oracle_ops(model, prompts):
    """Guards against a capture failing deep inside CUDA on the oracles' host reads (item, nonzero)."""
    with pytest.raises(ValueError, match=r"cuda_graph=True captures the decode steps, and the oracle ops \(attention, "
                                         r"entropy_sample, mask_scatter_, naive_ops\) read values on the host"):
        generate(model, prompts, DecodeConfig(max_new_tokens=4), eos_id=EOS, pad_id=PAD, ops=gen.naive_ops(),
                 cuda_graph=True)


def test_cuda_graph_needs_a_cuda_model(prompts):
    """Guards against cuda_graph=True silently decoding eagerly on a CPU model."""
    cpu_model = Transformer(ModelConfig.preset("tiny")).eval()
    with pytest.raises(ValueError, match="CUDA device"):
        generate(cpu_model, prompts, DecodeConfig(max_new_tokens=4), eos_id=EOS, pad_id=PAD, cuda_graph=True)


def test_rehearsing_cuda_graphs_names_a_wrong_mode(monkeypatch):
    """Guards against a misspelt mode ("CPU", "checks") leaving a CUDA-graph test unrehearsed: it is refused by name,
    and nothing is patched."""
    with pytest.raises(ValueError, match=re.escape("rehearse_cuda_graphs: mode must be one of ('cuda', 'check'), "
                                                   "got 'checks'")):
        rehearse_cuda_graphs(monkeypatch, "checks")
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        gen._graph_mode(torch.device("cpu"))


@pytest.mark.parametrize("graphs", cuda_graph_mode_params(DEVICE))
@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_cuda_graph_decode_gives_the_eager_tokens(model, prompts, method, graphs, monkeypatch):
    """Guards against a decode step whose CUDA-graph replay differs from its eager run (a buffer read at
    capture time, a host value baked into the graph, a kernel skipped on replay): same answers, NFE and
    acceptance counts, at temperature 0 and with sampling. Rehearsed on any device (graphs "check")."""
    rehearse_cuda_graphs(monkeypatch, graphs)
    for temperature in (0.0, 1.0):
        cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, temperature=temperature,
                           max_new_tokens=BUDGET)
        replayed = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, cuda_graph=True)
        assert_same_decode(replayed, generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD))


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_sampling_filters_reach_the_sampler(model, prompts, oracle, method):
    """Guards against DecodeConfig's top_k / top_p / min_p not reaching entropy_sample: top-1 sampling at a high
    temperature equals greedy decoding, and the cached decode with filters equals the oracle decode with them."""
    greedy = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    top1 = dataclasses.replace(greedy, temperature=3.0, top_k=1)
    assert_same_decode(generate(model, prompts, top1, eos_id=EOS, pad_id=PAD), oracle(greedy, EOS))
    filtered = dataclasses.replace(greedy, temperature=1.0, top_k=5, top_p=0.8, min_p=0.05, seed=7)
    assert_same_decode(generate(model, prompts, filtered, eos_id=EOS, pad_id=PAD),
                       oracle_decode(model, prompts, filtered, eos_id=EOS, pad_id=PAD))


def test_extreme_legal_settings_are_accepted():
    """Guards against the NaN-proof checks rejecting legal extremes: gamma +inf (a whole block per pass) and the
    largest float32 temperature, also as 3.4028235e38 (a double above it that rounds to it), and filter values
    that round into range as float32s."""
    DecodeConfig(gamma=math.inf, temperature=3.4028234663852886e38)
    DecodeConfig(temperature=3.4028235e38, top_p=1 + 2.0**-24, min_p=-(2.0**-150))


@pytest.mark.parametrize("field,value", [("top_k", -1), ("top_k", 2**63), ("top_p", 0.0), ("top_p", 1.5),
                                         ("min_p", 1.0), ("top_p", 1e-50), ("min_p", 1 - 1e-12)])
def test_bad_filter_settings_name_the_field(field, value):
    """Guards against a filter value the sampler would reject mid-decode (or silently misread), including a
    top_k beyond the op's int64 (torch's "Expected a value of type 'int'", naming nothing) and doubles out of
    range only as float32s, which the sampler checks them as (top_p 1e-50 is 0, min_p
    1 - 1e-12 is 1)."""
    with pytest.raises(ValueError, match=field):
        DecodeConfig(**{field: value})


# ----------------------------------------------------------------------------------------------------
# Invalid logits and the pass limit
# ----------------------------------------------------------------------------------------------------
FED_BEFORE = BLOCK * (math.ceil(BUDGET / BLOCK) - 1)   # answer tokens before it are input of a later pass


def poison_token(clean: gen.DecodeResult, prompts: list[list[int]]) -> int:
    """A token of no prompt and of no answer's first block that some clean answer (no EOS) holds before index
    FED_BEFORE: a later pass of that sequence reads it (NTP: the next one; SBD: its block's successor)."""
    early = {t for p in prompts for t in p} | {t for tokens in clean.tokens for t in tokens[:BLOCK]}
    for tokens in clean.tokens:
        for token in tokens[BLOCK:FED_BEFORE]:
            if token not in early:
                return token
    raise AssertionError("no token to poison")


def poisoned(model: Transformer, token: int) -> Transformer:
    """A copy of the model with a NaN embedding for `token`: every position at or after that token, in the
    cache or in the block, gets NaN logits (invalid, docs/algorithm.md §3.6)."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.tok_embeddings.weight[token] = math.nan
    return copied


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_invalid_logits_stop_a_row_with_its_completed_tokens(model, prompts, method):
    """Guards against NTP emitting the sampler's placeholder token for positions with NaN logits, against SBD
    dropping every token of a row stopped by NaN logits (generated stayed 0), against an oracle decode that
    never ends on them, and against the flag not reaching DecodeResult: cached and oracle decodes agree, the rows
    that read the poisoned token keep exactly the clean tokens they had completed, and are flagged."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    clean = generate(model, prompts, cfg, eos_id=-1, pad_id=PAD)
    token = poison_token(clean, prompts)
    bad_model = poisoned(model, token)
    cached = generate(bad_model, prompts, cfg, eos_id=-1, pad_id=PAD)
    oracle = oracle_decode(bad_model, prompts, cfg, eos_id=-1, pad_id=PAD, observer=pass_limited_observer(BUDGET))
    assert_same_decode(cached, oracle)
    fed = [token in tokens[:FED_BEFORE] for tokens in clean.tokens]
    assert cached.stopped_early.tolist() == fed and cached.num_stopped_early == sum(fed)
    for i, tokens in enumerate(cached.tokens):
        if not fed[i]:
            assert tokens == clean.tokens[i]
            continue
        assert tokens == clean.tokens[i][: len(tokens)]
        assert len(tokens) >= (clean.tokens[i].index(token) + 1 if method == "ntp" else BLOCK)
        assert int(cached.generated[i]) == len(tokens)
    if method == "ntp":     # the pass that found NaN logits counts, and reveals nothing
        assert cached.nfe.tolist() == [len(t) + f for t, f in zip(cached.tokens, fed)]
        assert cached.accepted_hist.tolist() == [sum(fed), cached.total_generated]


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_logits_invalid_from_the_first_pass(model, method):
    """Guards against a sequence whose every logit is NaN hanging the oracle decode (and so exact_kv_check /
    hf.check) or emitting placeholder tokens: it stops after its first pass with no token, flagged."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    bad_model, prompt = poisoned(model, 6), [[5, 6, 7]]
    cached = generate(bad_model, prompt, cfg, eos_id=EOS, pad_id=PAD)
    oracle = oracle_decode(bad_model, prompt, cfg, eos_id=EOS, pad_id=PAD, observer=pass_limited_observer(BUDGET))
    assert_same_decode(cached, oracle)
    assert cached.tokens == [[]] and cached.nfe.tolist() == [1] and cached.stopped_early.tolist() == [True]


def test_stopped_rows_survive_batching(model, prompts):
    """Guards against the stopped-early flags being lost or misaligned when batches are concatenated."""
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    bad_model = poisoned(model, poison_token(generate(model, prompts, cfg, eos_id=-1, pad_id=PAD), prompts))
    together = generate(bad_model, prompts, cfg, eos_id=-1, pad_id=PAD)
    assert together.stopped_early.any() and not together.stopped_early.all()
    assert_same_decode(together, generate(bad_model, prompts, cfg, eos_id=-1, pad_id=PAD, batch_size=1))


def test_pass_limit_ends_both_decodes_alike(model, prompts):
    """Guards against an oracle decode without a pass limit: with a scatter op that counts tokens but never
    reveals one, the cached loop ends at its limit of W passes; the oracle must too (instead of looping
    forever), and both flag every row with the tokens it had completed (none)."""
    naive = gen.naive_ops()

    def stalling_scatter(block, is_masked, *args, **kwargs):
        return naive.mask_scatter_(block.clone(), is_masked.clone(), *args, **kwargs)

    ops = dataclasses.replace(naive, mask_scatter_=stalling_scatter)
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    limit = gen.sbd_max_passes(gen.DecodeConstants.of(model.mask_token_id, cfg, EOS, PAD))
    cached = generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, ops=ops)
    oracle = oracle_decode(model, prompts, cfg, eos_id=EOS, pad_id=PAD, ops=ops, observer=pass_limited_observer(limit))
    assert_same_decode(cached, oracle)
    assert cached.nfe.tolist() == [limit] * len(prompts)
    assert cached.stopped_early.all() and cached.tokens == [[]] * len(prompts)


def test_measurements_refuse_a_decode_with_stopped_rows(model, prompts):
    """Guards against the demo's tables being built from a decode whose rows stopped on NaN logits (accuracy,
    NFE and speed of cut-short rows): `require_complete` names the rows, the demo's timed decode raises."""
    from sbd_kernels.demo import timed_decode

    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.5, max_new_tokens=BUDGET)
    bad_model = poisoned(model, poison_token(generate(model, prompts, cfg, eos_id=-1, pad_id=PAD), prompts))
    result = generate(bad_model, prompts, cfg, eos_id=-1, pad_id=PAD)
    rows = result.stopped_early.nonzero().flatten().tolist()
    with pytest.raises(RuntimeError, match=rf"sbd run: {len(rows)} of {len(prompts)} sequences stopped early on "
                                           rf"invalid \(NaN / \+inf\) logits \(rows {re.escape(str(rows))}\)"):
        result.require_complete("sbd run")
    generate(model, prompts, cfg, eos_id=-1, pad_id=PAD).require_complete("clean run")
    with pytest.raises(RuntimeError, match=r"sbd decode \(gamma 0.5\): .* stopped early"):
        timed_decode(bad_model, prompts, "sbd", 0.5, BUDGET, len(prompts), gen.fused_ops(), max_runs=1, eos_id=-1,
                     pad_id=PAD)


def test_result_without_flags_has_none_stopped():
    """Guards against DecodeResult constructors written before the stopped-early flag breaking or leaving
    it None."""
    result = gen.DecodeResult([[5], [6, 7]], torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([0, 3]))
    assert result.stopped_early.tolist() == [False, False] and result.num_stopped_early == 0


# ----------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decode", ["generate", "oracle_decode"])
@pytest.mark.parametrize("bad_prompts,pad_id,words", [
    ([[5, 48]], PAD, r"prompts\[0\] holds token id 48, outside the model's vocabulary \[0, 48\)"),
    ([[5, 6], [7, -3]], PAD, r"prompts\[1\] holds token id -3, outside the model's vocabulary \[0, 48\)"),
    ([[5, 6], [7]], -1, r"pad_id -1 is outside the model's vocabulary \[0, 48\)"),
    ([[5, 6]], 48, r"pad_id 48 is outside the model's vocabulary \[0, 48\)"),
])
def test_token_ids_outside_the_vocabulary_are_rejected(model, decode, bad_prompts, pad_id, words):
    """Guards against a bare IndexError (a device-side assert on CUDA) from the embedding lookup, or a pad_id
    of -1 that fails only when prompts differ in length: the error names the argument, the id and the vocabulary."""
    fn = generate if decode == "generate" else oracle_decode
    with pytest.raises(ValueError, match=f"{decode}: {words}"):
        fn(model, bad_prompts, DecodeConfig(block_size=BLOCK, max_new_tokens=4), eos_id=EOS, pad_id=pad_id)


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_no_prompts_give_an_empty_result(model, method):
    """Guards against `generate(model, [])` failing inside range() and agreeing with oracle_decode's result."""
    cfg = DecodeConfig(method=method, block_size=BLOCK, max_new_tokens=4)
    result = generate(model, [], cfg, eos_id=EOS, pad_id=PAD)
    assert_same_decode(result, oracle_decode(model, [], cfg, eos_id=EOS, pad_id=PAD))
    assert result.answers == [] and result.total_nfe == 0
    assert len(result.accepted_hist) == (BLOCK if method == "sbd" else 1) + 1


@pytest.mark.parametrize("batch_size", [0, -1])
def test_batch_size_must_be_positive(model, prompts, batch_size):
    """Guards against batch_size -1 failing in torch.cat and 0 silently meaning one batch."""
    with pytest.raises(ValueError, match=f"batch_size must be >= 1.*got {batch_size}"):
        generate(model, prompts, DecodeConfig(max_new_tokens=4), eos_id=EOS, pad_id=PAD, batch_size=batch_size)


@pytest.mark.parametrize("batch_size, words", [(2.5, "batch_size must be an integer, got 2.5"),
                                               ("2", "batch_size must be an integer, got '2'"),
                                               (True, "batch_size must be an integer, got True")])
def test_batch_size_of_the_wrong_type_names_it(model, prompts, batch_size, words):
    """Guards against batch_size True decoding one prompt per batch, and 2.5 / "2" failing inside range()."""
    with pytest.raises(TypeError, match=re.escape(f"generate: {words}")):
        generate(model, prompts, DecodeConfig(max_new_tokens=4), eos_id=EOS, pad_id=PAD, batch_size=batch_size)


@pytest.mark.parametrize("decode", ["generate", "oracle_decode"])
@pytest.mark.parametrize("bad_prompt, words", [([5.9, 6], "prompts[1][0] must be an integer, got 5.9"),
                                               ([7, True], "prompts[1][1] must be an integer, got True"),
                                               (np.array([5.0, 6.0]), "prompts[1][0] must be an integer"),
                                               (torch.tensor([True, False]), "prompts[1][0] must be an integer")])
def test_prompt_ids_that_are_not_integers_are_rejected(model, decode, bad_prompt, words):
    """Guards against a float id 5.9 decoding as token 5 and a bool as token 0 / 1, with no error."""
    fn = generate if decode == "generate" else oracle_decode
    with pytest.raises(TypeError, match=re.escape(f"{decode}: {words}")):
        fn(model, [[5, 6], bad_prompt], DecodeConfig(max_new_tokens=4), eos_id=EOS, pad_id=PAD)


@pytest.mark.parametrize("prompt", [np.array([5, 6, 7]), torch.tensor([5, 6, 7])])
def test_prompts_as_integer_arrays_decode_as_lists(model, prompt):
    cfg = DecodeConfig(block_size=BLOCK, max_new_tokens=4)
    assert_same_decode(generate(model, [prompt], cfg, eos_id=EOS, pad_id=PAD),
                       generate(model, [[5, 6, 7]], cfg, eos_id=EOS, pad_id=PAD))


class CappedCacheModel(Transformer):
    """A model whose new_cache gives at most `slots` slots per row (say, capped at its context length)."""

    slots = 6
    cache_type = KVCache

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.config
        return self.cache_type(cfg.n_layers, batch, min(max_len, self.slots), cfg.n_kv_heads, cfg.head_dim,
                               device=next(self.parameters()).device)


class UnstatedCache(KVCache):
    """A cache that does not state its slots per row."""

    max_len = None


def capped_copy(model: Transformer, cache_type: type) -> CappedCacheModel:
    capped = CappedCacheModel(model.config).eval().to(DEVICE)
    capped.load_state_dict(model.state_dict())
    capped.cache_type = cache_type
    return capped


@pytest.mark.parametrize("method", ["ntp", "sbd"])
@pytest.mark.parametrize("ops", ["fused", "triton"])
def test_a_cache_with_fewer_slots_than_asked_is_refused(model, method, ops):
    """Guards against a model's new_cache returning fewer slots than the decode asked for: the decode skips the
    ops' value checks (trusted_values), and the GPU kernels clamp the overflowing appends, so the tokens were
    wrong with no error. The capacity is now checked once, on the host, for every backend."""
    capped = capped_copy(model, KVCache)
    decode_ops = triton_ops() if ops == "triton" else gen.fused_ops()
    cfg = DecodeConfig(method=method, block_size=BLOCK, max_new_tokens=8)
    asked = 5 + 8  # the prompt and the answer budget
    with pytest.raises(ValueError, match=re.escape(
            f"generate: CappedCacheModel.new_cache(1, {asked}) returned a cache of 6 slots per row; the decode "
            f"writes up to {asked}")):
        generate(capped, [[5, 6, 7, 8, 9]], cfg, eos_id=-1, pad_id=PAD, ops=decode_ops)


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_a_cache_that_does_not_state_its_slots_keeps_the_op_checks(model, method):
    """A cache without max_len is decoded with the ops' value checks on: its overflow is the op's error."""
    capped = capped_copy(model, UnstatedCache)
    cfg = DecodeConfig(method=method, block_size=BLOCK, max_new_tokens=8)
    with pytest.raises(RuntimeError, match="cache"):
        generate(capped, [[5, 6, 7, 8, 9]], cfg, eos_id=-1, pad_id=PAD, ops=triton_ops())
    ample = capped_copy(model, UnstatedCache)
    ample.slots = 64
    assert_same_decode(generate(ample, [[5, 6, 7, 8, 9]], cfg, eos_id=-1, pad_id=PAD),
                       generate(model, [[5, 6, 7, 8, 9]], cfg, eos_id=-1, pad_id=PAD))


def triton_ops() -> gen.DecodeOps:
    """The GPU path's launchers (on CPU tensors under TRITON_INTERPRET=1)."""
    from sbd_kernels.ops.attention import triton as attention
    from sbd_kernels.ops.sampling import triton as sampling
    from sbd_kernels.ops.scatter import triton as scatter

    return gen.DecodeOps(attention.block_attention_with_kvcache, sampling.entropy_sample, scatter.mask_scatter_)


# ----------------------------------------------------------------------------------------------------
# Graph-replay invariants
# ----------------------------------------------------------------------------------------------------
def started_sbd_decode(model, prompts, cfg):
    """(cache, state, sp) of an SBD decode after its prefill, for calling a step by hand."""
    sp = gen.DecodeConstants.of(model.mask_token_id, cfg, EOS, PAD)
    prompt, lens = gen.pad_prompts(prompts, PAD, DEVICE)
    state = gen.SbdState.empty(len(prompts), sp, torch.arange(len(prompts), device=DEVICE))
    cache = model.new_cache(len(prompts), prompt.shape[1] + state.answer.shape[1])
    with torch.inference_mode():
        gen.sbd_prefill(model, cache, state, prompt, lens, gen.fused_ops(), sp)
    return cache, state, sp


@pytest.mark.parametrize("change,words", [("gamma", "DecodeConstants.gamma 0.0 -> 100.0"),
                                          ("rule", "DecodeConstants.rule 'eb' -> 'threshold'"),
                                          ("temperature", "DecodeConstants.temperature 0.0 -> 1.0"),
                                          ("ops", "DecodeOps.attention")])
def test_graph_checks_catch_other_decode_settings(model, prompts, change, words):
    """Guards against a graphed step accepting other decode constants or kernels than at its capture: a CUDA
    graph bakes them in and would replay the old ones (gamma 0 revealing one token per pass, say)."""
    from sbd_kernels.graphs import graphed_steps

    cfg = DecodeConfig(block_size=BLOCK, gamma=0.0, max_new_tokens=2 * BUDGET)
    cache, state, sp = started_sbd_decode(model, prompts, cfg)
    steps = graphed_steps(gen.EAGER_STEPS, "check")
    other_sp = dataclasses.replace(sp, **{"gamma": {"gamma": 100.0}, "rule": {"rule": "threshold"},
                                          "temperature": {"temperature": 1.0}, "ops": {}}[change])
    other_ops = gen.naive_ops() if change == "ops" else gen.fused_ops()
    with torch.inference_mode():
        steps.sbd_block_step(model, cache, state, gen.fused_ops(), sp, 0)
        steps.sbd_block_step(model, cache, state, gen.fused_ops(), sp, 0)     # equal, not identical: accepted
        with pytest.raises(RuntimeError, match=f"sbd_block_step: called with other arguments than at capture "
                                               f"\\(.*{words}"):
            steps.sbd_block_step(model, cache, state, other_ops, other_sp, 0)


def test_graph_checks_catch_moved_model_weights(model, prompts):
    """Guards against a graphed step replaying after a model weight moved to new memory (the graph would read
    the old memory)."""
    from sbd_kernels.graphs import graphed_steps

    moved = copy.deepcopy(model)
    cfg = DecodeConfig(block_size=BLOCK, gamma=0.0, max_new_tokens=2 * BUDGET)
    cache, state, sp = started_sbd_decode(moved, prompts, cfg)
    steps = graphed_steps(gen.EAGER_STEPS, "check")
    with torch.inference_mode():
        steps.sbd_block_step(moved, cache, state, gen.fused_ops(), sp, 0)
        moved.output.weight.data = moved.output.weight.data.clone()
        with pytest.raises(RuntimeError, match="sbd_block_step: model tensors output.weight moved"):
            steps.sbd_block_step(moved, cache, state, gen.fused_ops(), sp, 0)


def test_graph_check_errors_name_a_partial_step(model, prompts):
    """Guards against a step given as functools.partial (no __name__) turning the static-buffer error into an
    AttributeError."""
    from sbd_kernels.graphs import graphed_steps

    def rebinding_step(model_, cache, state, ops, sp, causal_slots, extra=None):
        gen.sbd_block_step(model_, cache, state, ops, sp, causal_slots)
        state.block = state.block.clone()

    steps = graphed_steps(dataclasses.replace(gen.EAGER_STEPS,
                                              sbd_block_step=functools.partial(rebinding_step, extra=1)), "check")
    cfg = DecodeConfig(method="sbd", block_size=BLOCK, gamma=0.0, max_new_tokens=BUDGET)
    with pytest.raises(RuntimeError, match="rebinding_step: SbdState.block moved"):
        generate(model, prompts, cfg, eos_id=EOS, pad_id=PAD, steps=steps)

"""The Hugging Face path (`sbd_kernels.hf`) on tiny random-init models of every supported family (no downloads):
enable, fine-tuning inputs and loss, decoding through the `torch.ops.sbd` kernels, and each trap that used to give
a silently wrong result. The decoding tests run the model on CUDA (the Triton kernels) with SBD_TEST_DEVICE=cuda,
on the CPU otherwise; training stays on the CPU."""
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sbd_kernels import hf
from sbd_kernels.generate import DecodeConfig, generate, naive_ops, oracle_decode
from sbd_kernels.model import ModelConfig, Transformer
from sbd_kernels.testing import triton_test_device
from sbd_kernels.train import sbd_loss

DEVICE = triton_test_device()
VOCAB = 96
MASK_ID = 95
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(family: str, attn: str = "sdpa", **overrides):
    """A 2-layer GQA config of `family` (head dim 8, 4 query heads, 2 KV heads), no sliding window."""
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "attn_implementation": attn, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    if family == "mistral":
        common["sliding_window"] = None
    if family in ("qwen2", "qwen3"):
        common["use_sliding_window"] = False
    if family == "qwen3":
        common["head_dim"] = 8
    common.update(overrides)
    return transformers.AutoConfig.for_model(family, **common)


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """A random model whose matrices are drawn at std 1 (HF initialises at 0.02): its predictions are sharp and
    varied, so entropies are well apart and the EB rule's ranking does not hinge on float rounding."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, attn, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0)
    return model


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def sbd_model(family):
    return hf.enable_sbd(tiny_model(family).to(DEVICE), mask_token_id=MASK_ID, block_size=4)


def word_tokenizer(extra: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer of 60 words plus `extra` special tokens (ids after the words)."""
    vocab = {f"w{i}": i for i in range(60)}
    for token in extra:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=extra)


# ----------------------------------------------------------------------------------------------------
# enable_sbd
# ----------------------------------------------------------------------------------------------------
def test_enable_records_settings_that_survive_save_and_load(tmp_path):
    """Guards against the mask id / block size being lost on save_pretrained (a reloaded model would decode with
    another mask token) and against HF's own generate emitting the mask token."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=8)
    assert MASK_ID in model.generation_config.suppress_tokens
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert (loaded.config.sbd_mask_token_id, loaded.config.sbd_block_size) == (MASK_ID, 8)
    again = hf.enable_sbd(loaded)
    assert (again.mask_token_id, again.block_size) == (MASK_ID, 8)


def test_mask_token_is_a_reserved_special_token_when_the_tokenizer_has_one():
    """Guards against adding a token (and resizing embeddings) when Llama-3-style reserved tokens are free."""
    tokenizer = word_tokenizer(["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"])
    model = tiny_model("llama")
    sbd_model = hf.enable_sbd(model, tokenizer)
    assert sbd_model.mask_token_id == tokenizer.convert_tokens_to_ids("<|reserved_special_token_1|>")
    assert model.get_input_embeddings().weight.shape[0] == VOCAB


def test_mask_token_is_added_and_embeddings_grow_only_when_needed():
    """Guards against a mask id outside the embedding table (index error at decode) or a needless resize."""
    tokenizer = word_tokenizer([])
    model = tiny_model("llama")
    sbd_model = hf.enable_sbd(model, tokenizer)
    assert tokenizer.convert_ids_to_tokens(sbd_model.mask_token_id) == "<|sbd_mask|>"
    assert model.get_input_embeddings().weight.shape[0] == VOCAB                 # id 60 < 96: room already
    full = word_tokenizer([f"<s{i}>" for i in range(VOCAB - 60)])
    model = tiny_model("llama")
    sbd_model = hf.enable_sbd(model, full)
    assert sbd_model.mask_token_id == VOCAB
    assert model.get_input_embeddings().weight.shape[0] == VOCAB + 1


@pytest.mark.parametrize("family,overrides,reason", [
    ("mistral", {"sliding_window": 16}, "sliding-window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
])
def test_enable_refuses_what_sbd_cannot_decode_exactly(family, overrides, reason):
    """Guards against SBD silently running on layers whose attention or positions differ between a cached pass
    and a recompute."""
    with pytest.raises(hf.SbdUnsupportedModelError, match=reason):
        hf.enable_sbd(tiny_model(family, **overrides), mask_token_id=MASK_ID)


def test_enable_refuses_other_families_and_attention_implementations():
    """Guards against enabling an untested family, or an attention implementation that cannot take the SBD mask."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(hf.SbdUnsupportedModelError, match="supported families: llama"):
        hf.enable_sbd(gpt2, mask_token_id=MASK_ID)
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(hf.SbdUnsupportedModelError, match="flash_attention_2"):
        hf.enable_sbd(model, mask_token_id=MASK_ID)


# ----------------------------------------------------------------------------------------------------
# Decoding through the ops
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,attn", [(f, "sdpa") for f in FAMILIES] + [("llama", "eager")])
def test_ntp_decode_equals_hf_greedy_generate_with_left_padding(family, attn):
    """Guards against position ids, padding or the cache differing from HF's own greedy decode (HF decodes through
    "sbd" too, which runs the base implementation with the base's masks)."""
    model = tiny_model(family, attn=attn).to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 0, 13]], device=DEVICE)
    attention_mask = (input_ids != 0).long()
    expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    ours = hf.generate(model, input_ids, attention_mask, max_new_tokens=10, method="ntp")
    assert ours.sequences.tolist() == expected.tolist()
    via_hf = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False,
                            custom_generate=hf.sbd_generate, method="ntp")
    assert via_hf.tolist() == expected.tolist()


def test_cached_sbd_decode_equals_the_full_recompute_oracle(sbd_model):
    """Guards against the SBD cache protocol (first pass appends the previous block, later passes write nothing,
    block rows at L + c + j) disagreeing with a recompute, for every supported family."""
    report = hf.check(sbd_model, [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]], max_new_tokens=10)
    assert report.passed, report.summary("tiny")
    assert report.max_logit_error < 1e-4


def test_sbd_generate_output_carries_statistics_and_respects_eos():
    """Guards against custom_generate returning HF's plain tensor without NFE, or decoding past an EOS."""
    model = tiny_model("llama").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE)
    free = hf.generate(model, input_ids, max_new_tokens=8, eos_token_id=[], gamma=0.5)
    eos = int(free.sequences[0, 4])                        # the second new token of row 0 becomes an EOS
    out = model.generate(input_ids, max_new_tokens=8, custom_generate=hf.sbd_generate, return_dict_in_generate=True,
                         eos_token_id=[eos, 1000], pad_token_id=0, gamma=0.5)
    assert isinstance(out, hf.SbdGenerateOutput)
    first = out.sequences[0, 3:].tolist()
    assert eos in first[:2] and out.generated[0] == first.index(eos) + 1
    assert all(t == 0 for t in first[first.index(eos) + 1:])
    assert out.nfe.shape == (2,) and int(out.accepted_hist.sum()) == int(out.nfe.sum())


def test_lm_head_reads_only_the_block_rows_gathered_contiguously():
    """Guards against the LM head reading a strided slice of the pass's hidden states (HF's int
    logits_to_keep): with weights made under torch.inference_mode, its matmul then copied the whole weight
    once per sequence (a batch-16 SBD decode ran 3.5x slower), and against it computing logits of rows
    the decode never reads."""
    with torch.inference_mode():
        model = tiny_model("llama").to(DEVICE)
        hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
        seen = []
        hook = model.lm_head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
        try:
            hf.generate(model, torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE), max_new_tokens=9,
                        eos_token_id=[], gamma=0.5)
        finally:
            hook.remove()
    assert seen and all(x.is_contiguous() for x in seen)
    assert {x.shape[1] for x in seen[1:]} == {4}           # every pass after the prefill: the k block rows


def test_cached_sbd_decode_with_the_naive_ops_through_hf(sbd_model):
    """Guards against the HF attention path depending on the fused kernel (the oracle kernels plug in too)."""
    cfg = DecodeConfig(method="sbd", block_size=4, gamma=0.5, max_new_tokens=8)
    prompts = [[3, 4, 5], [6, 7]]
    cached = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, ops=naive_ops())
    assert cached.tokens == oracle_decode(sbd_model, prompts, cfg, eos_id=1, pad_id=0).tokens


# ----------------------------------------------------------------------------------------------------
# Traps that used to be silent
# ----------------------------------------------------------------------------------------------------
def test_sbd_cache_refuses_a_plain_forward_and_missing_position_ids(sbd_model):
    """Guards against an SbdCache passed to HF's own forward: without position ids HF would derive them from one
    cache length, and its attention would see no cached keys (block-logit error 8.8 instead of 1e-5)."""
    cache = sbd_model.new_cache(1, 16)
    model = sbd_model.hf_model
    with pytest.raises(hf.SbdCacheError, match="position_ids"):
        model(input_ids=torch.tensor([[3, 4]], device=DEVICE), past_key_values=cache, use_cache=True)
    with pytest.raises(hf.SbdCacheError, match="cannot be passed to a plain HF forward"):
        model(input_ids=torch.tensor([[3, 4]], device=DEVICE), position_ids=torch.tensor([[0, 1]], device=DEVICE),
              past_key_values=cache, use_cache=True)


def test_boolean_mask_under_eager_attention_is_refused():
    """Guards against the boolean SBD mask being added to eager attention scores (max logit error 0.49)."""
    model = tiny_model("llama", attn="eager")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match="adds attention_mask to the scores"):
        model(input_ids=torch.tensor([[3, 4, 5, 6]]), attention_mask=allowed)


def test_custom_generate_refuses_settings_it_would_ignore():
    """Guards against repetition penalties, stop strings or top-k silently not being applied."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="beam"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, num_beams=2)


# ----------------------------------------------------------------------------------------------------
# Training: masks, collator, loss
# ----------------------------------------------------------------------------------------------------
def port_reference_weights(ref: Transformer) -> transformers.LlamaForCausalLM:
    """An HF Llama with the reference model's weights (same architecture: RMSNorm, rotate-half RoPE, SwiGLU, GQA)."""
    cfg = ref.config
    config = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
                                      intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                                      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                                      max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                                      rms_norm_eps=cfg.norm_eps, attn_implementation="sdpa", pad_token_id=0,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    names = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
    layer_names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                   "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                   "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                   "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                   "ffn_norm": "post_attention_layernorm"}
    state = {}
    for key, value in ref.state_dict().items():
        head, _, rest = key.partition(".")
        if head == "layers":
            index, _, inner = rest.partition(".")
            module, _, param = inner.rpartition(".")
            state[f"model.layers.{index}.{layer_names[module]}.{param}"] = value
        else:
            state[f"{names[head]}.{rest}"] = value
    model.load_state_dict(state, strict=True)
    return model


def test_hf_sbd_loss_equals_the_reference_objective():
    """Guards against the HF collator / loss building another objective than `sbd_kernels.train.sbd_loss` (one
    objective: same noise, labels, mask and weighting give the same loss on ported weights)."""
    torch.manual_seed(0)
    ref = Transformer(ModelConfig.preset("tiny")).eval()
    model = port_reference_weights(ref)
    sbd_model = hf.enable_sbd(model, mask_token_id=ref.config.mask_token_id)
    tokens = torch.randint(4, ref.config.vocab_size, (3, 12))
    targets = torch.ones_like(tokens, dtype=torch.bool)
    targets[:, :5] = False
    collator = hf.SbdDataCollator(model.config, seed=3)
    collator._noise = torch.Generator().manual_seed(11)
    batch = collator([{"input_ids": t, "loss_mask": m} for t, m in zip(tokens, targets)])
    k = hf.training._block_size_at(3, 0, 2, 16)
    with torch.no_grad():
        expected, _ = sbd_loss(ref, tokens, targets, k, ref.config.mask_token_id, torch.Generator().manual_seed(11))
        through_adapter, _ = sbd_loss(sbd_model, tokens, targets, k, ref.config.mask_token_id,
                                      torch.Generator().manual_seed(11))
        hf_out = model(**{key: v for key, v in batch.items() if key != "labels"}, labels=batch["labels"])
        via_loss_func = hf.sbd_loss_func(hf_out, batch["labels"])
    torch.testing.assert_close(through_adapter, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf_out.loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_loss_func, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_batch_masks_give_the_same_logits_as_unpadded_rows(attn):
    """Guards against padding changing the real rows of a padded SBD batch (noisy rows of a block straddling the
    end would attend padding), under each attention implementation's mask form."""
    model = tiny_model("llama", attn=attn)
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    collator = hf.SbdDataCollator(model.config, block_min=4, block_max=4)
    short, long = list(range(3, 9)), list(range(10, 21))
    batch = collator([{"input_ids": short}, {"input_ids": long}])
    n, m = batch["input_ids"].shape[1] // 2, len(short)
    rows = list(range(m)) + list(range(n, n + m))
    alone_ids = batch["input_ids"][:1, rows]                                  # [clean[:m] ; noisy[:m]]
    alone_mask = hf.sbd_training_mask(torch.tensor([m]), m, 4, attn)
    with torch.no_grad():
        both = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=batch["attention_mask"]).logits
        one = model(input_ids=alone_ids, position_ids=torch.arange(m).repeat(2)[None],
                    attention_mask=alone_mask).logits
    torch.testing.assert_close(both[0, rows], one[0], atol=1e-5, rtol=1e-5)


def test_eager_and_sdpa_masks_agree():
    """Guards against the additive (eager) and boolean (sdpa) forms of the training mask meaning different things."""
    lengths = torch.tensor([5, 8])
    allowed = hf.sbd_training_mask(lengths, 8, 3, "sdpa")
    additive = hf.sbd_training_mask(lengths, 8, 3, "eager", torch.float32)
    assert allowed.shape == additive.shape == (2, 1, 16, 16)
    assert torch.equal(additive == 0, allowed)
    logits = {}
    for attn in ("sdpa", "eager"):
        model = tiny_model("qwen3", attn=attn, seed=1)
        hf.enable_sbd(model, mask_token_id=MASK_ID)
        ids = torch.randint(3, 60, (2, 16))
        with torch.no_grad():
            logits[attn] = model(input_ids=ids if attn == "sdpa" else logits["ids"], position_ids=torch.arange(
                8).repeat(2)[None].expand(2, 16), attention_mask=hf.sbd_training_mask(
                lengths, 8, 3, attn)).logits
        logits["ids"] = ids
    torch.testing.assert_close(logits["eager"][0, :5], logits["sdpa"][0, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["eager"][1], logits["sdpa"][1], atol=1e-5, rtol=1e-5)


def test_flex_block_mask_equals_the_dense_mask_cell_by_cell():
    """Guards against the FlexAttention form of the padded training mask differing from the dense one."""
    lengths = torch.tensor([5, 8])
    block_mask = hf.sbd_training_mask(lengths, 8, 3, "flex_attention")
    q, kv = torch.arange(16)[:, None], torch.arange(16)[None, :]
    dense = hf.sbd_training_mask(lengths, 8, 3, "sdpa")
    for b in range(2):
        assert torch.equal(block_mask.mask_mod(torch.tensor(b), 0, q, kv), dense[b, 0])


def test_trainer_runs_the_sbd_objective(tmp_path):
    """Guards against the collator's batch not fitting HF Trainer (labels popped for compute_loss_func, the 4-D
    mask, repeated position ids) or the loss not being optimised."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    data = [{"input_ids": list(range(3 + i % 5, 20 + i % 7))} for i in range(16)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6,
                                          learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no",
                                          logging_steps=1, remove_unused_columns=False)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=hf.SbdDataCollator(model.config),
                                   compute_loss_func=hf.sbd_loss_func)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("mode,wrapper", [("trainer-ddp", "DistributedDataParallel"), ("fsdp2", "FSDPLlamaForCausalLM")])
def test_two_process_training(tmp_path, mode, wrapper):
    """Guards against the SBD collator and loss breaking under data parallelism: 2 gloo processes on the CPU, HF
    Trainer with DDP, and FSDP2 (fully_shard) in a plain loop; the loss is finite and falls over 3 steps."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("hf_distributed_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker), mode,
           str(tmp_path)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["world"] == 2 and result["wrapper"] == wrapper
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]


def test_sampling_follows_the_seed_and_the_generation_config_filters():
    """Guards against sampled SBD decodes ignoring `seed` (irreproducible) or the generation config's top_k /
    top_p / min_p (HF's default top_k=50 among them) being silently dropped when do_sample=True."""
    model = tiny_model("llama").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE)

    def sample(seed, **filters):
        return model.generate(ids, max_new_tokens=8, custom_generate=hf.sbd_generate, do_sample=True,
                              temperature=1.5, seed=seed, gamma=0.5, **filters)

    assert torch.equal(sample(3, top_k=0), sample(3, top_k=0))
    assert not torch.equal(sample(3, top_k=0), sample(4, top_k=0))
    greedy = model.generate(ids, max_new_tokens=8, custom_generate=hf.sbd_generate, do_sample=False, gamma=0.5)
    assert torch.equal(sample(3, top_k=1), greedy)                  # top-1 sampling is greedy decoding
    for filters in ({"top_k": 5}, {"top_p": 0.5, "top_k": 0}, {"min_p": 0.3, "top_k": 0}):
        direct = hf.generate(model, ids, max_new_tokens=8, temperature=1.5, seed=3, gamma=0.5,
                             **{"top_k": 0, **filters})
        assert torch.equal(sample(3, **filters), direct.sequences), filters


def test_graph_safe_steps_hold_for_the_hf_cache(sbd_model):
    """Guards against the HF decode pass rebinding SbdCache buffers (CUDA-graph replays would read stale memory)."""
    from sbd_kernels.generate import EAGER_STEPS
    from sbd_kernels.graphs import graphed_steps

    cfg = DecodeConfig(method="sbd", block_size=4, gamma=0.5, max_new_tokens=10)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    checked = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, steps=graphed_steps(EAGER_STEPS, "check"))
    assert checked.tokens == generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0).tokens


@pytest.mark.slow
def test_hf_decode_steps_compile_without_graph_breaks():
    """Guards against the HF decode pass (the "sbd" attention, SbdCache, positions built from the cache lengths)
    graph-breaking or syncing: both SBD step layouts and the NTP step under torch.compile(fullgraph=True) give the
    eager tokens."""
    import dataclasses

    from sbd_kernels import generate as gen

    torch._dynamo.reset()
    sbd_model = hf.enable_sbd(tiny_model("qwen3"), mask_token_id=MASK_ID, block_size=4)
    steps = dataclasses.replace(gen.EAGER_STEPS, sbd_block_step=torch.compile(gen.sbd_block_step, fullgraph=True),
                                ntp_decode_step=torch.compile(gen.ntp_decode_step, fullgraph=True))
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    for cfg in (DecodeConfig(method="sbd", block_size=4, gamma=0.5, max_new_tokens=10),
                DecodeConfig(method="ntp", max_new_tokens=6)):
        compiled = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, steps=steps)
        assert compiled.tokens == generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0).tokens


@pytest.mark.slow
def test_flex_attention_training_mask_gives_the_sdpa_loss():
    """Guards against the FlexAttention BlockMask form of the padded training mask reading differently from the
    boolean sdpa form inside a real model (HF's flex_attention path, compiled on the CPU here)."""
    losses = {}
    for attn in ("flex_attention", "sdpa"):
        model = tiny_model("llama", attn=attn, seed=2)
        hf.enable_sbd(model, mask_token_id=MASK_ID)
        collator = hf.SbdDataCollator(model.config, block_min=4, block_max=4)
        batch = collator([{"input_ids": list(range(3, 20))}, {"input_ids": list(range(5, 15))}])
        with torch.no_grad():
            losses[attn] = model(**batch).loss
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], atol=1e-5, rtol=1e-5)

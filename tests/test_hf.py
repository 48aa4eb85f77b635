"""The Hugging Face path (`sbd_kernels.hf`) on tiny random-init models of every supported family (no downloads):
enable, fine-tuning inputs and loss, decoding through the `torch.ops.sbd` kernels, and each trap that used to give
a silently wrong result. The decoding tests run the model on CUDA (the Triton kernels) with SBD_TEST_DEVICE=cuda,
on the CPU otherwise; training stays on the CPU."""
import contextlib
import re
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sbd_kernels import hf
from sbd_kernels.generate import DecodeConfig, generate, naive_ops, oracle_decode
from sbd_kernels.hf.model import cache_argument_name
from sbd_kernels.model import ModelConfig, Transformer
from sbd_kernels.testing import (
    assert_close,
    cuda_graph_mode_params,
    rehearse_cuda_graphs,
    run_torchrun,
    triton_test_device,
)
from sbd_kernels.train import sbd_loss

DEVICE = triton_test_device()
VOCAB = 96
MASK_ID = 95
# Largest fp32 logit difference between the cached SBD decode and the full recompute on the tiny models, by
# device: summation orders differ between the paths; on the CPU the dense families stay below 9e-5, mixtral gave
# 1.29e-4 and gpt_oss 2.1e-4 (its sinks: HF's eager softmax subtracts each row's largest logit, ours the larger of
# the largest score and the sink, over logits near 20), an H200 gave 1.33e-4 on llama / qwen / mistral (cuBLAS and
# SDPA kernels). hf.check's own bound is looser (5.7e-4 there); a cached pass that reads a wrong key moves logits by
# O(1).
MAX_FP32_LOGIT_ERROR = {"cpu": 2.5e-4, "cuda": 3e-4}
FAMILIES = hf.SUPPORTED_MODEL_TYPES
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "granitemoeshared", "olmoe", "flex_olmo", "phimoe",
                "ernie4_5_moe", "hunyuan_v1_moe", "glm4_moe", "dots1", "solar_open", "dbrx", "minimax_m2", "hy_v3",
                "aria_text", "exaone_moe", "afmoe", "mellum", "laguna", "kolibri1", "beam", "cohere2_moe", "gpt_oss",
                "granitemoe_swa", "param2moe", "sarvam_moe", "minicpm5_moe", "ergo")
# Families whose released configs have sliding-window layers: their tiny models take a window of WINDOW, above the
# longest span of the per-family tests (22 positions: a decode pass's cache slots plus its block), with a full layer
# after a windowed one unless the family orders them itself.
WINDOWED_FAMILIES = ("gemma3_text", "olmo3", "cohere2", "ministral", "cwm", "exaone_moe", "afmoe", "mellum", "laguna",
                     "kolibri1", "beam", "cohere2_moe", "gemma2", "vaultgemma", "gpt_oss", "granite_swa",
                     "granitemoe_swa", "gemma4_text", "gemma4_unified_text", "gemma3n_text", "ergo")
WINDOW = 24
# GPT-OSS sink logits of the tiny models: the top scores of their std-1 weights lie around this value.
SINK_LOGIT_MEAN = 20.0
# Families whose HF model refuses sdpa (Gemma 2, VaultGemma: sdpa has no soft-capping; GPT-OSS, Granite SWA: no
# sinks): their tiny models run eager where a test asks for sdpa.
SDPA_REFUSED = ("gemma2", "vaultgemma", "gpt_oss", "granite_swa", "granitemoe_swa")
# The LM head of the tiny Apertus 1.5 models, pruned to the first APERTUS_HEAD ids (MASK_ID lies past them).
APERTUS_HEAD = VOCAB - 16
# Families with attention sinks: HF runs none under flex_attention on the CPU.
SINK_FAMILIES = ("gpt_oss", "granite_swa", "granitemoe_swa")

pytestmark = pytest.mark.usefixtures("one_thread")


# The tiny Gemma 4 configs' full layers: another head size and KV head count than the sliding ones (8 and 2).
GEMMA4_FULL_LAYERS = {"global_head_dim": 16, "num_global_key_value_heads": 1}
# Families whose own forward fails on older transformers releases, with or without SBD: (fixed in, what fails).
BROKEN_BEFORE = {
    "dbrx": (Version("5.15"), ("its router and experts take ffn_hidden_size inputs instead of d_model, so HF's "
                               "forward fails on every config where the two differ, released DBRX among them")),
}


def tiny_config(family: str, attn: str = "sdpa", **overrides):
    """A 2-layer GQA config of `family` (head dim 8, 4 query heads, 2 KV heads; 4 for GPT-NeoX and Persimmon),
    no sliding window but a window of WINDOW in WINDOWED_FAMILIES. head_dim is set for every family: gemma and glm default to 256 and 128 whatever the hidden
    size. The family's own departures from Llama that its real checkpoints use are switched on. Skips a family the
    installed transformers does not have (a release older than CI's pin: `make test-lower-bounds`)."""
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family} models")
    if family in BROKEN_BEFORE and Version(transformers.__version__) < BROKEN_BEFORE[family][0]:
        fixed_in, what = BROKEN_BEFORE[family]
        pytest.skip(f"transformers {transformers.__version__}'s {family}: {what} (fixed in {fixed_in})")
    if attn == "sdpa" and family in SDPA_REFUSED:
        attn = "eager"
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
              "attn_implementation": attn, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    if family in ("gpt_neox", "persimmon"):
        del common["num_key_value_heads"]     # no grouped-query attention: the cache takes one KV head per query head
    if family in ("mistral", "phi3", "starcoder2"):
        common["sliding_window"] = None
    if family in ("qwen2", "qwen3", "qwen2_moe"):
        common["use_sliding_window"] = False
    if family == "exaone4":
        common.update(sliding_window=None, layer_types=["full_attention"] * 2)   # the hybrid ones are refused
    if family == "smollm3":
        common["no_rope_layers"] = [1, 0]       # the second layer without RoPE (SmolLM3: every 4th)
    if family == "cohere":
        common["use_qk_norm"] = True            # Command R+
    if family == "hyperclovax":
        # HyperCLOVA X SEED's multipliers (muP): none of them 1, the attention scale not head_dim ** -0.5.
        common.update(embedding_multiplier=2.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=0.5)
    if family == "ministral3":
        # Mistral 3's query scale 1 + beta * log(1 + floor(position / original_max)) grows every 8 positions here
        # (every 16384 in the real configs), so the tests' positions reach three of its steps.
        common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                     "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1}
    if family == "gpt_oss":
        common["max_position_embeddings"] = 131072   # YaRN's factor 32 over its original 4096 positions, as released
    if family in ("gemma2", "gemma3_text", "gemma4_text", "gemma4_unified_text", "gemma3n_text"):
        # An output matrix of its own: tied, the input embedding (scaled by sqrt(hidden_size)) dominates the residual
        # stream of these std-1 models and greedy decoding repeats the prompt's last token, whatever the cache holds.
        common["tie_word_embeddings"] = False
    if family in ("gemma2", "vaultgemma"):
        # Gemma 2 caps its scores at 50 (logits at 30): at 5 the cap bends the scores of these std-1 weights.
        common["attn_logit_softcapping"] = 5.0
    if family in ("granite_swa", "granitemoe_swa"):
        # Granite's multipliers (muP), none of them 1; the attention scale is attention_multiplier.
        common.update(embedding_multiplier=2.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=0.5)
    if family == "minimax_m2":
        common["rotary_dim"] = 4                # RoPE on half of each head (MiniMax-M2: 64 of 128)
    if family == "dbrx":
        # DBRX nests its attention and expert settings and names the sizes d_model, n_heads, n_layers (given as
        # hidden_size alone, the expert router is built for the default d_model of 2048).
        common.update(d_model=32, n_heads=4, n_layers=2, max_seq_len=256,
                      attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                      ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 2})
    if family == "apertus1p5_text":
        # Apertus 1.5's released heads are pruned to the text ids: logits over the first output_vocab_size ids of
        # the embeddings' vocabulary.
        common["output_vocab_size"] = APERTUS_HEAD
    if family == "ergo":
        # Ergo's MLP widths default to 32768 (its dense first layer) and 8192 (its shared expert); its full layers
        # scale queries and keys by sqrt(global_attention_scale), as its long-context checkpoints do.
        common.update(first_dense_intermediate_size=64, shared_intermediate_size=32, global_attention_scale=2.0)
    if family in MOE_FAMILIES:
        # Every token takes both experts: with the default routing and std-1 weights a router near-tie flipped an
        # expert choice between two attention implementations (3-13 of 6336 logits beyond the fp32 tolerance), an
        # MoE property, not SBD's.
        # The families name the expert count and top-k differently; a config takes the names it knows. glm4_moe's
        # first layer stays dense (first_k_dense_replace 1), ernie4_5_moe's too (moe_layer_start_index 1).
        common.update({"num_local_experts": 2, "num_experts": 2, "n_routed_experts": 2, "moe_num_experts": 2,
                       "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1,
                       "n_shared_experts": 1, "moe_intermediate_size": 32})
    if family in WINDOWED_FAMILIES:
        common["sliding_window"] = WINDOW
        if family not in ("cwm", "beam"):         # their own orders: cwm [full, sliding], beam [sliding, full]
            common["layer_types"] = ["sliding_attention", "full_attention"]
    if family in ("gemma4_text", "gemma4_unified_text"):
        # Gemma 4: full layers with another head size and KV head count (global_head_dim, num_global_key_value_heads)
        # whose values are their keys (attention_k_eq_v), and the last two layers attending to the keys and values of
        # the last earlier layer of their type (num_kv_shared_layers); gemma4_text adds per-layer token inputs.
        common.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                      **GEMMA4_FULL_LAYERS, attention_k_eq_v=True, num_kv_shared_layers=2)
    if family == "gemma4_text":
        common.update(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
    if family == "gemma3n_text":
        # Gemma 3n: per-layer token inputs, AltUp's two predicted streams, LAuReL's low-rank residual, activation
        # sparsity in the first layer's MLP, and KV sharing as in Gemma 4.
        common.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                      vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                      laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
    common.update(overrides)
    return transformers.AutoConfig.for_model(family, **common)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """fp32 logits of one model along two attention paths: only summation orders differ. The fp32 row of the
    tolerance table, atol widened 4x for two layers of matmuls and softmaxes over std-1 weights (a wrong mask cell
    moves logits by O(1))."""
    assert_close(actual, expected, torch.float32, name=name, atol_scale=4)


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """A random model whose matrices are drawn at std 1 (HF initialises at 0.02): its predictions are sharp and
    varied, so entropies are well apart and the EB rule's ranking does not hinge on float rounding. GPT-OSS's sink
    logits are drawn near the scores these weights give (HF's 0.02 would leave them no weight)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, attn, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0)
            elif name.endswith(".sinks"):
                p.normal_(SINK_LOGIT_MEAN, SINK_LOGIT_MEAN / 4)
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
def test_import_refuses_transformers_and_accelerate_older_than_tested():
    """Guards against an old transformers failing deep inside the HF path (5.0: "Can't instantiate abstract
    class SbdCacheLayer"; accelerate 1.2 under transformers 5.13's Trainer: an unexpected keyword): the import
    names each package that is too old and the upgrade command; the installed ones pass."""
    from sbd_kernels.hf._versions import check_versions

    check_versions()
    check_versions({"transformers": "5.13.0", "accelerate": None})
    with pytest.raises(ImportError, match=r"transformers 5\.12\.1 \(needs >= 5\.13\); upgrade: pip install"):
        check_versions({"transformers": "5.12.1", "accelerate": "1.15.0"})
    with pytest.raises(ImportError, match=r"transformers 5\.0\.0 \(needs >= 5\.13\), accelerate 1\.2\.0"):
        check_versions({"transformers": "5.0.0", "accelerate": "1.2.0"})
    with pytest.raises(ImportError, match='needs transformers: pip install "transformers>=5.13" "accelerate>=1.3"'):
        check_versions({"transformers": None, "accelerate": None})



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


def test_decode_passes_hand_the_cache_under_the_name_the_model_takes(sbd_model):
    """Guards against the cache reaching the model under the name transformers 5.24 deprecated (past_key_values,
    a FutureWarning on every pass, removed in 5.40): the name is read from the model's forward."""
    from packaging.version import Version

    new_name = Version(transformers.__version__) >= Version("5.24")
    assert cache_argument_name(sbd_model.hf_model) == ("cache" if new_name else "past_key_values")
    cache = sbd_model.new_cache(1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        sbd_model.decode_pass(torch.tensor([[3, 4, MASK_ID, MASK_ID]], device=DEVICE),
                              torch.tensor([2], dtype=torch.int32, device=DEVICE), 2, cache)


def test_a_pruned_lm_head_stays_pruned_and_its_missing_mask_column_is_not_left_out():
    """Guards against two traps of an LM head narrower than the embeddings (Apertus 1.5's heads keep the text ids):
    HF's resize for a new mask token would grow the head over the image and audio ids (then drawn with logits of
    their own), and the sampler told to leave out a mask column the logits do not have (sbd.entropy_sample refuses
    a mask id past V)."""
    model = tiny_model("apertus1p5_text")
    tokenizer = word_tokenizer([f"<s{i}>" for i in range(VOCAB - 60)])          # no room: <|sbd_mask|> gets id 96
    sbd_model = hf.enable_sbd(model, tokenizer, block_size=4).to(DEVICE)
    assert sbd_model.mask_token_id == VOCAB
    assert model.get_input_embeddings().weight.shape[0] == VOCAB + 1
    assert model.get_output_embeddings().weight.shape[0] == APERTUS_HEAD == model.config.output_vocab_size
    prompts = [[3, 4, 5, 6], [7, 8]]
    cfg = DecodeConfig(method="sbd", block_size=4, max_new_tokens=8, temperature=0.0)
    result = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0)
    assert max(max(t) for t in result.tokens) < APERTUS_HEAD
    assert result.answers == oracle_decode(sbd_model, prompts, cfg, eos_id=1, pad_id=0).answers


def test_collator_refuses_targets_past_a_pruned_lm_head():
    """Guards against training targets the pruned head has no logit for (an IndexError in the loss on the CPU, a
    device assert on a GPU): refused naming the example and positions; in the context (labels -100) they pass."""
    model = tiny_model("apertus1p5_text")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    collator = hf.SbdDataCollator(model.config, block_min=2, block_max=2)
    tokens = [3, 4, APERTUS_HEAD + 2, 5, 6, 7]
    with pytest.raises(ValueError, match=f"example 1 has target ids past the LM head's output_vocab_size {APERTUS_HEAD} "
                                         r"at positions \[2\]"):
        collator([{"input_ids": [3, 4, 5, 6]}, {"input_ids": tokens}])
    labels = [-100, -100, -100, 5, 6, 7]
    batch = collator([{"input_ids": tokens, "labels": labels}])
    assert batch["input_ids"].max() == APERTUS_HEAD + 2


SUPPORTED = ("Supported families: llama, mistral, qwen2, qwen3, gemma, granite, olmo, olmo2, phi, phi3, cohere, glm, "
             "glm4, smollm3, starcoder2, gpt_neox, persimmon, helium, ernie4_5, arcee, apertus, apertus1p5_text, "
             "seed_oss, hunyuan_v1_dense, bitnet, exaone4, nanochat, internlm3, iquestcoder, exaone, hyperclovax, "
             "jais2, ministral3, stablelm, nemotron, mixtral, qwen2_moe, qwen3_moe, granitemoe, granitemoeshared, "
             "olmoe, flex_olmo, phimoe, ernie4_5_moe, hunyuan_v1_moe, glm4_moe, dots1, solar_open, dbrx, minimax_m2, "
             "hy_v3, aria_text, param2moe, sarvam_moe, minicpm5_moe, gemma3_text, olmo3, cohere2, ministral, cwm, "
             "exaone_moe, afmoe, mellum, laguna, kolibri1, beam, cohere2_moe, gemma2, vaultgemma, gpt_oss, "
             "granite_swa, granitemoe_swa, ergo, gemma4_text, gemma4_unified_text, gemma3n_text (decoder-only text "
             "models")


@pytest.mark.parametrize("family,overrides,reason", [
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "no sliding_window"),
    ("exaone4", {"layer_types": ["sliding_attention", "full_attention"]}, "no sliding_window"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
    ("gemma4_text", {"use_bidirectional_attention": "all"}, "bidirectional attention"),
    ("phi3", {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 4, "short_factor": [1.0] * 4,
                               "original_max_position_embeddings": 128}}, "longrope"),
    # RoPE parameters per layer type (Gemma 3, Gemma 4, Ergo): a length-dependent type on one of them.
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}},
     r"'dynamic' \(full_attention layers\)"),
], ids=["qwen2-sliding-layer-without-window", "exaone4-sliding-layer-without-window", "llama-dynamic-rope",
        "embeddinggemma-bidirectional", "gemma4-bidirectional", "phi3-128k-longrope", "gemma3-dynamic-rope-full-layers"])
def test_enable_refuses_what_sbd_cannot_decode_exactly(family, overrides, reason):
    """Guards against SBD silently running on layers whose attention or positions differ between a cached pass
    and a recompute: a sliding layer whose window the config does not state, length-dependent RoPE, and on models
    whose rows see later rows (EmbeddingGemma's and Gemma 4's bidirectional settings)."""
    with pytest.raises(hf.SbdUnsupportedModelError, match=reason) as err:
        hf.enable_sbd(tiny_model(family, **overrides), mask_token_id=MASK_ID)
    assert SUPPORTED in str(err.value)


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=VOCAB))


def bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=VOCAB))


def llava():
    text = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB}
    vision = {"model_type": "clip_vision_model", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 32, "image_size": 8, "patch_size": 4, "projection_dim": 16}
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=VOCAB - 2))


def qwen2_vl():
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": VOCAB,
            "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}}
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 2,
              "spatial_merge_size": 1, "temporal_patch_size": 1}
    return transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(text_config=text,
                                                                                   vision_config=vision))


def bloom():
    return transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=16, n_layer=1, n_head=2,
                                                                  vocab_size=VOCAB))


def mpt():
    return transformers.MptForCausalLM(transformers.MptConfig(d_model=16, n_layers=1, n_heads=2, expansion_ratio=2,
                                                              vocab_size=VOCAB))


def falcon_alibi():
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=VOCAB, alibi=True))


def llama4_text():
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_local_experts=2))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))


def deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, vocab_size=VOCAB))


@pytest.mark.parametrize("build,reason", [
    (t5, "cross-attention"), (bart, "cross-attention"), (llava, "multimodal"), (qwen2_vl, "multimodal"),
    (bloom, "ALiBi"), (mpt, "ALiBi"), (falcon_alibi, "ALiBi"), (llama4_text, "chunked attention"),
    (gpt2, "model type 'gpt2' is not supported"), (deepseek_v3, "multi-head latent attention"),
], ids=lambda v: getattr(v, "__name__", None))
def test_enable_refuses_other_architectures_with_the_reason(build, reason):
    """Guards against enabling an architecture whose cached passes would not equal a recompute (cross-attention,
    non-text inputs, ALiBi biases, chunked attention, DeepSeek's latent attention)
    or an untested family, and against a refusal that does not say why in a user's words or which
    families work."""
    with pytest.raises(hf.SbdUnsupportedModelError, match=reason) as err:
        hf.enable_sbd(build(), mask_token_id=5)
    assert SUPPORTED in str(err.value)



def test_readme_states_the_number_of_supported_families():
    """Guards against a family added to (or dropped from) SUPPORTED_MODEL_TYPES while the README still states the
    old count, against a name listed twice, and against a window rule for a family not in the list."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert len(set(hf.SUPPORTED_MODEL_TYPES)) == len(hf.SUPPORTED_MODEL_TYPES)
    # A misspelt name there would leave its family bounded by a window that none of its full layers applies.
    assert set(hf.window.LAYER_TYPED_WINDOW_MODEL_TYPES) <= set(hf.SUPPORTED_MODEL_TYPES)
    assert f"`hf.SUPPORTED_MODEL_TYPES`, {len(hf.SUPPORTED_MODEL_TYPES)} families" in readme

def test_enable_refuses_attention_implementations_that_cannot_take_the_mask():
    """Guards against enabling an attention implementation that cannot take the SBD training mask."""
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(hf.SbdUnsupportedModelError, match="flash_attention_2"):
        hf.enable_sbd(model, mask_token_id=MASK_ID)


def readme_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer of 90 ids with an EOS but no pad token (like Llama's), returning only
    input_ids and attention_mask (like Llama's)."""
    words = ["def", "square(x):", "return", "x", "*", "The", "capital", "of", "France", "is", "Paris.", "fib(n):"]
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), 90)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   model_input_names=["input_ids", "attention_mask"])


def test_readme_hugging_face_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """Guards against the README's Hugging Face example not running as written: names it never defines, a
    tokenizer without a pad token, a batch left on the CPU after Trainer moved the model, a check that drops the
    attention mask, or any call drifting from the API. Runs the code block verbatim on a tiny model folder."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("```python\nfrom transformers import AutoModelForCausalLM") + len("```python\n")
    code = readme[start:readme.index("```", start)]
    folder = tmp_path / "model"
    tiny_model("llama", eos_token_id=1, bos_token_id=None).save_pretrained(folder)
    readme_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)                                   # Trainer writes its output folder here
    namespace = {"path": str(folder)}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102  (our own README)
    out, batch = namespace["out"], namespace["batch"]
    assert namespace["model"].config.sbd_block_size == 16
    assert batch.input_ids.shape == (2, 3) and batch.input_ids[0, 0] == 1, "the shorter prompt is left-padded"
    assert torch.equal(out.sequences[:, :3], batch.input_ids) and out.nfe.shape == (2,)
    assert 1 <= int(out.generated.min()) and int(out.generated.max()) == out.sequences.shape[1] - 3 <= 64
    assert capsys.readouterr().out.strip().splitlines()[-1] == "True", "hf.check passed"


# ----------------------------------------------------------------------------------------------------
# Decoding through the ops
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,attn", [(f, "sdpa") for f in FAMILIES] + [("llama", "eager")])
def test_ntp_decode_equals_hf_greedy_generate_with_left_padding(family, attn):
    """Guards against position ids, padding or the cache differing from HF's own greedy decode (HF decodes through
    "sbd" too, which runs the base implementation with the base's masks), on tokens that vary: a model that
    repeats the prompt's last token (the tiny Gemmas with tied embeddings did) decodes the same from any cache."""
    model = tiny_model(family, attn=attn).to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 0, 13]], device=DEVICE)
    attention_mask = (input_ids != 0).long()
    expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    assert max(len(set(row)) for row in expected[:, 5:].tolist()) >= 4, "the model repeats a token: any cache fits"
    ours = hf.generate(model, input_ids, attention_mask, max_new_tokens=10, method="ntp")
    assert ours.sequences.tolist() == expected.tolist()
    via_hf = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False,
                            custom_generate=hf.sbd_generate, method="ntp")
    assert via_hf.tolist() == expected.tolist()


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_right_padded_prompts_decode_like_left_padded_ones(method):
    """Guards against the side of the padding changing a decode (positions or cached rows taken from the padded
    layout instead of the attention mask): right- and left-padded prompts give the same new tokens."""
    model = tiny_model("qwen3").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    width = max(map(len, prompts))
    left = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEVICE)
    right = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=DEVICE)
    outs = [hf.generate(model, ids, (ids != 0).long(), max_new_tokens=9, method=method, gamma=0.5, eos_token_id=[])
            for ids in (left, right)]
    assert outs[0].sequences[:, width:].tolist() == outs[1].sequences[:, width:].tolist()
    assert torch.equal(outs[0].nfe, outs[1].nfe)
    assert torch.equal(outs[1].sequences[:, :width], right)


def test_sbd_cache_layout_is_the_ops_layout():
    """Guards against an SbdCache laid out as HF's [B, H, S, D] or with int64 lengths (the attention op reads
    k / v as [B, S_max, Hkv, D] and seqlens as int32), and against the head size being derived from
    hidden_size / heads when the config sets head_dim."""
    sbd_model = hf.enable_sbd(tiny_model("qwen3", head_dim=16).to(DEVICE), mask_token_id=MASK_ID)
    cache = sbd_model.new_cache(3, 20)
    assert len(cache.layers) == 2
    for i in range(2):
        k, v = cache.layer_buffers(i)
        assert k.shape == v.shape == (3, 20, 2, 16)
        assert k.is_contiguous() and k.dtype == torch.float32 and k.device.type == torch.device(DEVICE).type
    assert cache.seqlens.dtype == torch.int32 and cache.seqlens.tolist() == [0, 0, 0]
    assert cache.max_len == 20


def test_sbd_cache_takes_each_layers_shape_and_shares_the_kv_shared_layers_buffers():
    """Guards against one head size for every layer (Gemma 4's full layers: 16 and one KV head, its windowed
    ones: 8 and two; the op would refuse the pass) and against a KV-shared layer holding buffers of its own (a
    second copy of the cache it reads: Gemma 4's last layers attend to the keys and values of the last earlier
    layer of their type, written once per pass through each). Shares that name no earlier layer with a cache of its
    own are refused."""
    sbd_model = hf.enable_sbd(tiny_model("gemma4_text").to(DEVICE), mask_token_id=MASK_ID)
    cache = sbd_model.new_cache(2, 10)
    shapes = [tuple(cache.layer_buffers(i)[0].shape) for i in range(4)]
    assert shapes == [(2, 10, 2, 8), (2, 10, 1, 16), (2, 10, 2, 8), (2, 10, 1, 16)]
    for reader, writer in ((2, 0), (3, 1)):
        assert all(a is b for a, b in zip(cache.layer_buffers(reader), cache.layer_buffers(writer)))
    assert cache.layer_buffers(0)[0] is not cache.layer_buffers(1)[0]
    for shared_with, culprit in (([None, 1], "layer 1 shares the cache of layer 1"),
                                 ([None, None, 1, 2], "layer 3 shares the cache of layer 2")):
        with pytest.raises(ValueError, match=culprit):
            hf.SbdCache(len(shared_with), 1, 4, 2, 8, shared_with=shared_with)
    with pytest.raises(ValueError, match="one entry per layer \\(3\\), got 2, 3 and 3"):
        hf.SbdCache(3, 1, 4, [2, 2], 8)


@pytest.mark.parametrize("family", ["gemma4_text", "gemma3n_text"])
@pytest.mark.parametrize("shared", [0, 1, 2])
def test_kv_sharing_without_the_config_property_is_derived_as_newer_configs_say(family, shared):
    """Guards against a cache on transformers 5.13-5.22 (whose configs have no `kv_sharing_modes`: the modeling
    code derives it from `num_kv_shared_layers`) giving each KV-shared layer buffers of its own, never written:
    without the property, the layers each layer reads the keys and values of, derived for the tiny config's layer
    types, equal those the installed transformers' config gives (a 4-layer model, 0-2 shared layers; with 3, a
    layer type has no producer and the config refuses itself)."""
    from types import SimpleNamespace

    from sbd_kernels.hf.model import kv_shared_with

    config = tiny_model(family, num_kv_shared_layers=shared).config
    if not hasattr(config, "kv_sharing_modes"):
        pytest.skip(f"transformers {transformers.__version__}'s configs have no kv_sharing_modes to compare with")
    older = SimpleNamespace(model_type=config.model_type, num_hidden_layers=config.num_hidden_layers,
                            num_kv_shared_layers=shared)
    assert kv_shared_with(older, config.layer_types) == kv_shared_with(config, config.layer_types)


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text"])
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_full_layer_shapes_without_per_layer_config_are_those_the_layers_have(family, k_eq_v):
    """Guards against a cache for Gemma 4 on transformers 5.13-5.14 (configs without `per_layer_config`) giving its
    full layers the sliding layers' KV heads and head size, which the op refused: the shapes derived from the
    config's fields as those releases hold them (`global_head_dim`, `num_global_key_value_heads`,
    `attention_k_eq_v`) equal those the installed transformers' config gives, and both are the shapes of the
    model's own attention layers."""
    from types import SimpleNamespace

    from sbd_kernels.hf.model import layer_cache_shapes

    overrides = {"num_kv_shared_layers": 0, "attention_k_eq_v": k_eq_v}
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    heads, dims, _ = layer_cache_shapes(model.config)
    layers = [layer.self_attn for layer in model.model.layers]
    assert dims == [attn.head_dim for attn in layers]
    assert heads == [config.num_attention_heads // attn.num_key_value_groups for attn in layers]
    assert dims[1] != dims[0], "the tiny config's full layers must differ from its sliding ones"
    fields = {key: value for key, value in config.to_dict().items() if key != "per_layer_config"}
    older = SimpleNamespace(**{**fields, **GEMMA4_FULL_LAYERS})
    assert layer_cache_shapes(older) == (heads, dims, [None] * len(layers))


def test_kv_sharing_that_leaves_no_producer_is_refused():
    """Guards against deriving KV sharing in which a shared layer has no earlier layer of its type computing the
    keys and values it reads (every layer shared, or a type only among the shared ones)."""
    from types import SimpleNamespace

    from sbd_kernels.hf.model import kv_sharing_modes

    types = ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]
    for shared in (2, 4):
        older = SimpleNamespace(model_type="gemma4_text", num_hidden_layers=4, num_kv_shared_layers=shared)
        with pytest.raises(ValueError, match=f"num_kv_shared_layers={shared} of 4 layers leaves no earlier layer"):
            kv_sharing_modes(older, types)


def test_cached_sbd_decode_equals_the_full_recompute_oracle(sbd_model):
    """Guards against the SBD cache protocol (first pass appends the previous block, later passes write nothing,
    block rows at L + c + j) disagreeing with a recompute, for every supported family."""
    report = hf.check(sbd_model, [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]], max_new_tokens=10)
    assert report.passed, report.summary("tiny")
    assert report.max_logit_error < MAX_FP32_LOGIT_ERROR[torch.device(DEVICE).type]


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text"])
def test_a_forward_keeping_the_last_rows_gives_their_logits(family):
    """Guards against Gemma 4's KV-shared layers, which a forward keeping the logits of its last rows runs on
    those rows alone, attending with SDPA's top-left causal alignment (row i seeing keys 0 .. i) under "sbd": HF
    guards it for models running sdpa, not for "sbd" over sdpa. Keeping the last 4 of 10 rows gives the full
    forward's last 4 rows of logits, as it does for HF's own sdpa model."""
    tokens = torch.randint(3, MASK_ID, (2, 10), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    model = tiny_model(family).to(DEVICE)
    with torch.no_grad():
        full = model(input_ids=tokens).logits
        assert_logits_close(model(input_ids=tokens, logits_to_keep=4).logits, full[:, -4:], "HF's own sdpa")
        hf.enable_sbd(model, mask_token_id=MASK_ID)
        assert_logits_close(model(input_ids=tokens, logits_to_keep=4).logits, full[:, -4:], "sbd over sdpa")


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text"])
def test_kv_shared_layers_refuse_flex_attention_under_sbd(family):
    """Guards against a Gemma 4 model whose every plain forward fails after enable_sbd: its forward slices
    FlexAttention masks before its KV-shared layers unless the model runs flex_attention itself, and a sliced
    BlockMask refuses to run. Refused, naming the setting and the implementations that work; without KV sharing
    flex_attention is taken."""
    with pytest.raises(hf.SbdUnsupportedModelError, match="num_kv_shared_layers=2.*\"sdpa\" or \"eager\""):
        hf.enable_sbd(tiny_model(family, attn="flex_attention"), mask_token_id=MASK_ID)
    hf.enable_sbd(tiny_model(family, attn="flex_attention", num_kv_shared_layers=0), mask_token_id=MASK_ID)


GEMMA4_RELEASED_HEADS = {"head_dim": 256, "global_head_dim": 512, "sliding_window": 6}


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3_text", {"sliding_window": 6}),
                                             ("gemma2", {"sliding_window": 6}), ("gpt_oss", {"sliding_window": 6}),
                                             ("gemma4_text", GEMMA4_RELEASED_HEADS),
                                             ("gemma4_unified_text", GEMMA4_RELEASED_HEADS)],
                         ids=["llama", "gemma3_text-past-the-window", "gemma2-softcap", "gpt_oss-sinks",
                              "gemma4_text-heads-256-512", "gemma4_unified_text-heads-256-512"])
def test_check_passes_a_default_initialised_bf16_model_up_to_near_ties(family, overrides):
    """Guards against hf.check failing every freshly initialised bf16 model (HF's std-0.02 init): its
    near-uniform predictions tie in the EB ranking at nearly every pass, and the cached decode (fp32
    accumulation) and the recompute then reveal different positions, with cached logits within their bound. Also
    through the PyTorch attention path, past a window, with capped scores and with sinks (HF's eager softmax of
    GPT-OSS runs in bf16, ours in fp32: 2.1e-3 apart against a bound of 0.16), and at Gemma 4's released head
    sizes: 256 in the windowed layers (the kernels' largest), 512 in the full ones (the PyTorch path; 0.015-0.021
    against 0.17)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).to(torch.bfloat16).eval()
    hf.enable_sbd(model.to(DEVICE), mask_token_id=MASK_ID, block_size=8)
    prompts = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0)).tolist()
    report = hf.check(model, prompts, max_new_tokens=24)
    assert report.passed, report.summary("default init")
    assert report.decode_ties, "the decodes of this model differ at near-ties: the judgement must have run"
    assert "near-ties" in report.summary("default init")


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_generate_output_flags_sequences_stopped_on_nan_logits(method):
    """Guards against HF's output hiding that a sequence was cut short by NaN logits (it would read like an early
    EOS): `stopped_early` is True for such rows, through hf.generate and custom_generate."""
    model = tiny_model("llama").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    with torch.no_grad():
        model.get_input_embeddings().weight[7].fill_(float("nan"))        # row 0's prompt holds token 7
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE)
    ours = hf.generate(model, input_ids, max_new_tokens=8, eos_token_id=[], method=method, gamma=0.5)
    assert ours.stopped_early.tolist() == [True, False] and ours.generated[0] == 0
    out = model.generate(input_ids, max_new_tokens=8, custom_generate=hf.sbd_generate, return_dict_in_generate=True,
                         pad_token_id=0, method=method, gamma=0.5)
    assert out.stopped_early.tolist() == [True, False]


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
    model = sbd_model.hf_model
    given = {cache_argument_name(model): sbd_model.new_cache(1, 16)}
    with pytest.raises(hf.SbdCacheError, match="position_ids"):
        model(input_ids=torch.tensor([[3, 4]], device=DEVICE), use_cache=True, **given)
    with pytest.raises(hf.SbdCacheError, match="cannot be passed to a plain HF forward"):
        model(input_ids=torch.tensor([[3, 4]], device=DEVICE), position_ids=torch.tensor([[0, 1]], device=DEVICE),
              use_cache=True, **given)


@pytest.mark.parametrize("family,overrides,window", [
    ("llama", {}, None),
    ("mistral", {"sliding_window": 16}, 16),
    ("mixtral", {"sliding_window": 16}, 16),
    ("phi3", {"sliding_window": 2047}, 2047),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, None),     # max_window_layers 28: no layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, 16),
    ("qwen2_moe", {}, None),                                                # sliding_window 0
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 16}, 16),
    ("exaone4", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}, 16),
    ("dots1", {}, None),                                                    # 4096, every layer full
    ("dots1", {"max_window_layers": 1}, 4096),
    ("exaone4", {"sliding_window": 16, "layer_types": ["full_attention"] * 2}, None),
    ("gemma3_text", {}, WINDOW),
    ("gemma3_text", {"layer_types": ["full_attention"] * 2}, None),
    ("starcoder2", {"sliding_window": 16, "layer_types": ["full_attention"] * 2}, 16),   # passed to every layer
], ids=["llama", "mistral", "mixtral", "phi3-mini", "qwen2-no-sliding-layer", "qwen2-sliding-layer",
        "qwen2_moe-zero", "qwen2_moe-sliding", "exaone4-hybrid", "dots1-full", "dots1-sliding-layer", "exaone4-full",
        "gemma3_text", "gemma3_text-full", "starcoder2"])
def test_attention_window_is_the_window_some_layer_applies(family, overrides, window):
    """Guards against a window read where no layer applies it (Qwen2 below max_window_layers, Qwen2-MoE's 0,
    dots.llm1's default 4096 or a Gemma 3 config with every layer full: needless refusals) or missed where one does
    (a family that passes its window to every layer, whatever the layer types)."""
    assert hf.window.attention_window(tiny_config(family, **overrides)) == window


def torch_attention_oracle(case, window: int | None, softcap: float | None, sinks: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, k_cache, v_cache) of a pass with a window, soft-capped scores and / or sinks, literally: per sequence
    the op oracle's keys and mask (`naive._decode_mask`), keys at positions <= p - W dropped from the row at
    position p, scores s capped to c * tanh(s / c), softmax over the keys and the head's sink logit (whose column
    is then dropped), rows without a key 0; then the causal rows appended. On copies of the caches."""
    from sbd_kernels.ops.attention import naive
    from sbd_kernels.ops.attention._checks import check_block_attention_args

    dims = check_block_attention_args(*case.args(), max_head_dim=None)
    scale = dims.head_dim ** -0.5 if case.softmax_scale is None else case.softmax_scale
    group = dims.q_heads // dims.kv_heads
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    c_slots = dims.num_causal_slots
    for b, (length, causal) in enumerate(zip(case.cache_seqlens.tolist(), case.num_causal.tolist())):
        keys = torch.cat([k_cache[b, :length], case.k[b, :causal], case.k[b, c_slots:]]).float()
        values = torch.cat([v_cache[b, :length], case.v[b, :causal], case.v[b, c_slots:]]).float()
        query_pos = torch.tensor([length + i for i in range(c_slots)] + [length + causal + j
                                                                           for j in range(dims.block_size)])
        key_pos = torch.arange(length + causal + dims.block_size)
        mask = naive._decode_mask(length, causal, dims, "cpu")
        if window is not None:
            mask &= query_pos[:, None] - key_pos[None] < window
        scores = torch.einsum("shd,nhd->hsn", case.q[b].float(), keys.repeat_interleave(group, dim=1)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num()[..., :mask.shape[1]]               # no key: 0
        out[b] = torch.einsum("hsn,nhd->shd", probs.masked_fill(~mask, 0), values.repeat_interleave(group, dim=1))
        k_cache[b, length:length + causal] = case.k[b, :causal]
        v_cache[b, length:length + causal] = case.v[b, :causal]
    return out.to(case.q.dtype), k_cache, v_cache


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal element for element, NaN where expected is NaN (slots no call may write keep their poison)."""
    assert torch.equal(actual.isnan(), expected.isnan()), f"{name}: NaN slots differ"
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num()), f"{name}: values differ"


TORCH_ATTENTION_CASES = {                 # make_case's shapes; L_b of the 3 sequences: L, L - 37 mod, ...
    "base": {},
    "window-1": {"window": 1},
    "window-2": {"window": 2},
    "window-past-the-pass": {"window": 60},
    "empty-cache": {"L": 0},
    "one-slot": {"L": 1},
    "no-causal-slots": {"C": 0},
    "no-block": {"K": 0},
    "one-row": {"C": 1, "K": 0},
    "no-rows": {"C": 0, "K": 0},
    "mha": {"Hq": 4, "Hkv": 4},
    "gqa-8": {"Hq": 8, "Hkv": 1},
    "head-dim-320": {"D": 320},
    "fp16": {"dtype": torch.float16},
    "bf16": {"dtype": torch.bfloat16},
    "non-contiguous": {"contiguous": False},
    "scale": {"softmax_scale": 0.3},
    "softcap": {"softcap": 1.5},
    "softcap-no-window": {"softcap": 1.5, "window": None},
    "softcap-empty-cache": {"softcap": 1.5, "window": None, "L": 0},
    "softcap-bf16": {"softcap": 1.5, "dtype": torch.bfloat16},
    "no-window-no-softcap": {"window": None},
    "sinks": {"sinks": True},
    "sinks-no-window": {"sinks": True, "window": None},
    "sinks-softcap": {"sinks": True, "softcap": 1.5},
    "sinks-softcap-gqa-4": {"sinks": True, "softcap": 1.5, "Hq": 8, "Hkv": 2},
    "sinks-empty-cache-bf16": {"sinks": True, "window": None, "L": 0, "dtype": torch.bfloat16},
}


@pytest.mark.parametrize("overrides", TORCH_ATTENTION_CASES.values(), ids=TORCH_ATTENTION_CASES.keys())
def test_torch_attention_equals_the_literal_oracle(overrides):
    """Guards against a windowed or soft-capped layer's pass attending to a key W or more positions back, missing
    one within, or capping the scores otherwise than c * tanh(s / c) before the mask: `torch_block_attention`
    against the op oracle's mask with the window cut out of it, capped scores and sink logits, over ragged lengths
    (sequences with the full C causal rows, none, and half), W from 1 past the whole pass or none, a cap of 1.5
    (scores of these inputs reach about 4), sinks drawn at std 2, every dtype, GQA and strided inputs. Cache slots past L_b and padding rows of q
    and v are NaN (read, they would show), padding rows of k 7777 (written to the cache, they would show), and
    the caches after the call equal the oracle's: the causal rows appended, nothing else written."""
    from attention_cases import make_case

    from sbd_kernels.hf.torch_attention import torch_block_attention

    settings = {"window": 9, "softcap": None, "sinks": None}
    settings.update({name: value for name, value in overrides.items() if name in settings})
    shape = {"B": 3, "C": 4, "K": 3, "L": 37, "Hq": 4, "Hkv": 2, "D": 16, "dtype": torch.float32}
    shape.update({name: value for name, value in overrides.items() if name not in settings})
    torch.manual_seed(0)
    case = make_case(**shape)
    if settings["sinks"]:
        settings["sinks"] = (torch.randn(shape["Hq"]) * 2).to(shape["dtype"])
    for b, causal in enumerate(case.num_causal.tolist()):          # padding rows: never read, never written
        for t, poison in ((case.q, float("nan")), (case.k, 7777.0), (case.v, float("nan"))):
            t[b, causal:shape["C"]] = poison
    expected, k_expected, v_expected = torch_attention_oracle(case, **settings)
    case = case.to(DEVICE)
    if settings["sinks"] is not None:
        settings["sinks"] = settings["sinks"].to(DEVICE)
    out = torch_block_attention(case.q, case.k, case.v, case.k_cache, case.v_cache, case.cache_seqlens,
                                case.num_causal, case.block_size, case.softmax_scale, **settings)
    assert out.dtype == case.q.dtype
    assert_close(out.cpu(), expected, shape["dtype"], name="out")
    assert_same_cache(case.k_cache.cpu(), k_expected, "k_cache")
    assert_same_cache(case.v_cache.cpu(), v_expected, "v_cache")


@pytest.mark.parametrize("settings", [{"softcap": 1.5}, {"window": 4}, {"sinks": True}, {}],
                         ids=["softcap", "window", "sinks", "none"])
def test_torch_attention_holds_a_bounded_score_block(monkeypatch, settings):
    """Guards against a long prefill holding its whole score matrix or its mask tiled per query head of a KV head
    at once, and against chunks of rows that lose or misplace rows: with a chunk bound of 2 query rows a pass of
    7 causal rows gives the same output and caches as in one chunk, on both attention paths (SDPA, explicit
    fp32 scores)."""
    from attention_cases import make_case

    from sbd_kernels.hf import torch_attention

    case = make_case(B=1, C=7, K=0, L=5, Hq=4, Hkv=2, D=8, dtype=torch.float32)
    if settings.get("sinks"):
        settings = {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}
    whole_case, chunked_case = case.with_cache_copies(), case.with_cache_copies()
    whole = torch_attention.torch_block_attention(*whole_case.args()[:8], **settings)
    monkeypatch.setattr(torch_attention, "SCORE_ELEMENTS_PER_CHUNK", 2 * 4 * (5 + 7))
    chunked = torch_attention.torch_block_attention(*chunked_case.args()[:8], **settings)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    assert_same_cache(chunked_case.k_cache, whole_case.k_cache, "k_cache")
    assert_same_cache(chunked_case.v_cache, whole_case.v_cache, "v_cache")


def test_torch_attention_refuses_what_the_op_refuses():
    """Guards against the PyTorch path skipping the op's checks: an overflowing cache and a wrong layout are
    refused in the op's words, and so are a window below 1 and a cap that is not positive."""
    from attention_cases import make_case

    from sbd_kernels.hf.torch_attention import torch_block_attention

    case = make_case(B=2, C=2, K=2, L=5, Hq=2, Hkv=1, D=8, dtype=torch.float32)
    args = (case.q, case.k, case.v, case.k_cache, case.v_cache)
    full = torch.full((2,), case.k_cache.shape[1] - 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cache_seqlens \\+ num_causal exceeds the cache capacity"):
        torch_block_attention(*args, full, case.num_causal.clamp(min=2), 2, window=4)
    with pytest.raises(RuntimeError, match="Hugging Face attention passes \\[B, H, S, D\\]"):
        torch_block_attention(case.q.transpose(1, 2), *args[1:], case.cache_seqlens, case.num_causal, 2, window=4)
    with pytest.raises(ValueError, match="window must be None or an int >= 1, got 0"):
        torch_block_attention(*args, case.cache_seqlens, case.num_causal, 2, window=0)
    with pytest.raises(ValueError, match="softcap must be None or > 0, got 0.0"):
        torch_block_attention(*args, case.cache_seqlens, case.num_causal, 2, softcap=0.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\] = \[2\] \(one logit per query head\), got \[1\]"):
        torch_block_attention(*args, case.cache_seqlens, case.num_causal, 2, sinks=torch.zeros(1))


@pytest.mark.parametrize("family,overrides", [
    ("mistral", {}),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
    ("exaone4", {"layer_types": ["sliding_attention", "full_attention"]}),
    ("gemma3_text", {}),
    ("cohere2", {}),
    ("gemma4_text", {}),
    ("gemma3n_text", {}),
], ids=["mistral", "qwen2-sliding-layer", "exaone4-hybrid", "gemma3_text", "cohere2", "gemma4_text-kv-shared",
        "gemma3n_text-kv-shared"])
def test_windowed_layers_give_hf_windowed_logits_up_to_and_past_the_window(family, overrides):
    """Guards against an off-by-one at the window, and against a windowed layer attending past it: HF's windowed
    layer lets index q attend to q - W < kv <= q (its eager attention weights: row W - 1 still weighs key 0, row W
    gives it exactly 0). Cached passes give HF's own windowed logits (HF builds the windowed masks from its config)
    for a prompt of W tokens (the op computes every layer), of W + 6 (windowed layers take the windowed path), and
    for a token decoded after W + 6 cached ones; so does `SbdCausalLM.forward` given a causal mask over W + 7
    tokens (the window added for the windowed layers). The weights come from HF's own initialisation for the
    boundary (std 0.02: near-uniform attention; at std 1 some weights underflow to 0)."""
    tokens = torch.randint(3, MASK_ID, (1, WINDOW + 7), generator=torch.Generator().manual_seed(0))
    hf_init = transformers.AutoModelForCausalLM.from_config(tiny_config(family, "eager", sliding_window=WINDOW,
                                                                         **overrides))
    with torch.no_grad():
        weights = hf_init(input_ids=tokens[:, :WINDOW + 1], output_attentions=True).attentions   # [1, H, T, T]
    assert all((layer[0, :, WINDOW - 1, 0] > 0).all() for layer in weights)
    assert any((layer[0, :, WINDOW, 0] == 0).all() for layer in weights)           # a windowed layer bites

    model = tiny_model(family, sliding_window=WINDOW, **overrides).to(DEVICE)
    sbd_model = hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    tokens = tokens.to(DEVICE)
    with torch.no_grad():
        expected = model(input_ids=tokens).logits.float()                           # HF builds the windowed masks
        for length in (WINDOW, WINDOW + 6):
            cached = sbd_model.decode_pass(tokens[:, :length], torch.tensor([length], dtype=torch.int32,
                                                                             device=DEVICE), 0,
                                           sbd_model.new_cache(1, length))
            assert_logits_close(cached.float(), expected[:, :length], f"cached pass of {length} tokens")
        cache = sbd_model.new_cache(1, WINDOW + 8)
        one = torch.ones(1, dtype=torch.int32, device=DEVICE)
        sbd_model.decode_pass(tokens[:, :WINDOW + 6], one * (WINDOW + 6), 0, cache)
        step = sbd_model.decode_pass(tokens[:, WINDOW + 6:], one, 0, cache)
        assert_logits_close(step.float(), expected[:, WINDOW + 6:], "a token decoded after W + 6 cached ones")
        causal = torch.ones(1, WINDOW + 7, WINDOW + 7, dtype=torch.bool, device=DEVICE).tril()
        positions = torch.arange(WINDOW + 7, device=DEVICE)[None]
        assert_logits_close(sbd_model(tokens, positions, causal), expected, "forward with a causal mask")


WINDOWED_DECODES = [(family, {}) for family in WINDOWED_FAMILIES] + [
    # Gemma 3's released pattern: five windowed layers, then a full one.
    ("gemma3_text", {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    ("mistral", {}), ("phi3", {}), ("starcoder2", {}), ("qwen3_moe", {}),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
    ("qwen2_moe", {"use_sliding_window": True, "max_window_layers": 2}),
    ("exaone4", {"layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma 4's mixture-of-experts models (26B-A4B) route experts beside their dense MLP.
    ("gemma4_text", {"enable_moe_block": True, "num_experts": 2, "top_k_experts": 2, "moe_intermediate_size": 32}),
    # Gemma 4's released full layers have heads of 512, above the kernels' 256: the PyTorch path computes them.
    ("gemma4_text", {"global_head_dim": 320})]


@pytest.mark.parametrize("family,overrides", WINDOWED_DECODES,
                         ids=[f"{f}-6-layers" if "num_hidden_layers" in o else f"{f}-moe" if "enable_moe_block" in o
                              else f"{f}-head-dim-320" if "global_head_dim" in o else f for f, o in WINDOWED_DECODES])
def test_decodes_past_the_window_equal_hf_greedy_and_the_recompute(family, overrides):
    """Guards against a windowed family decoding past its window (W = 6 here; prompts of 3 to 7 tokens and 12 new
    ones) with another window than HF's, or with a cache that disagrees with a recompute: NTP tokens equal HF's
    greedy generate on a left-padded batch, and hf.check's cached NTP and SBD decodes (block rows past the window
    too) equal the full recompute, logits within the fp32 bound."""
    model = tiny_model(family, sliding_window=6, **overrides).to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [8, 9, 10, 11, 12, 13, 14], [0, 0, 0, 0, 13, 14, 15]],
                             device=DEVICE)
    attention_mask = (input_ids != 0).long()
    expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    ours = hf.generate(model, input_ids, attention_mask, max_new_tokens=12, method="ntp")
    assert ours.sequences.tolist() == expected.tolist()
    report = hf.check(model, [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [12, 13, 14, 15]], max_new_tokens=12)
    assert report.passed, report.summary("tiny")
    assert report.max_logit_error < MAX_FP32_LOGIT_ERROR[torch.device(DEVICE).type]


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_windowed_training_mask_cuts_the_keys_past_the_window(implementation):
    """Guards against a windowed layer's training mask keeping a key W or more positions behind a real row (or
    cutting one within), in any base's form, and against a padded row left with no key (NaN under sdpa, and NaN
    gradients through it): it is the unwindowed mask with those keys cut from the real rows, positions being the
    index within each half."""
    lengths, n, k, window = torch.tensor([5, 8]), 8, 3, 3
    full = hf.sbd_training_mask(lengths, n, k, "sdpa")[:, 0]                             # [B, 2n, 2n]
    position = torch.arange(2 * n) % n
    near = position[:, None] - position[None, :] < window
    real_row = position[None, :, None] < lengths[:, None, None]
    expected = full & (near | ~real_row)
    mask = hf.sbd_training_mask(lengths, n, k, implementation, window=window)
    if implementation == "flex_attention":
        q, kv = torch.arange(2 * n)[:, None], torch.arange(2 * n)[None, :]
        actual = torch.stack([mask.mask_mod(torch.tensor(b), 0, q, kv) for b in range(2)])
    else:
        actual = mask[:, 0] if implementation == "sdpa" else mask[:, 0] == 0
    assert torch.equal(actual, expected)
    assert not torch.equal(expected, full) and expected.any(dim=-1).all()
    with pytest.raises(ValueError, match="window must be None or >= 1, got 0"):
        hf.sbd_training_mask(lengths, n, k, implementation, window=0)


@pytest.mark.parametrize("family,overrides,attn", [
    ("mistral", {}, "sdpa"), ("gemma3_text", {}, "sdpa"), ("gemma3_text", {}, "eager"),
    ("gemma3_text", {}, "flex_attention"), ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, "sdpa"),
    ("gemma4_text", {}, "sdpa"), ("gemma4_text", {"num_kv_shared_layers": 0}, "flex_attention"),
    ("gemma3n_text", {}, "flex_attention")],
    ids=["mistral", "gemma3_text", "gemma3_text-eager", "gemma3_text-flex", "qwen2-sliding-layer", "gemma4_text",
         "gemma4_text-no-kv-sharing-flex", "gemma3n_text-flex"])
def test_training_past_the_window_sees_what_hf_and_the_decode_see(family, overrides, attn):
    """Guards against training and decoding a windowed model (W = 6, an example of 16 tokens) under different
    windows: the clean half of a collated batch gives HF's own windowed logits of the example, and the rows of
    the noisy half's blocks starting at 8 and 12 give the block logits of a decode pass over the same cache (the
    clean tokens before the block) and the same masked block. A mask without the window moves both by O(1)."""
    model = tiny_model(family, attn, sliding_window=6, **overrides)
    sbd_model = hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    collator = hf.SbdDataCollator(model.config, block_min=4, block_max=4)
    example = list(range(3, 19))
    batch = collator([{"input_ids": example}])
    clean, noisy = batch["input_ids"][:, :16], batch["input_ids"][:, 16:]
    with torch.no_grad():
        logits = model(**batch).logits.float()
        assert_logits_close(logits[:, :16], model(input_ids=clean).logits.float(), "clean half")
        for start in (8, 12):
            cache = sbd_model.new_cache(1, 16)
            sbd_model.decode_pass(clean[:, :start], torch.tensor([start], dtype=torch.int32), 0, cache)
            block = sbd_model.decode_pass(noisy[:, start:start + 4], torch.zeros(1, dtype=torch.int32), 4, cache)
            assert_logits_close(logits[:, 16 + start:20 + start], block.float(), f"block at {start}")


def test_forward_refuses_a_block_mask_past_the_window():
    """Guards against a windowed model attending past its window through a FlexAttention BlockMask given to
    SbdCausalLM.forward, which cannot take the window's band: positions spanning W are taken, W + 1 refused."""
    model = tiny_model("mistral", "flex_attention", sliding_window=WINDOW)
    sbd_model = hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    tokens = torch.full((1, WINDOW + 1), 4)
    causal = torch.ones(1, WINDOW + 1, WINDOW + 1, dtype=torch.bool).tril()
    block_mask = hf.model.mask_for_implementation(causal[:, :WINDOW, :WINDOW], "flex_attention", torch.float32)
    with torch.no_grad():
        sbd_model(tokens[:, :WINDOW], torch.arange(WINDOW)[None], block_mask)
    block_mask = hf.model.mask_for_implementation(causal, "flex_attention", torch.float32)
    with pytest.raises(ValueError, match=f"a BlockMask's positions 0 to {WINDOW} span {WINDOW + 1} positions"):
        sbd_model(tokens, torch.arange(WINDOW + 1)[None], block_mask)


def test_a_pass_builds_its_windowed_plan_once_for_all_its_windowed_layers(monkeypatch):
    """Guards against every windowed layer rebuilding the pass's mask and write indices (0.26 ms of host work
    each, where a layer's attention takes 0.23 ms): a pass of a model whose two layers are windowed builds one
    plan, and the next pass its own."""
    from sbd_kernels.hf import torch_attention

    built = []
    plan = torch_attention.plan_pass
    monkeypatch.setattr(torch_attention, "plan_pass", lambda *args: built.append(args) or plan(*args))
    sbd_model = hf.enable_sbd(tiny_model("mistral", sliding_window=6).to(DEVICE), mask_token_id=MASK_ID,
                              block_size=4)
    cache = sbd_model.new_cache(1, 12)
    tokens = torch.arange(3, 11, device=DEVICE)[None]
    with torch.no_grad():
        sbd_model.decode_pass(tokens, torch.tensor([8], dtype=torch.int32, device=DEVICE), 0, cache)
        assert len(built) == 1
        sbd_model.decode_pass(tokens[:, :4], torch.zeros(1, dtype=torch.int32, device=DEVICE), 4, cache)
    assert len(built) == 2


def test_a_window_changed_after_enable_is_followed_or_refused():
    """Guards against a config changed after enable_sbd decoding with a stale window. Mistral layers pass the
    config's window with every call, as HF's masks read it: set to 4 after enable_sbd, the decode follows it and
    equals HF's greedy generate. Qwen2 layers keep the window they were built with: one that disagrees with the
    config is refused, naming the layer and both windows."""
    model = tiny_model("mistral").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    model.config.sliding_window = 4
    prompt = torch.tensor([[3, 4, 5, 6, 7]], device=DEVICE)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert hf.generate(model, prompt, max_new_tokens=8, method="ntp").sequences.tolist() == expected.tolist()
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1).to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    model.config.sliding_window = 4
    with pytest.raises(RuntimeError, match="layer 1 passes sliding_window=24, but its config gives it a window of 4"):
        hf.generate(model, prompt, max_new_tokens=8, method="ntp")


@pytest.mark.parametrize("family", ["stablelm", "nemotron"])
def test_layers_that_drop_their_kwargs_take_the_pass_from_the_config(family, monkeypatch):
    """Guards against a family whose decoder layers call attention without their keyword arguments (StableLM,
    Nemotron) decoding with the pass's empty mask under the base attention: the pass reaches attention through the
    config, which every attention module shares. Without that record (switched off here) the first layer names the
    cause; the record is gone after a pass, also one that failed, and a plain forward given the pass's mask is
    refused."""
    from sbd_kernels.hf.attention import SBD_PASS_MASK, current_pass

    model = tiny_model(family).to(DEVICE)
    sbd_model = hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    prompt = torch.tensor([[3, 4, 5, 6, 7]], device=DEVICE)
    hf.generate(model, prompt, torch.ones_like(prompt), max_new_tokens=8, method="sbd")
    assert current_pass(model.config) is None
    with pytest.raises(RuntimeError, match="num_causal must be in"):                 # raised inside the pass
        sbd_model.decode_pass(prompt, torch.tensor([9], dtype=torch.int32, device=DEVICE), 0,
                              sbd_model.new_cache(1, 16))
    assert current_pass(model.config) is None
    with pytest.raises(RuntimeError, match="got a decode pass's mask outside a decode pass"):
        model(input_ids=prompt, attention_mask=SBD_PASS_MASK)
    monkeypatch.setattr(hf.model, "active_pass", lambda config, sbd_pass: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="layer 0 of .*Attention got a decode pass's mask outside a decode pass"):
        hf.generate(model, prompt, torch.ones_like(prompt), max_new_tokens=8, method="sbd")


@pytest.mark.parametrize("family", ["llama", "stablelm"])
def test_threads_decoding_with_one_model_each_use_their_own_pass(family):
    """Guards against the decode pass recorded for layers that drop their kwargs being shared between threads: with
    the record on the config itself, threads decoding with one model overwrote and removed each other's (an
    AttributeError in every family; a wrong cache read for StableLM). Four threads, three decodes each, give the
    tokens of the same decodes run one after another."""
    import threading

    model = tiny_model(family).to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    prompts = [torch.tensor([[3 + i, 4, 5, 6, 7 + i]], device=DEVICE) for i in range(4)]

    def decode(prompt):
        return hf.generate(model, prompt, torch.ones_like(prompt), max_new_tokens=16, method="sbd").sequences

    expected = [decode(prompt) for prompt in prompts]
    results: dict[int, list] = {i: [] for i in range(4)}
    threads = [threading.Thread(target=lambda i=i: results[i].extend(decode(prompts[i]) for _ in range(3)))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(4):
        assert len(results[i]) == 3, f"thread {i} failed (its exception is printed above)"
        assert all(torch.equal(tokens, expected[i]) for tokens in results[i]), f"thread {i}: other tokens"


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32], ids=str)
def test_boolean_or_integer_mask_under_eager_attention_is_refused(dtype):
    """Guards against a boolean or integer 0 / 1 mask being added to eager attention scores as 1 / 0 instead of
    0 / -inf (max logit error 0.49 for the boolean SBD mask, 27 for an int64 causal mask on this model)."""
    model = tiny_model("llama", attn="eager")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match=f"adds attention_mask to the scores; a {dtype} mask"):
        model(input_ids=torch.tensor([[3, 4, 5, 6]]), attention_mask=allowed.to(dtype))


def test_custom_generate_refuses_settings_it_would_ignore():
    """Guards against repetition penalties, stop strings or top-k silently not being applied."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="beam"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, num_beams=2)


def test_custom_generate_refuses_processors_and_criteria_whose_settings_it_would_ignore():
    """Guards against a logits processor or stopping criterion of a kind the fused decode implements being
    accepted by type and then ignored (the decode reads the generation config): a user's TopKLogitsWarper(1)
    sampled at top_k=0, an EosTokenCriteria(28) decoded past token 28. Also refused: a sampling warper under
    greedy decoding, and output fields the decode does not fill (scores, logits), which came back as None."""
    from transformers import (
        EosTokenCriteria,
        LogitsProcessorList,
        MaxLengthCriteria,
        StoppingCriteriaList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])

    def run(**settings):
        return model.generate(ids, max_new_tokens=8, custom_generate=hf.sbd_generate, gamma=0.5, seed=3, **settings)

    sampled = {"do_sample": True, "temperature": 1.0, "top_k": 0}
    with pytest.raises(ValueError, match=r"TopKLogitsWarper\(top_k=1\) differs from the generation config's top_k=0"):
        run(**sampled, logits_processor=LogitsProcessorList([TopKLogitsWarper(1)]))
    with pytest.raises(ValueError, match="TopPLogitsWarper with min_tokens_to_keep=2"):
        run(**sampled, top_p=0.5, logits_processor=LogitsProcessorList([TopPLogitsWarper(0.5, min_tokens_to_keep=2)]))
    with pytest.raises(ValueError, match="TemperatureLogitsWarper given with do_sample=False"):
        run(do_sample=False, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    with pytest.raises(ValueError, match=r"EosTokenCriteria\(eos_token_id=\[28\]\) differs .* eos_token_id \[1\]"):
        run(stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=28)]))
    with pytest.raises(ValueError, match=r"MaxLengthCriteria\(max_length=5\) differs .* \(11, prompt included\)"):
        run(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length=5)]))
    for flag in ("output_scores", "output_logits"):
        with pytest.raises(ValueError, match=f"{flag}=True not supported"):
            run(return_dict_in_generate=True, **{flag: True})
    # The same settings given both ways are what the decode applies: accepted, same tokens.
    same = LogitsProcessorList([TopKLogitsWarper(5)])
    assert torch.equal(run(**{**sampled, "top_k": 5}, logits_processor=same), run(**{**sampled, "top_k": 5}))
    assert torch.equal(run(stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=1)])), run())


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_custom_generate_with_eos_token_id_none_runs_to_the_length_limit(method):
    """Guards against model.generate(..., custom_generate=hf.sbd_generate, eos_token_id=None) stopping on the EOS
    id of the model's generation config, which HF's own generate with eos_token_id=None never does (row 0 ended
    after 1 new token instead of 12): the generation config HF hands custom_generate is already resolved. Only
    hf.generate, called directly, reads a missing eos_token_id from the model's generation config."""
    model = tiny_model("llama").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE)
    free = hf.generate(model, ids, max_new_tokens=12, eos_token_id=[], method=method, gamma=0.5)
    model.generation_config.eos_token_id = int(free.sequences[0, 4])     # the model's stored EOS
    out = model.generate(ids, max_new_tokens=12, custom_generate=hf.sbd_generate, return_dict_in_generate=True,
                         eos_token_id=None, method=method, gamma=0.5)
    assert out.generated.tolist() == [12, 12]
    assert out.sequences.tolist() == free.sequences.tolist()
    if method == "ntp":
        assert out.sequences.tolist() == model.generate(ids, max_new_tokens=12, do_sample=False,
                                                        eos_token_id=None).tolist()
    assert int(hf.generate(model, ids, max_new_tokens=12, method=method, gamma=0.5).generated[0]) <= 2


@pytest.mark.parametrize("settings", [{"pad_token_id": None}, {"pad_token_id": None, "eos_token_id": None}],
                         ids=["pad-none", "pad-and-eos-none"])
def test_custom_generate_pads_like_hf_when_pad_token_id_is_none(settings):
    """Guards against model.generate(..., custom_generate=hf.sbd_generate, pad_token_id=None) padding finished
    rows with the model's stored pad id (0), where HF pads them with the first EOS id: the NTP decode through
    custom_generate gives HF greedy's sequences token for token."""
    model = tiny_model("llama").to(DEVICE)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE)
    free = hf.generate(model, ids, max_new_tokens=12, eos_token_id=[], method="ntp")
    model.generation_config.eos_token_id = int(free.sequences[0, 5])     # row 0 ends after 3 new tokens
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, **settings)
    out = model.generate(ids, max_new_tokens=12, custom_generate=hf.sbd_generate, method="ntp", **settings)
    assert out.tolist() == expected.tolist()


def test_an_out_of_range_pad_token_id_is_named_as_the_caller_passed_it():
    """Guards against an out-of-range pad_token_id (given to hf.generate or model.generate, or the first EOS id HF
    pads with when pad_token_id is None) being reported as "pad_id 500", a name neither entry point takes."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    outside = r"pad_token_id 500 is outside the model's vocabulary \[0, 96\)"
    with pytest.raises(ValueError, match=f"sbd_generate: {outside}"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, pad_token_id=500)
    with pytest.raises(ValueError, match=f"^generate: {outside}"):
        hf.generate(model, ids, max_new_tokens=4, pad_token_id=500)
    with pytest.raises(ValueError, match=r"sbd_generate: pad_token_id 500 \(the first eos_token_id, as "
                                         r"pad_token_id is None\) is outside"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, pad_token_id=None,
                       eos_token_id=[500, 1])


def test_custom_generate_refuses_inputs_embeds():
    """Guards against model.generate(inputs_embeds=..., custom_generate=hf.sbd_generate) failing with "prompts[0]
    is empty", which names nothing the user passed (HF hands custom_generate empty [B, 0] input_ids beside the
    embeddings): the decode looks token ids up itself, so the embeddings are refused by name."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match="sbd_generate: inputs_embeds is not supported.*pass input_ids"):
        model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4,
                       custom_generate=hf.sbd_generate)


@pytest.fixture
def two_rank_group():
    """A process group of world size 2 in this one process, as rank 1 (torch's fake backend: collectives do
    nothing), destroyed after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


def test_decoding_refuses_a_model_sharded_over_ranks(two_rank_group, monkeypatch):
    """Guards against decoding a model sharded over ranks (FSDP, DeepSpeed ZeRO-3: HF's synced-GPU mode, which
    transformers does not forward to a callable custom_generate): each rank's decode runs its own number of
    passes while every sharded forward waits for all ranks, so ranks would hang."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard

    ids = torch.tensor([[5, 6, 7]])
    sharded = tiny_model("llama")
    hf.enable_sbd(sharded, mask_token_id=MASK_ID, block_size=4)
    fully_shard(sharded)
    fsdp = "synced-GPU decoding .FSDPLlamaForCausalLM is FSDP-sharded over 2 ranks. is not supported"
    with pytest.raises(ValueError, match=fsdp):
        sharded.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate)
    with pytest.raises(ValueError, match=fsdp):
        hf.generate(sharded, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=fsdp):
        hf.check(sharded, [[3, 4, 5]])
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    zero3 = SimpleNamespace(is_zero3=lambda: True, config={})
    monkeypatch.setattr(transformers.integrations.deepspeed, "_hf_deepspeed_config_weak_ref", lambda: zero3)
    with pytest.raises(ValueError, match=r"synced-GPU decoding \(DeepSpeed ZeRO-3 over 2 ranks\)"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate)
    with pytest.raises(ValueError, match=r"synced-GPU decoding \(synced_gpus=True\)"):
        hf.sbd_generate(model, ids, generation_config=model.generation_config, synced_gpus=True)


def test_block_size_zero_is_refused_not_replaced():
    """Guards against block_size=0 being silently replaced by the default (`block_size or default`) in
    enable_sbd, generate, custom_generate and check."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="enable_sbd: block_size must be >= 1, got 0"):
        hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=0)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        hf.generate(model, ids, max_new_tokens=4, block_size=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, block_size=0)
    with pytest.raises(ValueError, match="check: block_size must be >= 1, got 0"):
        hf.check(model, [[3, 4, 5]], block_size=0)


@pytest.mark.parametrize("name,token_id", [("eos_token_id", 1), ("pad_token_id", 0), ("bos_token_id", 2)])
def test_mask_token_cannot_be_the_eos_pad_or_bos_token(name, token_id):
    """Guards against a mask token that is also EOS (the sampler never draws the mask token, so no decode could
    end), pad or BOS (masked slots indistinguishable from padding or sequence starts) being accepted."""
    with pytest.raises(ValueError, match=f"mask_token_id {token_id} is the {name} of the model or its tokenizer"):
        hf.enable_sbd(tiny_model("llama"), mask_token_id=token_id)


def test_reserved_token_taken_as_the_pad_token_is_not_the_mask_token():
    """Guards against picking as the mask token the last reserved token when the tokenizer uses it as its pad
    token (a common Llama 3 fine-tuning set-up): the next free reserved token is taken instead."""
    tokenizer = word_tokenizer(["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"])
    tokenizer.pad_token = "<|reserved_special_token_1|>"
    sbd_model = hf.enable_sbd(tiny_model("llama"), tokenizer)
    assert sbd_model.mask_token_id == tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>")


def test_mask_token_reused_from_the_tokenizer_gets_an_embedding_row():
    """Guards against a tokenizer's `<|sbd_mask|>`, added for another copy of the model, being reused without
    resizing the embeddings of this one: the first forward failed with IndexError (a device assert on CUDA)."""
    tokenizer = word_tokenizer([f"<s{i}>" for i in range(VOCAB - 60)])        # fills the 96 embedding rows
    first = tiny_model("llama")
    assert hf.enable_sbd(first, tokenizer).mask_token_id == VOCAB
    second = tiny_model("llama")
    sbd_model = hf.enable_sbd(second, tokenizer)
    assert sbd_model.mask_token_id == VOCAB
    assert second.get_input_embeddings().weight.shape[0] == second.lm_head.weight.shape[0] == VOCAB + 1
    out = hf.generate(second, torch.tensor([[5, 6, 7]]), max_new_tokens=4, eos_token_id=[])
    assert int(out.generated[0]) == 4


def test_enable_again_with_another_mask_token_unsuppresses_the_old_one():
    """Guards against `enable_sbd` with a new mask token leaving the old mask id in
    generation_config.suppress_tokens (and so in a saved generation_config.json): HF's generate never emitted that
    token again, and custom_generate refused with "suppress_tokens other than the mask token", a setting the user
    never made. A token the user suppressed stays suppressed."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    hf.enable_sbd(model, mask_token_id=MASK_ID - 1)
    assert model.generation_config.suppress_tokens == [MASK_ID - 1]
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, custom_generate=hf.sbd_generate)
    assert out[:, :3].tolist() == [[5, 6, 7]]
    own = tiny_model("llama")
    own.generation_config.suppress_tokens = [40]
    hf.enable_sbd(own, mask_token_id=MASK_ID)
    hf.enable_sbd(own, mask_token_id=MASK_ID - 1)
    assert own.generation_config.suppress_tokens == [40, MASK_ID - 1]


def test_forward_without_a_mask_is_causal_when_positions_restart():
    """Guards against `SbdCausalLM.forward(tokens, positions, None)` attending block-diagonally: with position ids
    that restart (the SBD layout [0..n-1 ; 0..n-1]) HF reads a missing mask as packed sequences (logits moved by
    23 on this model), while the SbdModel protocol says None is causal."""
    sbd_model = hf.enable_sbd(tiny_model("llama"), mask_token_id=MASK_ID)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    causal = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(sbd_model(tokens, positions, None), sbd_model(tokens, positions, causal),
                                   atol=0, rtol=0)


@pytest.mark.slow
def test_check_and_the_reference_loss_run_on_a_flex_attention_model():
    """Guards against every boolean tensor mask failing on a flex_attention model (hf.check, the oracle decode and
    `sbd_kernels.train.sbd_loss` pass them to `SbdCausalLM.forward`, which gave them to the flex path as tensors):
    the mask reaches FlexAttention as a BlockMask indexing the tensor, the check passes, and the reference loss
    equals the sdpa model's."""
    models = {attn: hf.enable_sbd(tiny_model("llama", attn=attn), mask_token_id=MASK_ID, block_size=4)
              for attn in ("flex_attention", "sdpa")}
    report = hf.check(models["flex_attention"], [[3, 4, 5], [6, 7]], max_new_tokens=8)
    assert report.passed, report.summary("flex")
    tokens = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    targets = torch.ones_like(tokens, dtype=torch.bool)
    losses = {}
    with torch.no_grad():
        for attn, sbd_model in models.items():
            losses[attn], _ = sbd_loss(sbd_model, tokens, targets, 3, MASK_ID, torch.Generator().manual_seed(1))
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Training: masks, collator, loss
# ----------------------------------------------------------------------------------------------------
def port_reference_weights(ref: Transformer) -> transformers.LlamaForCausalLM:
    """An HF Llama with the reference model's weights (same architecture: RMSNorm, rotate-half RoPE, SwiGLU, GQA)
    and its vocabulary's special ids (pad 0, EOS 1, no BOS; the mask token is 2, LlamaConfig's default EOS)."""
    cfg = ref.config
    config = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
                                      intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                                      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                                      max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                                      rms_norm_eps=cfg.norm_eps, attn_implementation="sdpa", pad_token_id=0,
                                      eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_sbd_loss_equals_the_reference_objective(family):
    """Guards against the HF collator / loss building another objective than `sbd_kernels.train.sbd_loss` (one
    objective: same noise, labels, mask and weighting give the same loss), for every family: through the
    `SbdCausalLM` adapter, and for Llama also on the reference Transformer with the same weights."""
    torch.manual_seed(0)
    if family == "llama":
        ref = Transformer(ModelConfig.preset("tiny")).eval()
        model, mask_id, vocab = port_reference_weights(ref), ref.config.mask_token_id, ref.config.vocab_size
    else:
        ref, model, mask_id, vocab = None, tiny_model(family), MASK_ID, 60
    sbd_model = hf.enable_sbd(model, mask_token_id=mask_id)
    tokens = torch.randint(4, vocab, (3, 12))
    targets = torch.ones_like(tokens, dtype=torch.bool)
    targets[:, :5] = False
    collator = hf.SbdDataCollator(model.config, seed=3, rank=0)
    batch = collator([{"input_ids": t, "labels": torch.where(m, t, -100)} for t, m in zip(tokens, targets)])
    k = hf.training._block_size_at(3, 0, 2, 16)

    def noise():
        return hf.training._noise_generator(3, 0, None, 0)

    with torch.no_grad():
        expected, _ = sbd_loss(sbd_model, tokens, targets, k, mask_id, noise())
        hf_out = model(**{key: v for key, v in batch.items() if key != "labels"}, labels=batch["labels"])
        via_loss_func = hf.sbd_loss_func(hf_out, batch["labels"])
        if ref is not None:
            on_reference, _ = sbd_loss(ref, tokens, targets, k, mask_id, noise())
            torch.testing.assert_close(on_reference, expected, atol=1e-5, rtol=1e-5)
    assert int((batch["labels"] != -100).sum()) > 10
    torch.testing.assert_close(hf_out.loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_loss_func, expected, atol=1e-5, rtol=1e-5)


def test_loss_func_divides_by_the_trainers_item_count():
    """Guards against `num_items_in_batch` (the Trainer's target count over gradient-accumulation steps and ranks)
    being ignored: the loss is then the summed CE over this batch's targets divided by that count."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    batch = hf.SbdDataCollator(model.config)([{"input_ids": list(range(3, 15))}, {"input_ids": list(range(5, 12))}])
    labels = batch.pop("labels")
    with torch.no_grad():
        out = model(**batch)
    count = int((labels != -100).sum())
    mean = hf.sbd_loss_func(out, labels)
    torch.testing.assert_close(hf.sbd_loss_func(out, labels, torch.tensor(4 * count)), mean / 4)
    torch.testing.assert_close(hf.sbd_loss_func(out, labels, 2 * count), mean / 2)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3_text", {"sliding_window": 6})],
                         ids=["llama", "gemma3_text-masks-by-layer-type"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_collator_batches_can_be_pinned(implementation, family, overrides):
    """Guards against a batch that a DataLoader with pin_memory=True (Trainer's default on a GPU) refuses: on an
    H200, Trainer stopped at the first batch because position_ids was one row expanded over the batch. Every
    tensor is contiguous (no stride-0 dimension, no internal overlap), also the masks of a dict by layer type."""
    model = tiny_model(family, attn=implementation, **overrides)
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    batch = hf.SbdDataCollator(model.config)([{"input_ids": list(range(3, 15))}, {"input_ids": list(range(5, 12))}])
    tensors = {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}
    if isinstance(batch["attention_mask"], dict):
        assert set(batch["attention_mask"]) == {"full_attention", "sliding_attention"}
        tensors.update({f"attention_mask.{kind}": m for kind, m in batch["attention_mask"].items()
                        if isinstance(m, torch.Tensor)})
    assert {"input_ids", "position_ids", "labels"} <= set(tensors)
    assert all(value.is_contiguous() and 0 not in value.stride() for value in tensors.values())
    pinned = torch.utils.data._utils.pin_memory.pin_memory(batch) if torch.cuda.is_available() else batch
    assert set(pinned) == set(batch)


def test_collator_counts_only_the_targets_of_hf_style_labels():
    """Guards against the prompt tokens of chat / instruction data (HF `labels` -100) being trained on: NTP
    targets only where the next token is an answer token, MATP targets only at masked answer tokens, and the
    noise still applied to the prompt."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    prompt, answer = [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27]
    examples = [{"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}] * 8
    batch = hf.SbdDataCollator(model.config, block_min=4, block_max=4)(examples)
    n = len(prompt) + len(answer)
    clean, noisy = batch["input_ids"][:, :n], batch["input_ids"][:, n:]
    labels = batch["labels"]
    assert torch.equal(clean, torch.tensor([prompt + answer] * 8))
    expected_ntp = [-100] * (len(prompt) - 1) + answer + [-100]
    assert labels[:, :n].tolist() == [expected_ntp] * 8
    masked = noisy == MASK_ID
    assert masked[:, : len(prompt)].any(), "the noise covers the prompt too"
    target = torch.zeros(n, dtype=torch.bool)
    target[len(prompt):] = True
    assert torch.equal(labels[:, n:], torch.where(masked & target, clean, -100))
    assert (labels[:, n:] != -100).any()
    with pytest.raises(ValueError, match="length of input_ids"):
        hf.SbdDataCollator(model.config)([{"input_ids": prompt, "labels": prompt[:-1]}])


def assert_same_batch(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def test_collator_strips_the_padding_its_attention_mask_marks():
    """Guards against padded examples (a tokenizer's padding="max_length") being trained as if their pads were
    text: pads counted as NTP targets, attended as keys, and shifting the positions of left-padded text. Right-
    and left-padded examples give the batch of the unpadded one; an attention_mask with 0s between real tokens or
    of another length than input_ids is refused, naming attention_mask."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    text, labels = [5, 6, 7, 8], [-100, 6, 7, 8]

    def batch(*examples):
        return hf.SbdDataCollator(model.config, block_min=4, block_max=4, seed=1, rank=0)(list(examples))

    expected = batch({"input_ids": text, "labels": labels}, {"input_ids": text[:3]})
    right = {"input_ids": text + [0] * 4, "attention_mask": [1] * 4 + [0] * 4, "labels": labels + [-100] * 4}
    left = {"input_ids": [0] * 4 + text, "attention_mask": [0] * 4 + [1] * 4, "labels": [-100] * 4 + labels}
    short = {"input_ids": [0, 0] + text[:3] + [0], "attention_mask": torch.tensor([0, 0, 1, 1, 1, 0])}
    assert_same_batch(batch(right, short), expected)
    assert_same_batch(batch(left, short), expected)
    with pytest.raises(ValueError, match=r"attention_mask has 0s between real tokens \(at \[2\]\)"):
        batch({"input_ids": text, "attention_mask": [1, 1, 0, 1]})
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(4,\), got \(3,\)"):
        batch({"input_ids": text, "attention_mask": [1, 1, 1]})
    with pytest.raises(ValueError, match="attention_mask is all 0"):
        batch({"input_ids": text, "attention_mask": [0, 0, 0, 0]})


@pytest.mark.parametrize("pad_to_multiple_of", [0, -1, -8, 2.5, True])
def test_collator_refuses_a_pad_to_multiple_of_below_one(pad_to_multiple_of):
    """Guards against a bad `pad_to_multiple_of` reaching the padding arithmetic: 0 raised ZeroDivisionError, -8 a
    tensor size error naming neither, -1 was taken as 1 with no error. Refused when the collator is made, naming
    the setting."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    with pytest.raises(ValueError, match=rf"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of}"):
        hf.SbdDataCollator(model.config, pad_to_multiple_of=pad_to_multiple_of)


def test_collator_refuses_real_tokens_equal_to_the_mask_token():
    """Guards against text that contains the SBD mask token id being trained on without an error: the labels take
    a masked token for one the noise masked (MATP targets where it masked nothing) and the NTP half trains the
    model to emit the mask token. Refused, naming the example and the position in its input_ids; the same id in
    the padding an attention_mask marks is not text and passes."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    collator = hf.SbdDataCollator(model.config, seed=0, rank=0)
    clean = {"input_ids": [10, 11, 12, 13]}
    with pytest.raises(ValueError, match=rf"example 1 has the SBD mask token id {MASK_ID} in input_ids at "
                                         r"positions \[1, 2\]"):
        collator([clean, {"input_ids": [10, MASK_ID, MASK_ID, 14]}])
    padded = {"input_ids": [10, 11, 12, MASK_ID], "attention_mask": [1, 1, 1, 0]}
    assert collator([clean, padded])["input_ids"].shape == (2, 8)


def test_training_mask_refuses_lengths_and_block_sizes_out_of_range():
    """Guards against a training mask built from arguments it cannot mean: a length of 0 gave query rows with no
    allowed key (NaN outputs under sdpa), a length above n was taken, and block_size 0 raised "RuntimeError:
    ZeroDivisionError". Each is refused with a ValueError naming the argument, in every mask form."""
    for implementation in ("sdpa", "eager", "flex_attention"):
        with pytest.raises(ValueError, match=r"lengths must be in \[1, n\] = \[1, 3\], got \[0, 3\]"):
            hf.sbd_training_mask(torch.tensor([0, 3]), 3, 2, implementation)
        with pytest.raises(ValueError, match=r"lengths must be in \[1, n\] = \[1, 3\], got \[5\]"):
            hf.sbd_training_mask(torch.tensor([5]), 3, 2, implementation)
        with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
            hf.sbd_training_mask(torch.tensor([3]), 3, 0, implementation)
    with pytest.raises(ValueError, match=r"lengths must be \[B\], got shape \(1, 2\)"):
        hf.sbd_training_mask(torch.tensor([[2, 3]]), 3, 2, "sdpa")
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        hf.sbd_training_mask(torch.tensor([], dtype=torch.int64), 0, 2, "sdpa")
    assert hf.sbd_training_mask(torch.tensor([1, 3]), 3, 1, "sdpa").any(-1).all(), "no row without a key"


def collated(collator, data: list[dict], num_workers: int) -> list[dict]:
    from torch.utils.data import DataLoader

    return list(DataLoader(data, batch_size=2, collate_fn=collator, num_workers=num_workers))


def noise_of(batch: dict) -> torch.Tensor:
    n = batch["input_ids"].shape[1] // 2
    return batch["input_ids"][:, n:] == MASK_ID


def test_collator_draws_differ_across_workers_and_ranks(two_rank_group):
    """Guards against DataLoader workers (each a copy of the collator, with its generator and batch count) and
    ranks (rank defaulted to 0) drawing the same noise: every batch of a 2-worker loader had the noise of its
    neighbour. The noise differs between batches, workers and ranks (the rank taken from the process group by
    default); the block sizes follow the loader's batch order, equal for 0 and 2 workers and on every rank; a
    single-process collator gives the same batches for the same seed."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    data = [{"input_ids": list(range(3, 23))}] * 8                  # equal examples: only the draws differ
    in_workers = collated(hf.SbdDataCollator(model.config, seed=0, rank=0), data, num_workers=2)
    in_process = collated(hf.SbdDataCollator(model.config, seed=0, rank=0), data, num_workers=0)
    noises = [noise_of(b) for b in in_workers + in_process]
    assert all(not torch.equal(a, b) for i, a in enumerate(noises) for b in noises[i + 1:])
    sizes = [[int(b["attention_mask"][0, 0, 20:, 20:].sum(-1)[0]) for b in run] for run in (in_workers, in_process)]
    assert sizes[0] == sizes[1] and len(set(sizes[0])) > 1                # noisy row 0 sees its block of k
    default_rank = hf.SbdDataCollator(model.config, seed=0)             # rank 1 of the process group
    rank_one = hf.SbdDataCollator(model.config, seed=0, rank=1)(data[:2])
    assert_same_batch(default_rank(data[:2]), rank_one)
    assert not torch.equal(noise_of(rank_one), noise_of(in_process[0]))
    assert torch.equal(rank_one["attention_mask"], in_process[0]["attention_mask"]), "the same block size"
    again = collated(hf.SbdDataCollator(model.config, seed=0, rank=0), data, num_workers=0)
    for a, b in zip(again, in_process):
        assert_same_batch(a, b)


def test_trainer_default_columns_keep_the_prompt_out_of_the_targets(tmp_path):
    """Guards against the prompt being trained on under HF Trainer's default remove_unused_columns=True, which
    drops every column its model's forward does not name (a `loss_mask` column among them) before the collator:
    targets given as `labels` (-100: not a target) survive it, and a `loss_mask` the collator sees (its own loop,
    or remove_unused_columns=False) gives the same targets."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    prompt, answer = list(range(10, 16)), list(range(20, 28))
    data = [{"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}] * 4
    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[])
    assert args.remove_unused_columns
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=hf.SbdDataCollator(model.config), compute_loss_func=hf.sbd_loss_func)
    batch = next(iter(trainer.get_train_dataloader()))
    n = len(prompt) + len(answer)
    assert batch["labels"][:, :n].tolist() == [[-100] * (len(prompt) - 1) + answer + [-100]] * 2
    by_mask = hf.SbdDataCollator(model.config)([{"input_ids": prompt + answer, "loss_mask": [0] * 6 + [1] * 8}] * 2)
    assert torch.equal(by_mask["labels"], batch["labels"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_collator_eager_mask_is_in_the_models_dtype(dtype):
    """Guards against the additive eager mask being fp32 for a bf16 / fp16 model (scores promoted to fp32 [B, H, T,
    T] in every layer), where HF builds its eager masks in the model's dtype: the collator takes the dtype the
    config records, and the model's loss is the fp32 mask's."""
    config = tiny_config("llama", attn="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    examples = [{"input_ids": list(range(3, 3 + m))} for m in (5, 8)]
    batch = hf.SbdDataCollator(model.config, block_min=3, block_max=3)(examples)
    fp32 = hf.SbdDataCollator(model.config, block_min=3, block_max=3, dtype=torch.float32)(examples)
    mask = batch["attention_mask"]
    assert mask.dtype == dtype
    assert torch.equal(mask == 0, fp32["attention_mask"] == 0) and (mask[mask != 0] == torch.finfo(dtype).min).all()
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, model(**{**batch, "attention_mask": fp32["attention_mask"]}).loss)


@pytest.mark.parametrize("switch", ["reload", "set_attn_implementation"])
def test_training_masks_refuse_a_model_running_another_attention_than_enable_sbd_recorded(tmp_path, switch):
    """Guards against the SBD training mask being built for the attention implementation `enable_sbd` recorded
    while the model runs another: a model prepared under sdpa, then reloaded with attn_implementation="eager"
    (without enable_sbd) or switched by set_attn_implementation("eager"), got the boolean sdpa mask, which plain
    eager attention adds to the scores as 1 / 0: a wrong loss (12.53 instead of 14.45 on this model), no error.
    The collator (built before or after the switch) and the SbdCausalLM forward the plain-loop loss and hf.check
    use refuse and say to call enable_sbd again; after it the loss is that of the eager mask. A model reloaded
    with the recorded implementation trains without enable_sbd; a config loaded on its own, which cannot say what
    the model runs, is refused."""
    model = tiny_model("llama")
    adapter = hf.enable_sbd(model, mask_token_id=MASK_ID)
    examples = [{"input_ids": list(range(3, 15))}, {"input_ids": list(range(5, 12))}]
    collator = hf.SbdDataCollator(model.config, seed=1, rank=0)
    with torch.no_grad():
        expected = model(**collator(examples)).loss
    model.save_pretrained(tmp_path)
    same = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(same(**hf.SbdDataCollator(same.config, seed=1, rank=0)(examples)).loss, expected)
    refused = r"runs attention implementation 'eager', but enable_sbd recorded 'sdpa'.*enable_sbd\(model"
    if switch == "reload":
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    else:
        model.set_attn_implementation("eager")
        with pytest.raises(RuntimeError, match=f"SbdDataCollator: .*{refused}"):
            collator(examples)
        with pytest.raises(RuntimeError, match=f"SbdCausalLM.forward: .*{refused}"):
            adapter(torch.tensor([[3, 4, 5]]), attn_mask=torch.ones(1, 3, 3, dtype=torch.bool).tril())
    with pytest.raises(RuntimeError, match=f"SbdDataCollator: .*{refused}"):
        hf.SbdDataCollator(model.config, seed=1, rank=0)
    hf.enable_sbd(model)
    batch = hf.SbdDataCollator(model.config, seed=1, rank=0)(examples)
    assert batch["attention_mask"].is_floating_point()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).loss, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="pass the model's own config, model.config"):
        hf.SbdDataCollator(transformers.AutoConfig.from_pretrained(tmp_path))      # no attention implementation


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_masks_give_the_same_logits_as_unpadded_rows(family, attn):
    """Guards against padding changing the real rows of a padded SBD batch (noisy rows of a block straddling the
    end would attend padding), under each attention implementation's mask form."""
    if attn == "sdpa" and family in SDPA_REFUSED:
        pytest.skip(f"transformers has no sdpa path for {family} (the eager case covers it)")
    model = tiny_model(family, attn=attn)
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
    assert_logits_close(both[0, rows], one[0], f"{family}/{attn} padded rows")


def padded_batch(model, k: int = 3) -> dict:
    """An SBD batch of three sequences of different lengths (5, 8, 11 tokens: two of them padded)."""
    collator = hf.SbdDataCollator(model.config, block_min=k, block_max=k, seed=5)
    return collator([{"input_ids": list(range(3, 3 + m))} for m in (5, 8, 11)])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_collator_refuses_a_router_loss_it_cannot_feed(family):
    """Guards against MoE training failing deep inside HF's load-balancing loss ("The size of tensor a (66) must
    match the size of tensor b (1452)": it reads attention_mask as [B, T] and gets the 4-D SBD mask): the collator
    names output_router_logits when it is made, and at a batch once the config was switched after."""
    with pytest.raises(ValueError, match="output_router_logits is True"):
        padded_batch(hf.enable_sbd(tiny_model(family, output_router_logits=True), mask_token_id=MASK_ID).hf_model)
    model = hf.enable_sbd(tiny_model(family), mask_token_id=MASK_ID).hf_model
    collator = hf.SbdDataCollator(model.config, block_min=3, block_max=3)
    assert model(**collator([{"input_ids": [3, 4, 5, 6]}])).loss.isfinite()
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits is True"):
        collator([{"input_ids": [3, 4, 5, 6]}])


def test_eager_and_sdpa_mask_forms_mean_the_same():
    """Guards against the additive (eager) and boolean (sdpa) forms of the training mask meaning different things
    cell by cell."""
    lengths = torch.tensor([5, 8])
    allowed = hf.sbd_training_mask(lengths, 8, 3, "sdpa")
    additive = hf.sbd_training_mask(lengths, 8, 3, "eager", torch.float32)
    assert allowed.shape == additive.shape == (2, 1, 16, 16)
    assert torch.equal(additive == 0, allowed)
    assert torch.equal(additive[~allowed], torch.full_like(additive[~allowed], torch.finfo(torch.float32).min))


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_sdpa_give_the_same_logits_on_padded_batches(family):
    """Guards against the eager and sdpa forms of the padded training mask reading differently inside a real model
    of each family, on every row of the batch (padded rows included: no row of the mask is empty)."""
    if family in SDPA_REFUSED:
        pytest.skip(f"transformers has no sdpa path for {family}")
    logits, ids = {}, {}
    for attn in ("sdpa", "eager"):
        model = tiny_model(family, attn=attn, seed=1)
        hf.enable_sbd(model, mask_token_id=MASK_ID)
        batch = padded_batch(model)
        batch.pop("labels")
        ids[attn] = batch["input_ids"]
        with torch.no_grad():
            logits[attn] = model(**batch).logits
    assert torch.equal(ids["eager"], ids["sdpa"])
    assert_logits_close(logits["eager"], logits["sdpa"], f"{family} eager vs sdpa")


def test_flex_block_mask_equals_the_dense_mask_cell_by_cell():
    """Guards against the FlexAttention form of the padded training mask differing from the dense one."""
    lengths = torch.tensor([5, 8])
    block_mask = hf.sbd_training_mask(lengths, 8, 3, "flex_attention")
    q, kv = torch.arange(16)[:, None], torch.arange(16)[None, :]
    dense = hf.sbd_training_mask(lengths, 8, 3, "sdpa")
    for b in range(2):
        assert torch.equal(block_mask.mask_mod(torch.tensor(b), 0, q, kv), dense[b, 0])


def mask_tensors(block_mask) -> dict[str, torch.Tensor]:
    """Every tensor a BlockMask reads: its own, and those of its mask_mod (fields or closure cells)."""
    found = {name: v for name, v in vars(block_mask).items() if isinstance(v, torch.Tensor)}
    mask_mod = block_mask.mask_mod
    held = vars(mask_mod) if hasattr(mask_mod, "__dataclass_fields__") else {
        f"closure[{i}]": c.cell_contents for i, c in enumerate(mask_mod.__closure__ or ())}
    found.update({f"mask_mod.{name}": v for name, v in held.items() if isinstance(v, torch.Tensor)})
    return found


def test_flex_training_mask_moves_to_the_device_as_a_whole():
    """Guards against a BlockMask whose `.to(device)` (what accelerate's data loader calls on each batch under HF
    Trainer) moves its block tensors but leaves the lengths and block size its mask_mod reads on the CPU: on CUDA the
    mask_mod would then index a CPU tensor. After the move every tensor is on the target device, and moved back
    the mask is the same cell by cell."""
    from accelerate.utils import send_to_device

    model = tiny_model("llama", attn="flex_attention")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    block_mask = padded_batch(model)["attention_mask"]
    moved = send_to_device(padded_batch(model), torch.device("meta"))["attention_mask"]
    tensors = mask_tensors(moved)
    assert {"mask_mod.n_tensor", "mask_mod.lengths", "mask_mod.block_size", "kv_indices"} <= set(tensors)
    assert {name: t.device.type for name, t in tensors.items()} == dict.fromkeys(tensors, "meta")
    original = mask_tensors(block_mask)
    assert {t.device.type for t in original.values()} == {"cpu"}, "the original stays"
    assert {name: (t.shape, t.dtype) for name, t in tensors.items()} == {
        name: (t.shape, t.dtype) for name, t in original.items()}

    # Meta tensors hold no data: the same move path, to the CPU, must give the same mask cell by cell.
    back = send_to_device({"attention_mask": block_mask}, torch.device("cpu"))["attention_mask"]
    assert back is not block_mask and type(back) is type(block_mask)
    q, kv = torch.arange(2 * 11)[:, None], torch.arange(2 * 11)[None, :]
    for b in range(3):
        assert torch.equal(back.mask_mod(torch.tensor(b), 0, q, kv), block_mask.mask_mod(torch.tensor(b), 0, q, kv))
    assert torch.equal(back.mask_mod.dense(), block_mask.mask_mod.dense())
    for name, t in original.items():
        assert torch.equal(mask_tensors(back)[name], t), name


def test_compiled_flex_attention_reads_each_batchs_sequence_length():
    """Guards against the FlexAttention training mask keeping the first batch's sequence length: transformers runs
    `torch.compile(flex_attention)`, which recompiles with dynamic shapes at the first batch of another padded
    length, and a mask_mod holding n as a Python int then masked every later batch with the first batch's n (on a
    Llama, 26 of 52 real rows of the n = 24 batch wrong after one of n = 17; no error). Batches of n = 17, 24,
    17 in turn, each against sdpa on the dense form of the same mask."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()                    # compile from scratch: the first batch's shape is the static one
    compiled = torch.compile(flex_attention)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 17])
    for n in (17, 24, 17):
        q, k, v = (torch.randn(2, 2, 2 * n, 8, generator=generator) for _ in range(3))
        block_mask = hf.sbd_training_mask(lengths, n, 6, "flex_attention")
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=hf.sbd_training_mask(lengths, n, 6, "sdpa"))
        torch.testing.assert_close(compiled(q, k, v, block_mask=block_mask), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, n=n: f"n = {n}: {m}")


@pytest.mark.slow
def test_flex_attention_model_gives_the_sdpa_loss_on_batches_of_changing_length():
    """Guards against a wrong training loss, with no error, once the padded length of the batches changes under
    HF's flex_attention path (see `test_compiled_flex_attention_reads_each_batchs_sequence_length`): collator
    batches of n = 17, 24, 17 through one flex_attention model give the logits and loss of the same batches under
    sdpa."""
    torch._dynamo.reset()                    # HF's compiled flex_attention starts from the first batch's shape
    models = {attn: tiny_model("llama", attn=attn) for attn in ("flex_attention", "sdpa")}
    for model in models.values():
        hf.enable_sbd(model, mask_token_id=MASK_ID)
    examples = [{"input_ids": list(range(10, 19))}, {"input_ids": list(range(20, 37))}]       # 9 and 17 tokens
    for pad in (1, 8, 1):                                                                       # n = 17, 24, 17
        out = {}
        for attn, model in models.items():
            collator = hf.SbdDataCollator(model.config, seed=11, rank=0, pad_to_multiple_of=pad, block_min=6,
                                          block_max=6)
            with torch.no_grad():
                out[attn] = model(**collator(examples))
        name = f"flex vs sdpa, pad_to_multiple_of={pad}"
        assert_logits_close(out["flex_attention"].logits, out["sdpa"].logits, name)
        torch.testing.assert_close(out["flex_attention"].loss, out["sdpa"].loss, atol=1e-5, rtol=1e-5)


def test_flex_attention_refuses_a_mask_on_another_device_than_the_query():
    """Guards against a FlexAttention mask whose tensors (or a closure's captured index tensors) sit on another
    device than the query reaching the kernel, where the mask_mod would index them from the wrong device."""
    from torch.nn.attention.flex_attention import create_block_mask

    model = tiny_model("llama", attn="flex_attention")
    hf.enable_sbd(model, mask_token_id=MASK_ID)
    batch = padded_batch(model)
    batch.pop("labels")
    with pytest.raises(RuntimeError, match="tensors are on meta, the query on cpu"):
        model(**{**batch, "attention_mask": batch["attention_mask"].to("meta")})
    lengths = torch.tensor([5, 8, 11])

    def closure_mask_mod(b, h, q, kv):
        return (kv <= q) & (kv < lengths[b])

    cpu_mask = create_block_mask(closure_mask_mod, B=3, H=None, Q_LEN=22, KV_LEN=22, device="cpu")
    lengths = lengths.to("meta")                                    # the closure now reads a meta tensor
    with pytest.raises(RuntimeError, match="cpu, meta, the query on cpu"):
        model(**{**batch, "attention_mask": cpu_mask})


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3_text", {"sliding_window": 6})],
                         ids=["llama", "gemma3_text-past-the-window"])
def test_trainer_runs_the_sbd_objective(tmp_path, family, overrides):
    """Guards against the collator's batch not fitting HF Trainer (labels popped for compute_loss_func, the 4-D
    mask or a dict of them by layer type, repeated position ids) or the loss not being optimised."""
    model = tiny_model(family, **overrides)
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
    from pathlib import Path

    worker = Path(__file__).with_name("hf_distributed_worker.py")
    proc = run_torchrun([str(worker), mode, str(tmp_path)], tmp_path, timeout=300)
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


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_graph_safe_steps_give_the_eager_tokens_through_hf(sbd_model, method):
    """Guards against the HF decode pass rebinding SbdCache or state buffers (CUDA-graph replays would read stale
    memory) or syncing with the host: the replay wrapper's checks, run on CPU without capturing, pass for the NTP
    and SBD steps of every family, and the tokens equal the eager ones; but for the families whose own code
    `family_host_sync_reason` refuses, where the checks name what a capture would refuse."""
    from sbd_kernels.generate import EAGER_STEPS
    from sbd_kernels.graphs import graphed_steps
    from sbd_kernels.hf.generation import family_host_sync_reason

    cfg = DecodeConfig(method=method, block_size=4, gamma=0.5, max_new_tokens=10)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    if family_host_sync_reason(sbd_model.hf_model.config) is not None:
        with pytest.raises(RuntimeError, match="_step: the step ran .*, which a CUDA graph capture refuses"):
            generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, steps=graphed_steps(EAGER_STEPS, "check"))
        return
    checked = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, steps=graphed_steps(EAGER_STEPS, "check"))
    eager = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0)
    assert checked.tokens == eager.tokens and torch.equal(checked.nfe, eager.nfe)


# Families whose windowed layers (W = 6, shorter than the decodes) run `torch_block_attention`, each with its own
# departure on that path, and the backend each compiles with: Gemma 3 the plain window, through Inductor (64 s on
# the 2-core AMD EPYC Zen 4, most of it C++ code generation); GPT-OSS the attention sinks and Gemma 4 the layers
# that read another layer's KV rows (and per-layer head sizes), through aot_eager (4-11 s): the same full-graph
# Dynamo trace, which is what finds a graph break or a host sync, and AOT autograd's trace, without Inductor.
COMPILED_DECODE_FAMILIES = (("gemma3_text", "inductor"), ("gpt_oss", "aot_eager"), ("gemma4_text", "aot_eager"))


@pytest.mark.parametrize("family", [name for name, _ in COMPILED_DECODE_FAMILIES])
@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_graph_safe_steps_past_the_window_give_the_eager_tokens(family, method):
    """Guards against the windowed path (a cache longer than the window) rebinding the cache or reading the host:
    the replay wrapper's static-buffer checks pass for a model with W = 6 decoding past it (the plain window, the
    sinks, the KV-shared layers), and the tokens equal the eager ones."""
    from sbd_kernels.generate import EAGER_STEPS
    from sbd_kernels.graphs import graphed_steps

    sbd_model = hf.enable_sbd(tiny_model(family, sliding_window=6).to(DEVICE), mask_token_id=MASK_ID, block_size=4)
    cfg = DecodeConfig(method=method, block_size=4, gamma=0.5, max_new_tokens=12)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    checked = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, steps=graphed_steps(EAGER_STEPS, "check"))
    eager = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0)
    assert checked.tokens == eager.tokens and torch.equal(checked.nfe, eager.nfe)


def prefilled_decode_pass_args(sbd_model) -> tuple:
    """The arguments of one decode pass (C = 2 causal slots, K = 4 block rows, causal counts 2 and 1) on a fresh
    cache after a prefill of 3 and 2 tokens: (tokens, num_causal, block_size, cache)."""
    cache = sbd_model.new_cache(2, 16)
    sbd_model.decode_pass(torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.tensor([3, 2], dtype=torch.int32), 0, cache)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    return tokens, torch.tensor([2, 1], dtype=torch.int32), 4, cache


def compiled_and_eager_decode_pass(sbd_model) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode pass (`prefilled_decode_pass_args`), eagerly and under torch.compile(fullgraph=True)
    with Dynamo's trace alone (backend "eager"): a host read in the pass (.nonzero(), .item(), a Python branch on a
    tensor) breaks the trace."""
    torch._dynamo.reset()
    compiled = torch.compile(sbd_model.decode_pass, fullgraph=True, backend="eager")
    return tuple(decode_pass(*prefilled_decode_pass_args(sbd_model)) for decode_pass in (sbd_model.decode_pass, compiled))


def decode_pass_host_syncs(sbd_model) -> list[str]:
    """What one decode pass (`prefilled_decode_pass_args`) runs that a CUDA graph capture refuses
    (`graphs.host_syncs`)."""
    from sbd_kernels.graphs import host_syncs

    return host_syncs(sbd_model.decode_pass, *prefilled_decode_pass_args(sbd_model))[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_pass_is_graph_safe_unless_refused(family):
    """Guards against a family whose decode pass syncs with the host, or copies host data to the GPU, reaching a
    CUDA-graph capture, which would fail deep inside CUDA: each family's pass runs nothing a capture refuses
    (`graphs.host_syncs`: host reads, outputs sized by values, tensors built from Python data on the device) and
    traces in one graph under torch.compile(fullgraph=True) with the eager logits; but a family whose own code
    `family_host_sync_reason` refuses (DBRX's experts loop, PhiMoE's rotary frequencies computed on the host,
    Gemma 3n's activation sparsity) does run such operations, and its `cuda_graph=True` is refused with the
    reason, before any CUDA check. (The experts' grouped GEMM takes another
    path on the CPU than on a GPU: `test_cuda_graph_is_refused_for_experts_that_sync` covers it.)"""
    from sbd_kernels.hf.generation import family_host_sync_reason

    model = tiny_model(family)
    sbd_model = hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    reason = family_host_sync_reason(model.config)
    with torch.no_grad():
        found = decode_pass_host_syncs(sbd_model)
    if reason is None:
        assert found == [], f"{family}'s decode pass runs {found}, which a CUDA graph capture refuses"
        eager, compiled = compiled_and_eager_decode_pass(sbd_model)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        return
    assert found, f"{family} is refused ({reason}), but its decode pass runs nothing a capture refuses"
    with pytest.raises(ValueError, match=re.escape(f"generate: cuda_graph=True captures the decode steps in CUDA "
                                                   f"graphs, which cannot hold a host sync, and {reason}")):
        hf.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, cuda_graph=True)


def test_gemma3n_is_graph_safe_without_activation_sparsity():
    """Guards against refusing every Gemma 3n model for the activation sparsity of some: with none in any layer,
    its decode pass runs nothing a capture refuses and `cuda_graph=True` is not refused for it; but on
    transformers before 5.23, whose Gemma 3n copies a host tensor to the device in every pass, it is refused and
    the scan sees the copy."""
    from sbd_kernels.hf.generation import HOST_SYNC_BEFORE, host_sync_reason

    model = tiny_model("gemma3n_text", activation_sparsity_pattern=[0.0] * 4)
    with torch.no_grad():
        found = decode_pass_host_syncs(hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4))
    if Version(transformers.__version__) >= HOST_SYNC_BEFORE["gemma3n"][0]:
        assert host_sync_reason(model) is None and found == []
    else:
        assert "(fixed in 5.23)" in host_sync_reason(model) and found == ["Tensor.to(<a device>) of a CPU tensor"]


@pytest.mark.parametrize("family, version, words", [
    ("gemma3n_text", "5.17.0", ("text model copies a host tensor to the device in every pass (AltUp's magnitude "
                               "normalisation builds torch.tensor(1e-5) on the host; 5.13-5.22) in transformers "
                               '5.17.0 (fixed in 5.23); upgrade: pip install "transformers>=5.23"')),
    ("gemma3n_text", "5.22.2", "in transformers 5.22.2 (fixed in 5.23)"),
    ("gemma3n_text", "5.23.0", None),
    ("aria_text", "5.17.0", ("experts read their token counts on the host in every MoE layer (AriaGroupedExpertsGemm: "
                            "tokens_per_expert.cpu(); 5.13-5.17) in transformers 5.17.0 (fixed in 5.18); upgrade: pip "
                            'install "transformers>=5.18"')),
    ("aria_text", "5.18.0", None)])
def test_cuda_graph_is_refused_for_host_syncs_of_older_transformers(monkeypatch, family, version, words):
    """Guards against a decode on a transformers release whose code for the family syncs with the host in every
    pass (GPU images carry 5.17) reaching a CUDA-graph capture, which refuses it: `cuda_graph=True` is refused
    there naming the release and the upgrade, and not from the release that fixed it. (On a release before the
    fix, `test_decode_pass_is_graph_safe_unless_refused` checks that the scan sees what is named.)"""
    from sbd_kernels.hf.generation import family_host_sync_reason

    overrides = {"activation_sparsity_pattern": [0.0] * 4} if family == "gemma3n_text" else {}
    model = tiny_model(family, **overrides)
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    monkeypatch.setattr(transformers, "__version__", version)
    if words is None:
        assert family_host_sync_reason(model.config) is None
        return
    with pytest.raises(ValueError, match=re.escape(f"{family}'s ") + ".*" + re.escape(words)):
        hf.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, cuda_graph=True)


def test_cuda_graph_is_refused_for_experts_that_sync():
    """Guards against an MoE model whose experts would sync with the host on a GPU reaching a CUDA-graph capture:
    transformers' "eager" experts (a loop over the experts hit; the pass's trace breaks on it) and its
    "grouped_mm" on other weights than bf16 (torch's CUDA grouped GEMM then loops over the experts, their offsets
    read on the host) are refused by both entry points, naming the experts and the way out; "batched_mm", and
    "grouped_mm" on bf16 weights, are not."""
    from sbd_kernels.hf.generation import host_sync_reason

    model = tiny_model("mixtral")
    sbd_model = hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7]])
    start = "cuda_graph=True captures the decode steps in CUDA graphs, which cannot hold a host sync, and its experts "
    refusals = {"eager": "(model.layers.0.mlp.experts, ...) run transformers' 'eager' experts implementation, a loop",
                "grouped_mm": "(model.layers.0.mlp.experts, ...) run transformers' 'grouped_mm' on torch.float32 "
                              "weights, which torch's CUDA grouped GEMM takes in bf16 only"}
    for implementation, words in refusals.items():
        model.set_experts_implementation(implementation)
        with pytest.raises(ValueError, match=re.escape(f"generate: {start}{words}")):
            hf.generate(model, ids, max_new_tokens=4, cuda_graph=True)
        with pytest.raises(ValueError, match=re.escape(f"sbd_generate: {start}{words}")):
            model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, cuda_graph=True)
    model.set_experts_implementation("eager")
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        compiled_and_eager_decode_pass(sbd_model)
    model.set_experts_implementation("batched_mm")
    assert host_sync_reason(model) is None
    eager, compiled = compiled_and_eager_decode_pass(sbd_model)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    model.set_experts_implementation("grouped_mm")
    assert host_sync_reason(model.to(torch.bfloat16)) is None


def test_experts_are_found_without_the_expert_parallel_flag():
    """Guards against missing the experts of every MoE model on transformers 5.13-5.17, whose experts modules lack
    the `_is_expert_parallel` flag that 5.18 added: without it, 'eager' experts are still refused for
    `cuda_graph=True`."""
    from sbd_kernels.hf.generation import host_sync_reason

    model = tiny_model("mixtral")
    model.set_experts_implementation("eager")
    for module in model.modules():
        if hasattr(module, "_is_expert_parallel"):
            del module._is_expert_parallel
    assert "(model.layers.0.mlp.experts, ...) run transformers' 'eager' experts" in host_sync_reason(model)


def test_cuda_graph_needs_a_cuda_model_through_hf():
    """Guards against `cuda_graph=True` on a CPU model silently decoding eagerly, through either entry point."""
    model = tiny_model("llama")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device, it is on cpu"):
        hf.generate(model, ids, max_new_tokens=4, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf.sbd_generate, cuda_graph=True)


@pytest.mark.parametrize("graphs", cuda_graph_mode_params(DEVICE))
@pytest.mark.parametrize("family", ["qwen3", "mixtral", *(name for name, _ in COMPILED_DECODE_FAMILIES)])
@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_cuda_graph_decode_through_hf_gives_the_eager_tokens(family, method, graphs, monkeypatch):
    """Guards against replayed decode steps of an HF model differing from the eager decode (a buffer rebound
    between capture and replay, a host sync captured, positions read from a stale cache length), through the op
    alone (Qwen 3; Mixtral with its experts run by transformers' grouped_mm, in bf16: torch's CUDA grouped GEMM
    loops on the host in other dtypes) and through `torch_block_attention` too (windowed layers with W = 6
    decoding past it; GPT-OSS's experts by batched_mm, in fp32). Rehearsed on any device (graphs "check"): the
    same decodes under the static-buffer checks, without the capture."""
    rehearse_cuda_graphs(monkeypatch, graphs)
    overrides = {"sliding_window": 6} if family in dict(COMPILED_DECODE_FAMILIES) else {}
    model = tiny_model(family, **overrides).to(DEVICE, torch.bfloat16 if family == "mixtral" else torch.float32)
    if family == "gpt_oss":
        model.set_experts_implementation("batched_mm")
    hf.enable_sbd(model, mask_token_id=MASK_ID, block_size=4)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]], device=DEVICE)
    mask = (ids != 0).long()
    settings = {"max_new_tokens": 12, "method": method, "gamma": 0.5, "eos_token_id": []}
    eager = hf.generate(model, ids, mask, **settings)
    graphed = hf.generate(model, ids, mask, cuda_graph=True, **settings)
    assert torch.equal(graphed.sequences, eager.sequences) and torch.equal(graphed.nfe, eager.nfe)
    via_hf = model.generate(ids, attention_mask=mask, max_new_tokens=12, custom_generate=hf.sbd_generate,
                            method=method, gamma=0.5, cuda_graph=True, eos_token_id=[1000], pad_token_id=0)
    assert torch.equal(via_hf, eager.sequences)


@pytest.mark.slow
@pytest.mark.parametrize("family, backend", COMPILED_DECODE_FAMILIES)
def test_hf_decode_steps_compile_without_graph_breaks(family, backend):
    """Guards against the HF decode pass (the "sbd" attention, SbdCache, positions built from the cache lengths)
    graph-breaking or syncing, through the op and through the PyTorch path: both SBD step layouts and the NTP step
    under torch.compile(fullgraph=True) give the eager tokens, on a model whose full layer runs the op and whose
    windowed layer (W = 6, shorter than the decodes) runs `torch_block_attention`."""
    import dataclasses

    from sbd_kernels import generate as gen

    torch._dynamo.reset()
    sbd_model = hf.enable_sbd(tiny_model(family, sliding_window=6), mask_token_id=MASK_ID, block_size=4)
    compiled_steps = {name: torch.compile(getattr(gen, name), fullgraph=True, backend=backend)
                      for name in ("sbd_block_step", "ntp_decode_step")}
    steps = dataclasses.replace(gen.EAGER_STEPS, **compiled_steps)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    for cfg in (DecodeConfig(method="sbd", block_size=4, gamma=0.5, max_new_tokens=10),
                DecodeConfig(method="ntp", max_new_tokens=6)):
        compiled = generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0, steps=steps)
        assert compiled.tokens == generate(sbd_model, prompts, cfg, eos_id=1, pad_id=0).tokens, cfg.method


def assert_flex_mask_gives_the_sdpa_logits(family: str, device: str) -> None:
    """The logits and loss of a padded SBD batch through HF's flex_attention path (our BlockMask) equal those of
    its sdpa path (our boolean mask; eager where the family refuses sdpa), on `device`. FlexAttention compiled on
    the CPU sums in another order than SDPA: up to 1.4e-4 apart on logits of magnitude up to 25 (granitemoe, glm4,
    phimoe on an AMD EPYC Zen 4; the MoE routers' softmax widens it), 4.9e-4 on nemotron (squared-ReLU MLP),
    hence atol 6e-4; a wrong mask cell moves logits by O(1)."""
    # KV sharing refuses flex under SBD in the Gemma 4 families
    overrides = {"num_kv_shared_layers": 0} if family in ("gemma4_text", "gemma4_unified_text") else {}
    out = {}
    for attn in ("flex_attention", "sdpa"):
        model = tiny_model(family, attn=attn, seed=2, **overrides).to(device)
        hf.enable_sbd(model, mask_token_id=MASK_ID)
        # windowed families' masks are a dict per layer type
        batch = torch.utils._pytree.tree_map(lambda value: value.to(device), padded_batch(model, k=4))
        with torch.no_grad():
            out[attn] = model(**batch)
    assert_close(out["flex_attention"].logits, out["sdpa"].logits, torch.float32, name=f"{family} flex vs sdpa",
                 atol_scale=30)
    torch.testing.assert_close(out["flex_attention"].loss, out["sdpa"].loss, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_flex_attention_training_mask_gives_the_sdpa_logits(family):
    """Guards against the FlexAttention BlockMask form of the padded training mask reading differently from the
    boolean sdpa form inside a real model of each family (HF's flex_attention path, compiled on the CPU here), on
    every row of a padded batch, and against the model's own loss differing."""
    if not transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(tiny_config(family))]._supports_flex_attn:
        pytest.skip(f"transformers has no flex_attention path for {family} (it refuses to load one)")
    if family in SINK_FAMILIES:
        pytest.skip("transformers runs no attention sinks under flex_attention on the CPU (the CUDA-only test does)")
    assert_flex_mask_gives_the_sdpa_logits(family, "cpu")


@pytest.mark.cuda_only
@pytest.mark.skipif(DEVICE != "cuda", reason="transformers runs attention sinks under flex_attention on a GPU only")
def test_flex_attention_training_mask_with_sinks_gives_the_eager_logits():
    """Guards against the FlexAttention BlockMask of the padded training mask reading differently from the
    boolean form in a model with attention sinks (GPT-OSS: HF renormalises flex_attention's output by the sinks
    through its log-sum-exp), on every row of a padded batch: the logits and the loss equal those of HF's eager
    attention with the boolean mask."""
    assert_flex_mask_gives_the_sdpa_logits("gpt_oss", DEVICE)


def test_decode_pass_arguments_that_disagree_with_tokens_are_named():
    """Guards against keep_last -1 silently dropping the first row, and against a cache of another batch failing
    deep inside HF's attention with an error that names another tensor."""
    model = hf.enable_sbd(tiny_model("llama").to(DEVICE), mask_token_id=MASK_ID, block_size=4)
    tokens = torch.randint(0, 60, (2, 5), device=DEVICE)
    causal = torch.tensor([2, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("SbdCausalLM.decode_pass: keep_last must be in [0, C + K] = "
                                                   "[0, 5] (tokens [2, 5]), got -1")):
        model.decode_pass(tokens, causal, 3, model.new_cache(2, 16), keep_last=-1)
    with pytest.raises(ValueError, match=re.escape("SbdCausalLM.decode_pass: cache.seqlens must have shape [B] = "
                                                   "[2] (tokens [2, 5]), got [3]")):
        model.decode_pass(tokens, causal, 3, model.new_cache(3, 16))

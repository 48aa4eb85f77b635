"""Reference model: forward modes, the cached decode pass against a full recompute, checkpoints."""
import dataclasses
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from sbd_kernels.model import (
    CHAR_MASK_TOKEN_ID,
    CheckpointError,
    KVCache,
    ModelConfig,
    Transformer,
    load_checkpoint,
    save_checkpoint,
)
from sbd_kernels.ops.attention.naive import block_attention_with_kvcache as naive_attention
from sbd_kernels.tasks import TOKENIZER
from sbd_kernels.testing import assert_close, poison_

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = REPO / "sbd_kernels" / "checkpoints"
ATTENTION_OPS = {"naive": naive_attention, "cpp": torch.ops.sbd.block_attention_with_kvcache}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny")).to(dtype).eval()


def random_tokens(*shape: int) -> torch.Tensor:
    return torch.randint(TOKENIZER.reserved, TOKENIZER.vocab_size, shape)


def recompute_mask(prefix: int, block: int) -> torch.Tensor:
    """docs/algorithm.md §3.10: causal over the first `prefix` tokens; the `block` rows after them see all."""
    t = prefix + block
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[prefix:, :] = True
    return mask


@pytest.mark.parametrize("name", ["tiny", "small", "llama3.1-8b", "qwen3-8b"])
def test_presets(name):
    """Guards against presets with shapes that break GQA (heads not divisible) or a mask id outside
    the vocabulary."""
    cfg = ModelConfig.preset(name)
    assert cfg.n_heads % cfg.n_kv_heads == 0 and cfg.head_dim * cfg.n_heads == cfg.dim
    assert 0 <= cfg.mask_token_id < cfg.vocab_size


def test_preset_shapes_of_the_8b_models():
    """Guards against benchmark shapes drifting from the published Llama-3.1-8B / Qwen3-8B configs."""
    llama, qwen = ModelConfig.preset("llama3.1-8b"), ModelConfig.preset("qwen3-8b")
    assert (llama.dim, llama.n_layers, llama.n_heads, llama.n_kv_heads, llama.ffn_dim, llama.vocab_size) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert (qwen.dim, qwen.n_layers, qwen.n_heads, qwen.n_kv_heads, qwen.ffn_dim, qwen.vocab_size) == \
        (4096, 36, 32, 8, 12288, 151936)
    assert llama.head_dim == qwen.head_dim == 128


def test_unknown_preset_and_bad_config_name_the_problem():
    """Guards against silent fallbacks on a typo in a preset name or inconsistent head counts."""
    with pytest.raises(ValueError, match="unknown name"):
        ModelConfig.preset("tinyy")
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(vocab_size=48, dim=32, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=64, max_seq_len=16)


def test_odd_head_dim_is_rejected_by_the_config():
    """Guards against a config whose head dimension RoPE cannot rotate (pairs of features) failing only at the
    first forward with a shape error, when built without the checkpoint loader."""
    with pytest.raises(ValueError, match=r"head_dim 3 must be even \(dim 12 / n_heads 4"):
        ModelConfig(vocab_size=48, dim=12, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=8, max_seq_len=16)


def test_character_presets_fit_the_tokenizer():
    """Guards against the model's mask id and the tokenizer's reserved mask id disagreeing."""
    for name in ("tiny", "small"):
        cfg = ModelConfig.preset(name)
        assert cfg.mask_token_id == TOKENIZER.MASK == CHAR_MASK_TOKEN_ID
        assert cfg.vocab_size >= TOKENIZER.vocab_size


def test_forward_defaults_are_causal_with_arange_positions():
    """Guards against the default mask or positions differing from an explicit causal mask + arange."""
    model = tiny_model()
    tokens = random_tokens(2, 13)
    explicit = model(tokens, torch.arange(13).expand(2, 13), torch.ones(1, 13, 13, dtype=torch.bool).tril())
    assert_close(model(tokens), explicit, torch.float32)
    assert model(tokens).dtype == torch.float32


def test_forward_is_causal():
    """Guards against future tokens leaking into earlier logits (a wrong mask orientation)."""
    model = tiny_model()
    tokens = random_tokens(1, 12)
    changed = tokens.clone()
    changed[0, 8:] = random_tokens(1, 4)
    assert_close(model(changed)[:, :8], model(tokens)[:, :8], torch.float32)


def test_sbd_train_forward_halves():
    """Guards against the noisy half leaking into the clean half, and against wrong position ids or
    block boundaries in the noisy half: each noisy block must equal a separate recompute of
    [clean prefix before the block ; noisy block] with the block rows seeing everything."""
    model, n, k = tiny_model(), 11, 4
    clean, noisy = random_tokens(2, n), random_tokens(2, n)
    noisy[:, ::3] = CHAR_MASK_TOKEN_ID
    logits = model.sbd_train_forward(clean, noisy, k)
    assert logits.shape == (2, 2 * n, model.config.vocab_size)
    assert_close(logits[:, :n], model(clean), torch.float32, name="clean half")
    for start in range(0, n, k):
        stop = min(start + k, n)
        seq = torch.cat([clean[:, :start], noisy[:, start:stop]], dim=1)
        expected = model(seq, attn_mask=recompute_mask(start, stop - start)[None])[:, start:]
        assert_close(logits[:, n + start: n + stop], expected, torch.float32, name=f"noisy block {start}")


def _prefill(model, prompts, lengths, cache, op):
    return model.decode_pass(prompts, lengths, 0, cache, attention_op=op)


@pytest.mark.parametrize("op_name", ["naive", "cpp"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_decode_pass_equals_full_recompute(op_name, block_size):
    """Guards against a cached pass diverging from the full recompute of docs/algorithm.md §3.10 (wrong RoPE
    positions for causal/block rows, a wrong cache length, block K/V leaking into the cache): prefill
    rows of different lengths, then one [causal ; block] pass with num_causal = 0, 2, C, then a
    block-only pass; every valid row's logits must match a no-cache forward with the 3.10 mask."""
    model, op = tiny_model(), ATTENTION_OPS[op_name]
    prompt_lens = torch.tensor([9, 4, 6], dtype=torch.int32)
    seqs = random_tokens(3, 40)
    cache = model.new_cache(3, 48)
    for t in cache.k + cache.v:
        poison_(t)  # unwritten slots must never be read
    prefill = _prefill(model, seqs[:, :9], prompt_lens, cache, op)
    for b, length in enumerate(prompt_lens.tolist()):
        assert_close(prefill[b, :length], model(seqs[b: b + 1, :length])[0], torch.float32, name="prefill")

    num_causal, slots = torch.tensor([0, 2, 3], dtype=torch.int32), 3
    block = random_tokens(3, block_size)
    block[:, ::2] = CHAR_MASK_TOKEN_ID
    rows = torch.stack([seqs[b, L: L + slots] for b, L in enumerate(prompt_lens.tolist())])
    for pass_tokens, causal in ((torch.cat([rows, block], 1), num_causal),
                                (block, torch.zeros(3, dtype=torch.int32))):
        lengths_before = cache.seqlens.clone()
        logits = model.decode_pass(pass_tokens, causal, block_size, cache, attention_op=op)
        assert torch.equal(cache.seqlens, lengths_before + causal)
        c_slots = pass_tokens.shape[1] - block_size
        for b in range(3):
            L, c = int(lengths_before[b]), int(causal[b])
            prefix = seqs[b, : L + c]
            mask = recompute_mask(L + c, block_size)[None]
            full = model(torch.cat([prefix, block[b]])[None], attn_mask=mask)
            assert_close(logits[b, :c], full[0, L: L + c], torch.float32, name=f"row {b} causal")
            assert_close(logits[b, c_slots:], full[0, L + c:], torch.float32, name=f"row {b} block")
    for t in cache.k:
        for b, length in enumerate(cache.seqlens.tolist()):
            assert not t[b, :length].isnan().any(), "a cached slot was not written"
            assert t[b, length:].isnan().all(), "block or padding K/V was written to the cache"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_pass_low_precision(dtype):
    """Guards against a half-precision cache or model breaking the cached pass (dtype mismatches
    between q and the cache, fp32 logits contract): compared with the same model's no-cache forward."""
    model = tiny_model(dtype)
    tokens = random_tokens(2, 10)
    cache = model.new_cache(2, 32)
    assert cache.k[0].dtype == dtype
    logits = model.decode_pass(tokens, torch.tensor([10, 10], dtype=torch.int32), 0, cache)
    assert logits.dtype == torch.float32
    assert_close(logits, model(tokens), dtype, atol_scale=4.0)


@pytest.mark.parametrize("change, words", [
    ({"keep_last": -1}, "keep_last must be in [0, C + K] = [0, 5] (tokens [2, 5]), got -1"),
    ({"keep_last": 6}, "keep_last must be in [0, C + K] = [0, 5] (tokens [2, 5]), got 6"),
    ({"block_size": 6}, "block_size must be in [0, C + K] = [0, 5] (tokens [2, 5]), got 6"),
    ({"block_size": -1}, "block_size must be in [0, C + K] = [0, 5] (tokens [2, 5]), got -1"),
    ({"num_causal": torch.tensor([2], dtype=torch.int32)},
     "num_causal must have shape [B] = [2] (tokens [2, 5]), got [1]"),
    ({"cache_batch": 3}, "cache.seqlens must have shape [B] = [2] (tokens [2, 5]), got [3]"),
    ({"tokens": random_tokens(1, 2, 5)}, "tokens must be [B, C + K], got shape [1, 2, 5]"),
])
def test_decode_pass_arguments_that_disagree_with_tokens_are_named(change, words):
    """Guards against keep_last -1 silently dropping the first row, and against a num_causal or cache of another
    batch failing deep inside with an error that names another tensor."""
    model = tiny_model()
    args = {"tokens": random_tokens(2, 5), "num_causal": torch.tensor([2, 2], dtype=torch.int32), "block_size": 3,
            "keep_last": 0, "cache_batch": 2, **change}
    cache = model.new_cache(args["cache_batch"], 16)
    with pytest.raises(ValueError, match=re.escape(f"Transformer.decode_pass: {words}")):
        model.decode_pass(args["tokens"], args["num_causal"], args["block_size"], cache, keep_last=args["keep_last"])


def test_kv_cache_reset_and_shapes():
    """Guards against a cache whose layout differs from the op contract ([B, S_max, Hkv, D], int32
    lengths) or whose reset leaves stale lengths."""
    model = tiny_model()
    cache = model.new_cache(2, 20)
    cfg = model.config
    assert len(cache.k) == len(cache.v) == cfg.n_layers
    assert cache.k[0].shape == (2, 20, cfg.n_kv_heads, cfg.head_dim) and cache.k[0].is_contiguous()
    assert cache.seqlens.dtype == torch.int32
    model.decode_pass(random_tokens(2, 5), torch.tensor([5, 3], dtype=torch.int32), 0, cache)
    assert cache.seqlens.tolist() == [5, 3]
    cache.reset()
    assert cache.seqlens.tolist() == [0, 0]


def test_checkpoint_round_trip(tmp_path):
    """Guards against a checkpoint that loses the config, the meta data or any weight."""
    model = tiny_model()
    path = tmp_path / "m.pt"
    save_checkpoint(model, path, steps_done=7, note="x")
    loaded, meta = load_checkpoint(path)
    assert loaded.config == model.config and meta == {"steps_done": 7, "note": "x"}
    tokens = random_tokens(2, 9)
    assert torch.equal(loaded(tokens), model(tokens))


def test_checkpoint_loads_without_training_code(tmp_path):
    """Guards against checkpoints that pickle training classes (loading must need model.py only)."""
    path = tmp_path / "m.pt"
    save_checkpoint(tiny_model(), path)
    code = ("import sys; from sbd_kernels.model import load_checkpoint; "
            f"m, _ = load_checkpoint({str(path)!r}); "
            "assert 'sbd_kernels.train' not in sys.modules; print(m.config.dim)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "32"


def tiny_payload() -> dict:
    model = tiny_model()
    return {"config": dataclasses.asdict(model.config), "state_dict": dict(model.state_dict()), "meta": {}}


def tiny_checkpoint_bytes(tmp_path) -> bytes:
    path = tmp_path / "good.pt"
    save_checkpoint(tiny_model(), path)
    return path.read_bytes()


class OpensAFile:
    """Unpickled without weights_only, this object creates a file: the shape of a malicious checkpoint."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


# A damaged file's bytes (from the bytes of a good checkpoint) and the words its error must contain.
DAMAGED_BYTES = {
    "empty": (lambda good: b"", "empty file"),
    "truncated-half": (lambda good: good[: len(good) // 2], "truncated"),
    "truncated-last-bytes": (lambda good: good[:-10], "truncated"),
    "truncated-header-only": (lambda good: good[:30], "truncated"),
    "random-bytes": (lambda good: random.Random(0).randbytes(1500), "not an sbd_kernels checkpoint"),
    "utf16-text": (lambda good: "config".encode("utf-16"), "not an sbd_kernels checkpoint"),
}


@pytest.mark.parametrize("name", list(DAMAGED_BYTES))
def test_load_checkpoint_names_a_damaged_file(tmp_path, name):
    """Guards against damaged files surfacing raw OSError('Invalid argument'), an EOFError with no text or
    UnpicklingError boilerplate: the error is a CheckpointError naming the file and the damage."""
    damage, words = DAMAGED_BYTES[name]
    path = tmp_path / f"{name}.pt"
    path.write_bytes(damage(tiny_checkpoint_bytes(tmp_path)))
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def flip_weight_byte(path: Path) -> str:
    """Flips one bit in the middle of the largest tensor's data inside the checkpoint archive at `path` (a bit
    rot of the disk or a bad copy) and returns that member's name; the zip structure stays intact."""
    with zipfile.ZipFile(path) as archive:
        member = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    # Local file header: 30 fixed bytes, then the name and the extra field, then the stored (uncompressed) data.
    name_len = int.from_bytes(raw[member.header_offset + 26: member.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[member.header_offset + 28: member.header_offset + 30], "little")
    raw[member.header_offset + 30 + name_len + extra_len + member.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return member.filename


def test_load_checkpoint_refuses_a_bit_flipped_weight(tmp_path):
    """Guards against a checkpoint whose weight bytes were damaged on disk loading silently with wrong weights:
    torch.load does not check the archive's CRC-32s; load_checkpoint does and names the file and the member."""
    path = tmp_path / "flipped.pt"
    save_checkpoint(tiny_model(), path)
    member = flip_weight_byte(path)
    with pytest.raises(CheckpointError, match=f"CRC-32 check failed for {member}") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_load_checkpoint_rejects_a_zip_that_is_not_a_torch_file(tmp_path):
    """Guards against torch's internal 'file in archive is not in a subdirectory' enforce message."""
    path = tmp_path / "notes.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(CheckpointError, match="zip archive, but not one written by torch.save"):
        load_checkpoint(path)


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_load_checkpoint_names_a_path_that_is_not_a_file(tmp_path, kind):
    """Guards against FileNotFoundError / IsADirectoryError escaping instead of one error type."""
    path = tmp_path / "model.pt"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(CheckpointError, match="no such file" if kind == "missing" else "is a directory") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_load_checkpoint_refuses_a_malicious_pickle(tmp_path):
    """Guards against loading with weights_only=False: an object whose unpickling runs code (here: creates a
    file) is refused, the code never runs, and the error says why."""
    victim = tmp_path / "created-by-unpickling"
    path = tmp_path / "evil.pt"
    payload = tiny_payload()
    payload["meta"] = {"note": OpensAFile(victim)}
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="refused by torch.load\\(weights_only=True\\).*open"):
        load_checkpoint(path)
    assert not victim.exists()


def _edit(part: str, edit):
    def apply(payload: dict) -> object:
        if part == "payload":
            return edit(payload)
        edit(payload[part])
        return payload
    return apply


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


# A wrong payload (edited from a good one) and the words its error must contain.
WRONG_PAYLOADS = {
    "a-list": (_edit("payload", lambda p: [1, 2, 3]), "not an sbd_kernels checkpoint.*a list"),
    "a-tensor": (_edit("payload", lambda p: torch.zeros(3)), "not an sbd_kernels checkpoint.*a Tensor"),
    "no-state-dict": (_edit("payload", lambda p: {"config": p["config"], "meta": {}}),
                      "not an sbd_kernels checkpoint.*keys"),
    "state-dict-a-list": (_edit("payload", lambda p: {**p, "state_dict": [1, 2]}), "'state_dict' is a list"),
    "config-a-string": (_edit("payload", lambda p: {**p, "config": "tiny"}), "'config' is a str"),
    "unknown-config-key": (_edit("config", _set("bogus", 1)), "unknown config key 'bogus'"),
    "missing-config-key": (_edit("config", lambda c: c.pop("dim")), "missing config key 'dim'"),
    "size-as-text": (_edit("config", _set("dim", "32")), "config 'dim' must be an integer"),
    "size-as-bool": (_edit("config", _set("n_layers", True)), "config 'n_layers' must be an integer"),
    "negative-layers": (_edit("config", _set("n_layers", -1)), "config 'n_layers' must be"),
    "zero-kv-heads": (_edit("config", _set("n_kv_heads", 0)), "config 'n_kv_heads' must be"),
    "nan-rope-theta": (_edit("config", _set("rope_theta", float("nan"))), "config 'rope_theta' must be"),
    "heads-not-dividing": (_edit("config", _set("n_heads", 3)), "dim .* must divide by n_heads"),
    "odd-head-dim": (_edit("config", lambda c: c.update(dim=36, n_heads=4, n_kv_heads=2)), "head_dim 9 must be even"),
    "missing-weight": (_edit("state_dict", lambda s: s.pop("output.weight")), "missing weights: output.weight"),
    "extra-weight": (_edit("state_dict", _set("extra.weight", torch.zeros(2))), "unexpected weights: extra.weight"),
    "misshapen-weight": (_edit("state_dict", _set("tok_embeddings.weight", torch.zeros(48, 31))),
                         "'tok_embeddings.weight' has shape \\[48, 31\\], the config gives \\[48, 32\\]"),
    "integer-weight": (_edit("state_dict", _set("norm.weight", torch.ones(32, dtype=torch.int64))),
                       "'norm.weight' has dtype torch.int64"),
    "weight-not-a-tensor": (_edit("state_dict", _set("norm.weight", [1.0] * 32)), "'norm.weight' is a list"),
    "meta-a-list": (_edit("payload", lambda p: {**p, "meta": []}), "'meta' is a list"),
}


@pytest.mark.parametrize("name", list(WRONG_PAYLOADS))
def test_load_checkpoint_names_what_is_wrong(tmp_path, name):
    """Guards against a torch file of the wrong structure, a bad config or mismatched weights surfacing as
    TypeError('list indices ...'), KeyError, ZeroDivisionError or a load_state_dict dump, and against a
    config being built (allocated, initialised) before it is checked against the weights."""
    edit, words = WRONG_PAYLOADS[name]
    path = tmp_path / f"{name}.pt"
    torch.save(edit(tiny_payload()), path)
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


# Configs that would take unbounded memory or time to build, and the words their error must contain.
HUGE_CONFIGS = {
    "huge-config-small-weights": ({"dim": 16384, "n_layers": 64, "n_heads": 128, "n_kv_heads": 8, "ffn_dim": 53248},
                                  "missing weights: tok_embeddings.weight, layers.0.attention_norm.weight"),
    "billion-layers": ({"n_layers": 10**9}, "config 'n_layers' must be an integer in"),
    "too-many-parameters": ({"dim": 2**17, "ffn_dim": 2**19, "n_layers": 4096}, "parameters, more than"),
}


def test_load_checkpoint_checks_a_huge_config_before_allocating(tmp_path):
    """Guards against a 1.5 KB file whose config says dim 16384, 64 layers (or a billion layers) making the
    loader allocate and initialise that model before it looks at the weights: under an address-space limit
    3 GiB above what the imports mapped (a regression must not exhaust the machine; a CUDA build of torch maps
    more than 3 GiB on import) each load fails at once with CheckpointError."""
    pytest.importorskip("resource")  # the child process sets the limit
    paths = []
    for name, (config, _) in HUGE_CONFIGS.items():
        payload = tiny_payload()
        payload["config"].update(config)
        payload["state_dict"] = {}
        paths.append(str(tmp_path / f"{name}.pt"))
        torch.save(payload, paths[-1])
        assert Path(paths[-1]).stat().st_size < 2000
    code = ("import re, resource\n"
            "from sbd_kernels.model import load_checkpoint\n"
            "mapped = int(re.search(r'VmSize:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) << 10\n"
            "resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 30), mapped + (3 << 30)))\n"
            f"for path in {paths!r}:\n"
            "    try:\n"
            "        load_checkpoint(path)\n"
            "    except Exception as err:\n"
            "        print(type(err).__name__, str(err).splitlines()[0][:300])\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == len(HUGE_CONFIGS), out.stdout + out.stderr[-2000:]
    for line, path, (_, words) in zip(lines, paths, HUGE_CONFIGS.values()):
        assert line.startswith(f"CheckpointError {path}: ") and words in line, line


@pytest.mark.parametrize("name", ["sbd_small", "ntp_small"])
def test_bundled_checkpoints_solve_held_out_examples(name):
    """Guards against shipping broken or mismatched weights. Teacher-forced next-token argmax equal to
    the answer at every position means greedy NTP decoding reproduces the answer exactly; for the SBD
    model, every answer position masked (blocks of 16 aligned at 0) must also be predicted exactly."""
    from sbd_kernels.tasks import collate, get_task, make_examples

    model, meta = load_checkpoint(CHECKPOINTS / f"{name}.pt")
    assert model.config == ModelConfig.preset("small")
    assert meta["train_config"]["objective"] == name.split("_")[0]
    for task_name in ("add", "rot13"):
        task = get_task(task_name)
        length = task.prompt_tokens + task.answer_tokens
        tokens, target = collate(make_examples(task_name, "held_out", 8), length)
        with torch.no_grad():
            ntp_pred = model(tokens)[:, :-1].argmax(-1)
            assert torch.equal(ntp_pred[target[:, 1:]], tokens[:, 1:][target[:, 1:]]), task_name
            if name == "sbd_small":
                noisy = torch.where(target, CHAR_MASK_TOKEN_ID, tokens)
                matp_pred = model.sbd_train_forward(tokens, noisy, 16)[:, tokens.shape[1]:].argmax(-1)
                assert torch.equal(matp_pred[target], tokens[target]), task_name


def test_reference_model_implements_the_sbd_model_protocol():
    """Guards against the reference model drifting from the protocol the decode loop and the loss rely on
    (`sbd_kernels.protocol.SbdModel`), e.g. a renamed `decode_pass` or a missing `new_cache`."""
    from sbd_kernels.protocol import DecodeCache, SbdModel

    model = Transformer(ModelConfig.preset("tiny"))
    assert isinstance(model, SbdModel)
    assert isinstance(model.new_cache(2, 8), DecodeCache)
    assert model.mask_token_id == model.config.mask_token_id


def test_one_cache_constructor():
    """Guards against a second way of making a model's cache coming back (a KVCache class method beside
    `Transformer.new_cache`): `new_cache`, the protocol's constructor, is the only one, and callers use it."""
    assert not hasattr(KVCache, "for_model")
    callers = [p for p in (*(REPO / "sbd_kernels").rglob("*.py"), *(REPO / "bench").rglob("*.py"),
                           *(REPO / "tests").rglob("*.py"), *(REPO / "docs").rglob("*.md"), REPO / "README.md")
               if "KVCache.for" + "_model" in p.read_text()]
    assert not callers, callers

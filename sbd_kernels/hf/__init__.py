"""SBD for Hugging Face transformers causal LMs (`pip install ".[hf]"` in the checkout): fine-tune, then decode with the
`torch.ops.sbd` kernels.

    from sbd_kernels import hf
    sbd_model = hf.enable_sbd(model, tokenizer, block_size=16)          # mask token, "sbd" attention
    ds = [{"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}]   # -100: not a target
    collator = hf.SbdDataCollator(model.config)                         # SBD objective for Trainer / a loop
    Trainer(model=model, args=args, train_dataset=ds, data_collator=collator,
            compute_loss_func=hf.sbd_loss_func).train()                # default remove_unused_columns keeps labels
    out = hf.generate(model, input_ids, attention_mask, max_new_tokens=128, gamma=0.1)   # or custom_generate=
    print(out.sequences, out.nfe, hf.check(model, input_ids, attention_mask).passed)

Layout: `model.py` (enable_sbd, the SbdCausalLM adapter of the `SbdModel` protocol), `attention.py` (the "sbd"
attention implementation and its mask function), `cache.py` (SbdCache), `training.py` (masks, collator, loss),
`generation.py` (generate, custom_generate entry), `check.py` (exact-KV check), `window.py` (sliding-window
layers: which layers, their masks), `torch_attention.py` (the op in PyTorch with a window and score soft-capping,
for the layers that need them).
"""
from sbd_kernels.hf._versions import check_versions

check_versions()

from sbd_kernels.hf.cache import SbdCache, SbdCacheError
from sbd_kernels.hf.check import check
from sbd_kernels.hf.generation import SbdGenerateOutput, generate, sbd_generate
from sbd_kernels.hf.model import (
    SUPPORTED_MODEL_TYPES,
    SbdCausalLM,
    SbdUnsupportedModelError,
    check_supported,
    enable_sbd,
)
from sbd_kernels.hf.training import SbdBlockMask, SbdDataCollator, sbd_loss_func, sbd_training_mask

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SbdBlockMask",
    "SbdCache",
    "SbdCacheError",
    "SbdCausalLM",
    "SbdDataCollator",
    "SbdGenerateOutput",
    "SbdUnsupportedModelError",
    "check",
    "check_supported",
    "enable_sbd",
    "generate",
    "sbd_generate",
    "sbd_loss_func",
    "sbd_training_mask",
]

import torch


def block_attention_with_kvcache(*args, **kwargs):
    return torch.ops.sbd.block_attention_with_kvcache(*args, **kwargs)

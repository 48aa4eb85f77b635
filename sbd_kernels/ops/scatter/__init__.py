import torch


def mask_scatter_(*args, **kwargs):
    return torch.ops.sbd.mask_scatter_(*args, **kwargs)

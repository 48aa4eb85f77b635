import torch


def entropy_sample(*args, **kwargs):
    return torch.ops.sbd.entropy_sample(*args, **kwargs)

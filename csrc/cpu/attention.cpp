// CPU kernels of the attention family (to be written).

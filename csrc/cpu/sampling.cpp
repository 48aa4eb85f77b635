// CPU kernels of the sampling family (to be written).

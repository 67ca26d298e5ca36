"""The network math: layers, attention, the T5 encoder-decoder and its variants, losses,
decoding, FLOPs.

Pure Flax modules and functions of arrays; no jit, no mesh, no optimizer, no data, no
backend branch: the layers compute through their `kernels` field (`t5x_lite.kernels`).
Imports only `t5x_lite.core` and `t5x_lite.kernels`.
"""

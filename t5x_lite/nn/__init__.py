"""The network math: layers, the T5 encoder-decoder and its variants, losses, decoding, FLOPs.

Pure Flax modules and functions of arrays; no jit, no mesh, no optimizer, no data. Imports only
`t5x_lite.core`.
"""

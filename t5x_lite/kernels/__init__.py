"""The kernel seam: the backend implementations of the network's primitives.

`base.Kernels` names the primitives (a projection's matmul, attention, RMSNorm, argmax,
the decode caches' layout); `reference` is their plain form, the A/B baseline, available
everywhere; `xla_cpu` is tuned for XLA:CPU; `xla_gpu` fuses attention with
`jax.nn.dot_product_attention` (cuDNN on a GPU); `registry.select` maps
`T5Config.kernels` ('auto' | 'reference' | 'xla_cpu' | 'xla_gpu') to one of them. Imports
only `t5x_lite.core`.
"""

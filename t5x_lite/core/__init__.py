"""The base layer: user errors, user paths, the cache directory, quiet start-up and gin parsing.

It imports no other part of t5x_lite and no JAX, seqio or TensorFlow at import time, so every
other layer may use it.
"""

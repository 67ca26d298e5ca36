"""Interoperability: Hugging Face transformers T5 and T5X checkpoints to and from t5x_lite.

Converts parameters (and T5X's factored Adafactor state, hence its import of
`t5x_lite.training`); used by tools/convert_*_checkpoint.py and benchmarks.
"""

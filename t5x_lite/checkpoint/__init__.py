"""Checkpoints: orbax steps and their integrity manifest, training saves and resume, restores.

Also parameter layouts (scanned or not) and partial restores for fine-tuning starts. Imports
`t5x_lite.core` and `t5x_lite.nn` (the model config a step stores).
"""

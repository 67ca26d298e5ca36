"""Checkpoints: orbax steps and their integrity manifest, training saves and resume, restores.

Also parameter layouts (scanned or not), partial restores for fine-tuning starts, and a
save that failed writing (`save_failure`). Imports `t5x_lite.core` and `t5x_lite.nn` (the
model config a step stores).
"""

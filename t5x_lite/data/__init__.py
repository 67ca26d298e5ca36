"""Data: text sources, the vocabulary, the T5 paper's objectives and mixing, and the pipeline.

Sources and preprocessors for seqio tasks, metrics, and `pipeline`: a seqio task or mixture
to per-host numpy batches and global sharded arrays. Imports `t5x_lite.core` and `t5x_lite.nn`.
`autograph_rules.install()` (the entry points call it) has AutoGraph leave the map
functions of t5x_lite and of seqio's preprocessing as written.
"""

"""Training: the mesh and logical-axis rules, optimizers, pure train / eval steps, metrics.

The one place steps are jitted with shardings (`partitioning.Partitioner`, `trainer`), plus
throughput (tokens/s, MFU) and metric logging (rewound to the step a restart resumes from:
`metrics_rewind`). Imports the model layer and below.
"""

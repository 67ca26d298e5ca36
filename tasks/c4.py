"""C4 pretraining tasks (TFDS c4/en:3.*.*; pass --tfds_data_dir to read your copy).

c4_v220_<objective> for every objective of t5x_lite.data.objectives (span_corruption,
iid_replace_spans, iid_drop_tokens, bert_style, iid_denoising, mass_style,
deshuffling, prefix_lm, lm): the T5 paper's unsupervised objectives over the 'text' field
(c4_v220_lm has targets only, for decoder-only models).
"""

import seqio

from t5x_lite.data import objectives

C4_TFDS_NAME = "c4/en:3.*.*"

for _objective in objectives.UNSUPERVISED_OBJECTIVES:
  seqio.TaskRegistry.add(
    f"c4_v220_{_objective}",
    source=seqio.TfdsDataSource(tfds_name=C4_TFDS_NAME, splits=("train", "validation")),
    preprocessors=objectives.unsupervised_preprocessors(_objective, text_key="text"),
    output_features=objectives.objective_features(_objective),
    metric_fns=[],
  )

"""C4 pretraining tasks (TFDS c4/en:3.*.*; pass --tfds_data_dir to read your copy).

c4_v220_span_corruption, c4_v220_iid_denoising, c4_v220_prefix_lm: T5's
unsupervised objectives (see t5x_lite.preprocessors) over the 'text' field.
"""

import seqio

from t5x_lite import preprocessors

C4_TFDS_NAME = "c4/en:3.*.*"

for _objective in preprocessors.UNSUPERVISED_OBJECTIVES:
  seqio.TaskRegistry.add(
    f"c4_v220_{_objective}",
    source=seqio.TfdsDataSource(tfds_name=C4_TFDS_NAME, splits=("train", "validation")),
    preprocessors=preprocessors.unsupervised_preprocessors(_objective, text_key="text"),
    output_features=preprocessors.text_to_text_features(),
    metric_fns=[],
  )

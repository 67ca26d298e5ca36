"""WMT16 English-German translation (TFDS wmt16_translate/de-en), scored with sacrebleu."""

import functools

import seqio

from t5x_lite.data import preprocessors, task_metrics

# "translate English to German: <en>" -> "<de>"; shared with tasks/local.py's Multi30k.
EN_TO_DE_PREPROCESSORS = preprocessors.supervised_preprocessors(
  functools.partial(
    preprocessors.translate,
    source_language="English",
    target_language="German",
    source_key="en",
    target_key="de",
  )
)

seqio.TaskRegistry.add(
  "wmt16_ende",
  source=seqio.TfdsDataSource(
    tfds_name="wmt16_translate/de-en:1.0.0", splits=("train", "validation", "test")
  ),
  preprocessors=EN_TO_DE_PREPROCESSORS,
  output_features=preprocessors.text_to_text_features(),
  metric_fns=[task_metrics.bleu],
)

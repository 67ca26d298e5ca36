"""A task nobody tuned the recipes for: Pang & Lee's movie review polarity (NLTK)."""

import functools

import seqio

from t5x_lite.data import file_sources, preprocessors, task_metrics

LABELS = {"0": "negative", "1": "positive"}

seqio.TaskRegistry.add(
  "movie_review_polarity",
  source=file_sources.TsvSource({"train": "train.tsv", "validation": "dev.tsv"}),
  preprocessors=preprocessors.supervised_preprocessors(
    functools.partial(
      preprocessors.text_to_text,
      prefix="review",
      feature_names=("sentence",),
      label_names=LABELS,
    )
  ),
  output_features=preprocessors.text_to_text_features(),
  postprocess_fn=functools.partial(
    task_metrics.string_label_to_class_id, label_classes=list(LABELS.values())
  ),
  metric_fns=[task_metrics.accuracy],
)

"""A task nobody tuned the recipes for: which ABC programme (rural or science news) ran
a sentence (NLTK's abc corpus; make_data.py writes the files)."""

import functools

import seqio

from t5x_lite.data import file_sources, preprocessors, task_metrics

LABELS = ["rural", "science"]

seqio.TaskRegistry.add(
  "abc_news_programme",
  source=file_sources.TsvSource({"train": "train.tsv", "validation": "dev.tsv"}),
  preprocessors=preprocessors.supervised_preprocessors(
    functools.partial(
      preprocessors.text_to_text,
      prefix="abc news",
      feature_names=("sentence",),
    )
  ),
  output_features=preprocessors.text_to_text_features(),
  postprocess_fn=functools.partial(task_metrics.string_label_to_class_id, label_classes=LABELS),
  metric_fns=[task_metrics.accuracy],
)

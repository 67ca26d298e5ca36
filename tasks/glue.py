"""GLUE tasks in T5's text-to-text format (TFDS glue/*:2.0.0) and the glue_v2 mixture.

Inputs are "<task> <field>: <text> ..." with fields in T5's (sorted) order,
targets the class name (STS-B: the score rounded to 0.2, e.g. "3.8").
Predictions are postprocessed to class ids (-1 if not a class name) or floats.
glue_v2 mixes the nine tasks with `t5x_lite.data.mixing.rate_for('glue_v2')`
(gin `glue_v2/mixing_rate.*`).
"""

import functools

import seqio

from t5x_lite.data import mixing, preprocessors, task_metrics

# name: (input fields, label names (None: float label), metric fns).
_GLUE = {
  "cola": (("sentence",), ("unacceptable", "acceptable"), [task_metrics.matthews_corrcoef]),
  "sst2": (("sentence",), ("negative", "positive"), [task_metrics.accuracy]),
  "mrpc": (
    ("sentence1", "sentence2"),
    ("not_equivalent", "equivalent"),
    [task_metrics.f1_with_invalid, task_metrics.accuracy],
  ),
  "qqp": (
    ("question1", "question2"),
    ("not_duplicate", "duplicate"),
    [task_metrics.f1_with_invalid, task_metrics.accuracy],
  ),
  "stsb": (("sentence1", "sentence2"), None, [task_metrics.pearson_spearman]),
  "mnli": (
    ("hypothesis", "premise"),
    ("entailment", "neutral", "contradiction"),
    [task_metrics.accuracy],
  ),
  "qnli": (("question", "sentence"), ("entailment", "not_entailment"), [task_metrics.accuracy]),
  "rte": (("sentence1", "sentence2"), ("entailment", "not_entailment"), [task_metrics.accuracy]),
  "wnli": (("sentence1", "sentence2"), ("not_entailment", "entailment"), [task_metrics.accuracy]),
}
_MNLI_SPLITS = {
  "train": "train",
  "validation": "validation_matched",
  "validation_mismatched": "validation_mismatched",
  "test": "test_matched",
  "test_mismatched": "test_mismatched",
}
_SPLITS = {"train": "train", "validation": "validation", "test": "test"}


def glue_postprocessor(label_names):
  """Postprocessor: class id for classification, float for STS-B (label_names None)."""
  if label_names is None:
    return task_metrics.string_to_float
  return functools.partial(task_metrics.string_label_to_class_id, label_classes=list(label_names))


for _name, (_fields, _labels, _metrics) in _GLUE.items():
  seqio.TaskRegistry.add(
    f"glue_{_name}_v2",
    source=seqio.TfdsDataSource(
      tfds_name=f"glue/{_name}:2.0.0", splits=_MNLI_SPLITS if _name == "mnli" else _SPLITS
    ),
    preprocessors=preprocessors.supervised_preprocessors(
      functools.partial(
        preprocessors.text_to_text, prefix=_name, feature_names=_fields, label_names=_labels
      )
    ),
    output_features=preprocessors.text_to_text_features(),
    postprocess_fn=glue_postprocessor(_labels),
    metric_fns=_metrics,
  )

seqio.MixtureRegistry.add(
  "glue_v2", [f"glue_{name}_v2" for name in _GLUE], default_rate=mixing.rate_for("glue_v2")
)

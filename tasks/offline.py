"""Offline tasks over text that ships with CPython, and the `quickstart` mixture.

  cpython_<objective>        each objective of t5x_lite.data.objectives over pydoc topics and
                             stdlib docstrings (tools/compare.py's objectives table):
    cpython_span_corruption  span corruption, half of the quickstart mixture
    cpython_lm               plain language modelling (targets only): the decoder-only
                             quickstart's task
    cpython_prefix_lm        the prefix LM objective: the prefix LM quickstart's task
  cpython_electra            the same prose, uncorrupted, as inputs and targets
                             (`objectives.electra_text`): t5x_lite.electra's
                             pre-training task (gin/runs/electra.gin)
  cpython_code_to_docstring  "summarize python: <function source>" -> first docstring line, ROUGE
  quickstart                 cpython_span_corruption and cpython_code_to_docstring, mixed by
                             t5x_lite.data.mixing.rate_for('quickstart')
                             (gin quickstart/mixing_rate.*)

All have deterministic, disjoint 'train' and 'validation' splits
(t5x_lite.data.cpython_corpus). Quickstart feature lengths: inputs 128, targets 32
(span corruption at inputs 128 gives targets of 29 tokens).
"""

import functools

import seqio

from t5x_lite.data import (
  cpython_corpus,
  file_sources,
  mixing,
  objectives,
  preprocessors,
  task_metrics,
)

QUICKSTART_FEATURE_LENGTHS = {"inputs": 128, "targets": 32}


def _prose(split: str) -> dict[str, list[str]]:
  return {"text": list(cpython_corpus.prose(split))}


def _code_docstring_pairs(split: str) -> dict[str, list[str]]:
  pairs = cpython_corpus.docstring_pairs(split)
  return {"code": [code for code, _ in pairs], "docstring": [doc for _, doc in pairs]}


for _objective in objectives.UNSUPERVISED_OBJECTIVES:
  seqio.TaskRegistry.add(
    f"cpython_{_objective}",
    source=file_sources.InMemorySource(_prose, splits=cpython_corpus.SPLITS),
    preprocessors=objectives.unsupervised_preprocessors(_objective),
    output_features=objectives.objective_features(_objective),
    metric_fns=[],
  )

seqio.TaskRegistry.add(
  "cpython_electra",
  source=file_sources.InMemorySource(_prose, splits=cpython_corpus.SPLITS),
  preprocessors=[
    objectives.text_as_targets,
    seqio.preprocessors.tokenize,
    objectives.electra_text,
  ],
  output_features=preprocessors.text_to_text_features(),
  metric_fns=[],
)

seqio.TaskRegistry.add(
  "cpython_code_to_docstring",
  source=file_sources.InMemorySource(_code_docstring_pairs, splits=cpython_corpus.SPLITS),
  preprocessors=preprocessors.supervised_preprocessors(
    functools.partial(
      preprocessors.prefixed_pair,
      prefix="summarize python: ",
      source_key="code",
      target_key="docstring",
    )
  ),
  output_features=preprocessors.text_to_text_features(),
  metric_fns=[task_metrics.rouge],
)

seqio.MixtureRegistry.add(
  "quickstart",
  ["cpython_span_corruption", "cpython_code_to_docstring"],
  default_rate=mixing.rate_for("quickstart"),
)

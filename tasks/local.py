"""Example tasks over local files laid out like this project's ../shared/data.

File names are relative to the data directory: gin `local_data_dir.path`
(train.py --data_dir), else $T5X_LITE_DATA_DIR, else ../shared/data relative
to the working directory. docs/new_task.md shows how to register your own.

  local_glue_sst2        glue/SST-2/{train,dev}.tsv        sentence -> negative/positive
  local_glue_rte         glue/RTE/{train,dev}.tsv          sentence pair -> (not_)entailment
  local_multi30k_ende    multi30k_en_de/*.{en,de}.gz       English -> German, BLEU
  local_scitldr_a        scitldr_a/*.jsonl                 abstract -> TLDR, ROUGE
  local_tinyshakespeare_span_corruption   tinyshakespeare/input.txt (train only)
  local_wikitext2_span_corruption         wikitext2/{valid,test}.txt (validation/test only)
  local_unlabeled_span_corruption         t5x_lite.data.unlabeled_text (the input side of the
                                          files above, CPython's docs), span-corrupted: the
                                          transfer recipe's pre-training task
  local_unlabeled_<objective>             the same text under each other objective of
                                          t5x_lite.data.objectives (prefix_lm, bert_style, ...)
  local_unlabeled_electra                 the same text, uncorrupted, as inputs and targets:
                                          ELECTRA-style pre-training (recipes/pretrain_electra.gin)
  local_multitask        the four fine-tuning tasks above (SST-2, RTE, Multi30k, SciTLDR)
  local_multitask_without_<glue_sst2|glue_rte|multi30k_ende|scitldr_a>
                         leave-one-out: local_multitask minus that task

The multi-task mixtures share one gin scope, `local_multitask/mixing_rate.*`
(t5x_lite.data.mixing), so a leave-one-out mixture always mixes like the full one. Each
task's source counts its records, so all three strategies work for them.
"""

import functools

import seqio

from t5x_lite.data import (
  file_sources,
  mixing,
  objectives,
  preprocessors,
  task_metrics,
  unlabeled_text,
)
from tasks import glue, wmt

_SST2_LABELS = {"0": "negative", "1": "positive"}
_RTE_LABELS = {"entailment": "entailment", "not_entailment": "not_entailment"}


def _glue_task(
  name: str, directory: str, fields: tuple[str, ...], labels: dict[str, str], metrics
) -> None:
  seqio.TaskRegistry.add(
    f"local_glue_{name}",
    source=file_sources.TsvSource(
      {"train": f"{directory}/train.tsv", "validation": f"{directory}/dev.tsv"}
    ),
    preprocessors=preprocessors.supervised_preprocessors(
      functools.partial(
        preprocessors.text_to_text, prefix=name, feature_names=fields, label_names=labels
      )
    ),
    output_features=preprocessors.text_to_text_features(),
    postprocess_fn=glue.glue_postprocessor(list(labels.values())),
    metric_fns=metrics,
  )


_glue_task("sst2", "glue/SST-2", ("sentence",), _SST2_LABELS, [task_metrics.accuracy])
_glue_task("rte", "glue/RTE", ("sentence1", "sentence2"), _RTE_LABELS, [task_metrics.accuracy])

seqio.TaskRegistry.add(
  "local_multi30k_ende",
  source=file_sources.ParallelTextSource(
    {
      split: (f"multi30k_en_de/{prefix}.en.gz", f"multi30k_en_de/{prefix}.de.gz")
      for split, prefix in (
        ("train", "train"),
        ("validation", "val"),
        ("test", "test_2016_flickr"),
      )
    },
    source_key="en",
    target_key="de",
  ),
  preprocessors=wmt.EN_TO_DE_PREPROCESSORS,
  output_features=preprocessors.text_to_text_features(),
  metric_fns=[task_metrics.bleu],
)

seqio.TaskRegistry.add(
  "local_scitldr_a",
  source=file_sources.JsonlSource(
    {
      split: f"scitldr_a/{split_file}.jsonl"
      for split, split_file in (("train", "train"), ("validation", "dev"), ("test", "test"))
    },
    fields={"source": "source", "target": "target"},
    list_policy={"source": "join", "target": "first"},
  ),
  preprocessors=preprocessors.supervised_preprocessors(
    functools.partial(
      preprocessors.prefixed_pair,
      prefix="summarize: ",
      source_key="source",
      target_key="target",
    )
  ),
  output_features=preprocessors.text_to_text_features(),
  metric_fns=[task_metrics.rouge],
)

MULTITASK = ("local_glue_sst2", "local_glue_rte", "local_multi30k_ende", "local_scitldr_a")
seqio.MixtureRegistry.add(
  "local_multitask", list(MULTITASK), default_rate=mixing.rate_for("local_multitask")
)
for _left_out in MULTITASK:
  seqio.MixtureRegistry.add(
    f"local_multitask_without_{_left_out.removeprefix('local_')}",
    [name for name in MULTITASK if name != _left_out],
    default_rate=mixing.rate_for("local_multitask"),
  )

for _name, _splits in (
  ("tinyshakespeare", {"train": "tinyshakespeare/input.txt"}),
  ("wikitext2", {"validation": "wikitext2/valid.txt", "test": "wikitext2/test.txt"}),
):
  seqio.TaskRegistry.add(
    f"local_{_name}_span_corruption",
    source=file_sources.TextLinesSource(_splits),
    preprocessors=objectives.unsupervised_preprocessors("span_corruption"),
    output_features=preprocessors.text_to_text_features(),
    metric_fns=[],
  )

# Its raw text trains the recipe's vocabulary (tools/train_vocab.py --text_field=text).
# Each objective of the T5 study over the same text (local_unlabeled_prefix_lm, ...):
# the objectives table at the recipes' size (docs/recipes.md). One source, so a process
# that reads several of these tasks reads the corpus once.
_UNLABELED_TEXT = unlabeled_text.UnlabeledTextSource()
for _objective in objectives.UNSUPERVISED_OBJECTIVES:
  seqio.TaskRegistry.add(
    f"local_unlabeled_{_objective}",
    source=_UNLABELED_TEXT,
    preprocessors=objectives.unsupervised_preprocessors(_objective),
    output_features=objectives.objective_features(_objective),
    metric_fns=[],
  )

# ELECTRA-style pre-training reads the same text whole; its model masks in the train step.
seqio.TaskRegistry.add(
  "local_unlabeled_electra",
  source=_UNLABELED_TEXT,
  preprocessors=[objectives.text_as_targets, seqio.preprocessors.tokenize, objectives.electra_text],
  output_features=preprocessors.text_to_text_features(),
  metric_fns=[],
)

"""AutoGraph leaves the tf.data functions of t5x_lite and of seqio's preprocessing as
written.

`tf.data.Dataset.map` hands every function to AutoGraph, which parses its source and
rewrites Python control flow into TF ops before tracing it. The map functions of
t5x_lite, and of the seqio modules named in `AS_WRITTEN`, use TF ops only (no Python `if`,
`for` or `while` on a tensor), so the rewrite changes nothing in the traced graph; it
costs several seconds of parsing at every start of a training, evaluation or inference
process (about a fifth of a small run's start-up). seqio's packing (`seqio.utils`) loops
over tensors in Python and keeps the conversion, as do the functions of any other module
(a task module's own preprocessors included); t5x_lite's feature converters pack with
`t5x_lite.data.packing`, the same algorithm in graph ops, so they need none.

A function of these modules that did branch on a tensor in Python would fail while
tracing (`OperatorNotAllowedInGraphError`) rather than behave differently, so a mistake
here cannot change the data silently.

Importing this module changes nothing: the entry points call `install()` at start-up
(`t5x_lite.cli.setup`, said in the `Start-up:` log line); Python code may call it too.
"""

from __future__ import annotations

from tensorflow.python.autograph.core import config as autograph_config

# Module-name prefixes whose functions AutoGraph calls as written.
AS_WRITTEN = (
  "t5x_lite",
  "seqio.dataset_providers",
  "seqio.feature_converters",
  "seqio.preprocessors",
  "seqio.vocabularies",
  "tensorflow_text",
)


def install() -> None:
  """Puts `AS_WRITTEN` first in AutoGraph's conversion rules, for the whole process
  (a second call adds nothing)."""
  rules = autograph_config.CONVERSION_RULES
  present = {getattr(rule, "_prefix", None) for rule in rules}
  new = tuple(autograph_config.DoNotConvert(m) for m in AS_WRITTEN if m not in present)
  autograph_config.CONVERSION_RULES = new + tuple(rules)

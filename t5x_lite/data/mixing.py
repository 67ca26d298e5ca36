"""The T5 paper's mixing strategies (its section 3.5.2), chosen per mixture in gin.

With n the size of a task's split and K an artificial dataset size limit
(gin `mixing_rate.maximum`, default None: no limit), a task's unnormalized rate is

  mixing_rate.strategy        rate
  'proportional'              min(n, K)
  'temperature' (default)     min(n, K) ** (1 / T), T = mixing_rate.temperature (default 2.0)
  'equal'                     1, for every task (n is not needed)

Register a mixture with `rate_for(<its name>)` as its default rate:

    seqio.MixtureRegistry.add("my_mix", ["task_a", "task_b"], default_rate=rate_for("my_mix"))

The rate is `mixing_rate` evaluated inside `gin.config_scope("my_mix")`, so a
binding scoped by the mixture's name overrides the unscoped one for that
mixture only:

    mixing_rate.temperature = 3.0            # every mixture
    my_mix/mixing_rate.strategy = 'equal'    # my_mix only

seqio evaluates rates when the mixture's dataset is built, so bindings parsed
after the mixture was registered still apply. A scope that names no mixture is
ignored, as gin ignores any unused scope.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Optional

import gin
import seqio

from t5x_lite.core.errors import ConfigError

STRATEGIES = ("proportional", "temperature", "equal")


def _binding(param: str) -> str:
  """Where `param` of mixing_rate is set, for the current gin scope (the mixture)."""
  scope = "/".join(gin.current_scope())
  if not scope:
    return f"gin mixing_rate.{param}"
  return f"mixture '{scope}' (gin {scope}/mixing_rate.{param}, or mixing_rate.{param} for all)"


@gin.configurable(denylist=["task"])  # pyright: ignore[reportCallIssue]  # gin is untyped
def mixing_rate(
  task: seqio.Task,
  strategy: str = "temperature",
  temperature: float = 2.0,
  maximum: Optional[int] = None,
  split: str = "train",
) -> float:
  """Unnormalized mixing rate of `task` under one of the T5 paper's strategies.

  Args:
    task: the task (seqio passes it).
    strategy: 'proportional' (min(n, maximum)), 'temperature' (min(n, maximum) ** (1 /
      temperature)) or 'equal' (1, whatever the task's size).
    temperature: T of the 'temperature' strategy; T = 1 is 'proportional'.
    maximum: K, the artificial dataset size limit applied to n before the temperature
      (None: no limit).
    split: split whose size n is used.

  Returns:
    The unnormalized rate.

  Raises:
    ConfigError: a bad strategy, temperature or maximum, or a task that does not know its
      size under a strategy that needs it; the message names the mixture (the current gin
      scope, see `rate_for`) and the gin binding to change.
  """
  if strategy not in STRATEGIES:
    raise ConfigError(
      f"Mixing strategy {strategy!r} of {_binding('strategy')} is not one of {STRATEGIES}."
    )
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
    raise ConfigError(
      f"Mixing temperature {temperature!r} of {_binding('temperature')} must be a number > 0."
    )
  if maximum is not None and (
    isinstance(maximum, bool) or not isinstance(maximum, int) or maximum <= 0
  ):
    raise ConfigError(
      f"Mixing maximum {maximum!r} of {_binding('maximum')} must be an integer > 0 or None."
    )
  if strategy == "equal":
    return 1.0
  if not task.cache_dir and task.num_input_examples(split) is None:
    raise ConfigError(
      f"Task '{task.name}' does not know its number of '{split}' examples, which the "
      f"{strategy!r} strategy of {_binding('strategy')} needs; use 'equal'."
    )
  return float(
    seqio.mixing_rate_num_examples(
      task,
      maximum=maximum,
      temperature=temperature if strategy == "temperature" else 1.0,
      split=split,
    )
  )


@dataclasses.dataclass(frozen=True)
class _ScopedRate:
  """A seqio rate function: `mixing_rate` with the bindings of gin scope `scope`.

  Attributes:
    scope: the gin scope, the mixture's name (or a family's, shared by its mixtures).
  """

  scope: str

  def __call__(self, task: seqio.Task) -> float:
    # A list replaces any enclosing scope, so `<scope>/mixing_rate` bindings always apply.
    with gin.config_scope([self.scope]):
      return mixing_rate(task)


def rate_for(scope: str) -> _ScopedRate:
  """The rate function of a mixture, configured by gin bindings `<scope>/mixing_rate.*`.

  Args:
    scope: the mixture's name; mixtures that should always mix alike (e.g. leave-one-out
      variants of one mixture) may share one.

  Returns:
    A rate function to pass as `default_rate` to `seqio.MixtureRegistry.add`.

  Raises:
    ConfigError: if `scope` is not a name gin can scope bindings with.
  """
  if not re.fullmatch(r"[A-Za-z_]\w*", scope):
    raise ConfigError(f"Mixture scope {scope!r} must be letters, digits and '_' for gin.")
  return _ScopedRate(scope)


def normalized_rates(mixture: seqio.Mixture) -> Mapping[str, float]:
  """Sampling probability of each task of a mixture (sub-mixtures flattened).

  Args:
    mixture: the mixture (`t5x_lite.data.pipeline.get_mixture_or_task` looks one up by name).

  Returns:
    {task name: probability}, summing to 1, in the mixture's task order.
  """
  rates = {task.name: float(mixture.get_rate(task)) for task in mixture.tasks}
  total = sum(rates.values())
  return {name: rate / total for name, rate in rates.items()}

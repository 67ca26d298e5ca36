"""Temperature mixing: rate(task) proportional to min(num_examples, maximum) ** (1 / T).

`temperature_rate` is a seqio rate function (it receives the Task); register
a mixture with it as the default rate and configure it from gin:

    seqio.MixtureRegistry.add("my_mix", ["task_a", "task_b"], default_rate=mixing.temperature_rate)

    temperature_rate.temperature = 2.0
    temperature_rate.maximum = 65536

seqio evaluates rate functions when the mixture's dataset is built, so gin
bindings parsed after the mixture was registered still apply. T = 1 with no
maximum is examples-proportional mixing; large T approaches equal mixing.
"""

from collections.abc import Mapping
from typing import Optional

import gin
import seqio

from t5x_lite.errors import ConfigError


@gin.configurable
def temperature_rate(
  task: seqio.Task,
  temperature: float = 2.0,
  maximum: Optional[int] = None,
  split: str = "train",
) -> float:
  """Mixing rate min(num_examples, maximum) ** (1 / temperature).

  Args:
    task: the task (seqio passes it).
    temperature: T; 1.0 is examples-proportional.
    maximum: cap on the example count before the temperature (None: no cap).
    split: split whose size is used.

  Returns:
    The unnormalized rate.

  Raises:
    ConfigError: if the task's size for `split` is unknown.
  """
  if task.num_input_examples(split) is None:
    raise ConfigError(
      f"Task '{task.name}' does not know its number of '{split}' examples, which "
      "temperature mixing needs; give it a fixed rate instead."
    )
  return seqio.mixing_rate_num_examples(task, maximum=maximum, temperature=temperature, split=split)


def normalized_rates(mixture: seqio.Mixture) -> Mapping[str, float]:
  """Sampling probability of each task of a mixture (sub-mixtures flattened).

  Args:
    mixture: the mixture (`t5x_lite.data.get_mixture_or_task` looks one up by name).

  Returns:
    {task name: probability}, summing to 1, in the mixture's task order.
  """
  rates = {task.name: float(mixture.get_rate(task)) for task in mixture.tasks}
  total = sum(rates.values())
  return {name: rate / total for name, rate in rates.items()}

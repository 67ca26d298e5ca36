"""Tests for t5x_lite.data.mixing.

The T5 paper's mixing strategies, per mixture, and their sampling.
"""

import collections

import gin
import pytest
import seqio
import tensorflow as tf

import tasks  # noqa: F401  (registers local_multitask and its leave-one-out mixtures)
from t5x_lite.data import mixing
from t5x_lite.core.errors import ConfigError

pytestmark = pytest.mark.usefixtures("clean_gin")

SIZES = {"mix_test_small": 100, "mix_test_medium": 900, "mix_test_large": 40_000}
MAXIMUM = 10_000
FEATURES = {"targets": seqio.Feature(seqio.PassThroughVocabulary(10), add_eos=False)}
# The unnormalized rate of each strategy, written out from the paper's formulas.
FORMULAS = {
  "proportional": lambda n, k, t: min(n, k),
  "temperature": lambda n, k, t: min(n, k) ** (1 / t),
  "equal": lambda n, k, t: 1.0,
}


def _expected(strategy: str, maximum=MAXIMUM, temperature: float = 2.0) -> dict[str, float]:
  rates = {name: FORMULAS[strategy](n, maximum or n, temperature) for name, n in SIZES.items()}
  return {name: rate / sum(rates.values()) for name, rate in rates.items()}


def _register(name: str, size, task_id: int) -> seqio.Task:
  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensors({"targets": tf.constant([task_id], tf.int32)}).repeat(64)

  seqio.TaskRegistry.remove(name)
  num_examples = {"train": size} if size is not None else None
  return seqio.TaskRegistry.add(
    name,
    source=seqio.FunctionDataSource(dataset_fn, splits=["train"], num_input_examples=num_examples),
    output_features=FEATURES,
    preprocessors=[],
  )


def _mixture(name: str, task_names=tuple(SIZES)) -> seqio.Mixture:
  seqio.MixtureRegistry.remove(name)
  return seqio.MixtureRegistry.add(name, list(task_names), default_rate=mixing.rate_for(name))


@pytest.fixture(autouse=True, name="sized_tasks")
def fixture_sized_tasks():
  for task_id, (name, size) in enumerate(SIZES.items()):
    _register(name, size, task_id)
  yield
  for name in ("mix_test", "mix_test_a", "mix_test_b", "mix_test_c", "mix_test_unsized_mix"):
    seqio.MixtureRegistry.remove(name)
  for name in [*SIZES, "mix_test_unsized"]:
    seqio.TaskRegistry.remove(name)


@pytest.mark.parametrize("strategy", mixing.STRATEGIES)
def test_rates_follow_formula(strategy):
  mixture = _mixture("mix_test")
  gin.parse_config(
    f"mix_test/mixing_rate.strategy = '{strategy}'\nmix_test/mixing_rate.maximum = {MAXIMUM}"
  )
  assert mixing.normalized_rates(mixture) == pytest.approx(_expected(strategy), rel=1e-12)


def test_default_is_temperature_two_without_cap():
  rates = mixing.normalized_rates(_mixture("mix_test"))
  assert rates == pytest.approx(_expected("temperature", maximum=None), rel=1e-12)


def test_temperature_one_is_examples_proportional():
  mixture = _mixture("mix_test")
  gin.parse_config("mixing_rate.temperature = 1.0")
  assert mixing.normalized_rates(mixture) == pytest.approx(
    _expected("proportional", maximum=None), rel=1e-12
  )


def test_each_mixture_gets_its_own_bindings():
  mixtures = {name: _mixture(name) for name in ("mix_test_a", "mix_test_b", "mix_test_c")}
  gin.parse_config(
    """
    mixing_rate.temperature = 3.0
    mix_test_a/mixing_rate.strategy = 'equal'
    mix_test_b/mixing_rate.strategy = 'proportional'
    mix_test_b/mixing_rate.maximum = 500
    """
  )
  rates = {name: mixing.normalized_rates(mixture) for name, mixture in mixtures.items()}
  assert rates["mix_test_a"] == pytest.approx(_expected("equal"), rel=1e-12)
  assert rates["mix_test_b"] == pytest.approx(_expected("proportional", maximum=500), rel=1e-12)
  # The unconfigured mixture takes the unscoped binding (T = 3) and the defaults.
  assert rates["mix_test_c"] == pytest.approx(
    _expected("temperature", maximum=None, temperature=3.0), rel=1e-12
  )
  # An enclosing gin scope does not hide the mixture's own bindings.
  with gin.config_scope("train"):
    assert mixing.normalized_rates(mixtures["mix_test_a"]) == pytest.approx(_expected("equal"))


def _sampled_frequencies(mixture: seqio.Mixture, num_draws: int) -> dict[str, float]:
  ds = mixture.get_dataset({"targets": 4}, split="train", shuffle=False, seed=3, num_epochs=None)
  counts = collections.Counter(
    int(ex["targets"][0]) for ex in ds.take(num_draws).as_numpy_iterator()
  )
  return {name: counts[task_id] / num_draws for task_id, name in enumerate(SIZES)}


@pytest.mark.parametrize("strategy", mixing.STRATEGIES)
def test_sampling_frequencies_match_the_strategy(strategy):
  mixture = _mixture("mix_test")
  gin.parse_config(
    f"mix_test/mixing_rate.strategy = '{strategy}'\nmix_test/mixing_rate.maximum = {MAXIMUM}"
  )
  frequencies = _sampled_frequencies(mixture, num_draws=6000)

  def error(rates):
    return max(abs(frequencies[name] - rates[name]) for name in SIZES)

  tolerance = 0.025  # 4 standard deviations of a frequency near 1/3 over 6000 draws
  assert error(mixing.normalized_rates(mixture)) < tolerance, frequencies
  for other in set(mixing.STRATEGIES) - {strategy}:
    assert error(_expected(other)) > 2 * tolerance, (other, frequencies)


def test_equal_mixing_does_not_need_sizes():
  _register("mix_test_unsized", None, 3)
  mixture = _mixture("mix_test_unsized_mix", [*SIZES, "mix_test_unsized"])
  with pytest.raises(ConfigError) as e:
    mixing.normalized_rates(mixture)
  assert str(e.value).splitlines()[0] == (
    "Task 'mix_test_unsized' does not know its number of 'train' examples, which the "
    "'temperature' strategy of mixture 'mix_test_unsized_mix' (gin "
    "mix_test_unsized_mix/mixing_rate.strategy, or mixing_rate.strategy for all) needs; "
    "use 'equal'."
  )
  gin.parse_config("mix_test_unsized_mix/mixing_rate.strategy = 'equal'")
  assert set(mixing.normalized_rates(mixture).values()) == {0.25}


@pytest.mark.parametrize(
  "binding, message",
  [
    (
      "mix_test/mixing_rate.strategy = 'equl'",
      "Mixing strategy 'equl' of mixture 'mix_test' (gin mix_test/mixing_rate.strategy, or "
      "mixing_rate.strategy for all) is not one of ('proportional', 'temperature', 'equal').",
    ),
    (
      "mixing_rate.temperature = 0.0",
      "Mixing temperature 0.0 of mixture 'mix_test' (gin mix_test/mixing_rate.temperature, or "
      "mixing_rate.temperature for all) must be a number > 0.",
    ),
    (
      "mix_test/mixing_rate.maximum = -5",
      "Mixing maximum -5 of mixture 'mix_test' (gin mix_test/mixing_rate.maximum, or "
      "mixing_rate.maximum for all) must be an integer > 0 or None.",
    ),
  ],
)
def test_bad_binding_is_one_line_naming_mixture_and_binding(binding, message):
  mixture = _mixture("mix_test")
  gin.parse_config(binding)
  with pytest.raises(ConfigError) as e:
    mixing.normalized_rates(mixture)
  # gin appends "In call to configurable ..." lines, which t5x_lite.core.errors.fail drops.
  assert str(e.value).splitlines()[0] == message


def test_bad_binding_outside_a_mixture_names_the_unscoped_binding():
  gin.parse_config("mixing_rate.maximum = 0")
  with pytest.raises(ConfigError, match=r"^Mixing maximum 0 of gin mixing_rate\.maximum must"):
    mixing.mixing_rate(seqio.TaskRegistry.get("mix_test_small"))


def test_scope_must_be_a_gin_name():
  with pytest.raises(ConfigError, match="'my-mix'"):
    mixing.rate_for("my-mix")


def test_local_multitask_and_leave_one_out_mixtures_are_registered():
  full = {"local_glue_rte", "local_glue_sst2", "local_multi30k_ende", "local_scitldr_a"}
  expected = {"local_multitask": full} | {
    f"local_multitask_without_{name.removeprefix('local_')}": full - {name} for name in full
  }
  # One gin scope for the family; 'equal' needs no sizes, so no data file is read.
  gin.parse_config("local_multitask/mixing_rate.strategy = 'equal'")
  for name, task_names in expected.items():
    rates = mixing.normalized_rates(seqio.MixtureRegistry.get(name))
    assert rates == pytest.approx(dict.fromkeys(task_names, 1 / len(task_names))), name

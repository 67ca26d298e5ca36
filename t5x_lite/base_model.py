"""The model contract: `BaseModel`, what the trainer, the loop and the runners call.

T5X's `BaseModel`: a model is pure functions of its params and a batch (loss, metrics,
scores, predictions), which `t5x_lite.training` and `t5x_lite.run` jit with shardings;
none of them asks what kind of model it has. The members:

* `t5x_lite.models.EncoderDecoderModel` and `DecoderOnlyModel`, siblings under
  `models.BaseTransformerModel` (a T5 network's loss, scores and decoding).
* `t5x_lite.distillation.DistillationModel`, which composes a student and a teacher model
  and keeps the teacher's params as its auxiliary state, and its variants in
  `t5x_lite.distillation_modes` (several teachers; an EMA of the student as teacher).
* `t5x_lite.codistillation.CoDistillationModel`: two models in one params tree, each
  distilling the other.
* `t5x_lite.electra.ElectraModel`: a T5 network pre-trained with a generator and a
  replaced-token-detection head.

The last three are `DelegatingModel`s: they train their own way but evaluate, score,
predict and are saved as the T5 model they are built around.

Auxiliary state is a pytree a model keeps beside its trained params (a teacher's params,
an average of the params): the trainer shards it by its logical axes (`init_aux_state`),
the training loop makes it at every start (`start_aux_state`), the train step passes it to
`loss_fn` and replaces it after the update (`update_aux_state`). It gets no gradients and
no optimizer state; a model whose state evolves in training (an EMA teacher) sets
`checkpoint_aux_state`, and each training step saves it and a resume restores it.

Metrics travel as sums (`losses.metric_sums`) so they add over microbatches;
`finalize_metrics` turns them into the reported values.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Mapping

import flax.linen as nn
import jax

from t5x_lite.nn import flops, layers, losses, network
from t5x_lite.core.types import PyTree

if TYPE_CHECKING:
  import seqio

Batch = Mapping[str, jax.Array]
# (factor, weights [batch, target_len]) of a whole batch: `BaseModel.loss_normalization`.
Normalization = tuple[float | jax.Array, jax.Array]


class BaseModel(abc.ABC):
  """What the trainer, the training loop, the evaluators and the runners call.

  T5X's `BaseModel`: a model is pure functions of its params and a batch, which the
  trainer and the runners jit. Parameters come boxed with
  their logical axes; the auxiliary state (see the module docstring) defaults to none.
  A new model implements the abstract methods; the trainer needs no change.

  Attributes:
    input_vocabulary: vocabulary of the inputs.
    output_vocabulary: vocabulary of the targets (its `eos_id` ends decoding).
  """

  input_vocabulary: seqio.Vocabulary
  output_vocabulary: seqio.Vocabulary
  # Whether training checkpoints keep the auxiliary state, so a resumed run continues it
  # (True for state that `update_aux_state` changes); False: `start_aux_state` makes it
  # at every start, a resume included.
  checkpoint_aux_state: bool = False
  # Tasks of the training mixture whose target tokens the training batches mark with
  # their 1-based index here, in the feature `decoder_task_ids` (0 for other tasks; see
  # `t5x_lite.data.pipeline`); empty: the batches carry no task ids.
  train_task_ids: tuple[str, ...] = ()

  @property
  @abc.abstractmethod
  def network_config(self) -> network.T5Config:
    """The trained network's config: stored with checkpoints, read by the data pipeline
    (`pipeline.for_model`), and what eval and infer rebuild the model from."""

  @abc.abstractmethod
  def init_params(self, rng: jax.Array) -> PyTree:
    """Boxed initial params (`nn.LogicallyPartitioned` leaves) from one PRNG key."""

  def param_axes(self) -> PyTree:
    """The params' tree of logical axis names (a `PartitionSpec` of names per leaf).

    Nothing is allocated: the params are traced with an abstract key.
    """
    return nn.get_partition_spec(layers.abstract_boxed_params(self.init_params))

  @abc.abstractmethod
  def loss_normalization(self, batch: Batch) -> Normalization:
    """The normalizing factor and loss weights of a whole batch.

    The trainer calls this once on the full batch, puts the weights in the batch as
    `decoder_loss_weights` and passes (factor, a microbatch's weights) to every
    microbatch's `loss_fn`, so accumulated losses and gradients equal the full-batch
    ones for every normalizing mode.

    Returns:
      (factor, weights [batch, target_len] float32); factor 1.0 means a plain sum.
    """

  @abc.abstractmethod
  def loss_fn(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    normalization: Normalization | None = None,
    aux_state: PyTree = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training loss and metric sums; differentiated with respect to `params` only.

    Args:
      params: plain (unboxed) or boxed params.
      batch: the model's features.
      dropout_rng: PRNG key for dropout; None disables dropout.
      normalization: `loss_normalization` of the enclosing full batch (used for
        microbatches); None computes it from `batch`.
      aux_state: the auxiliary state in training; None in evaluation, which then
        reports the model's plain objective.

    Returns:
      (loss, metric sums): `finalize_metrics` turns the sums into metrics.
    """

  def finalize_metrics(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Metric sums -> {loss, cross_ent_loss, z_loss, accuracy, nonpadding_fraction,
    num_sequences, num_tokens, num_input_tokens} (see `losses.finalize_metrics`)."""
    return losses.finalize_metrics(sums)

  def eval_fn(self, params: PyTree, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss and finalized metrics without dropout or auxiliary state.

    Returns:
      (loss, metrics) with the metric names of `finalize_metrics`.
    """
    loss, sums = self.loss_fn(params, batch, None)
    return loss, self.finalize_metrics(sums)

  @abc.abstractmethod
  def score_batch(self, params: PyTree, batch: Batch) -> jax.Array:
    """Per-example sum of target log-likelihoods, [batch] float32 (<= 0)."""

  @abc.abstractmethod
  def predict_batch_with_aux(
    self,
    params: PyTree,
    batch: Batch,
    rng: jax.Array | None = None,
    *,
    decoder_params: Mapping[str, Any] | None = None,
    return_all_decodes: bool = False,
    num_decodes: int = 1,
    decode_fn: str = "greedy",
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Autoregressive predictions and their scores (arguments and results: see
    `BaseTransformerModel.predict_batch_with_aux`)."""

  def predict_batch(
    self, params: PyTree, batch: Batch, rng: jax.Array | None = None, **kwargs: Any
  ) -> jax.Array:
    """`predict_batch_with_aux` without the scores (same arguments)."""
    return self.predict_batch_with_aux(params, batch, rng, **kwargs)[0]

  def train_flops_per_step(self, batch_size: int, input_length: int, target_length: int) -> float:
    """Model FLOPs of one training step, for MFU: forward and backward of the network
    (`flops.flops_per_token`); a model adds what else its step computes.

    Args:
      batch_size: rows per step.
      input_length: the network's input length (0 for a decoder-only network).
      target_length: the network's target length.
    """
    tokens = batch_size * (input_length + target_length)
    return flops.flops_per_token(self.network_config, input_length, target_length) * tokens

  def init_aux_state(self, rng: jax.Array) -> PyTree:
    """Boxed auxiliary state of the right shapes and logical axes; None: there is none.

    Traced with an abstract key only, for shapes and shardings (`start_aux_state` makes
    the values).
    """
    del rng
    return None

  def start_aux_state(self, abstract: PyTree, params: PyTree) -> PyTree:
    """The auxiliary state at the start of a run (fresh, resumed or fine-tuned).

    Args:
      abstract: `init_aux_state`'s tree as `jax.ShapeDtypeStruct`s carrying their
        shardings (a restore target).
      params: the run's starting params, sharded.

    Returns:
      The state, in `abstract`'s shardings, in buffers of its own: the train step
      donates the params and the auxiliary state, so a state made from `params` copies
      them.
    """
    del abstract, params
    return None

  def update_aux_state(self, aux_state: PyTree, params: PyTree, step: jax.Array) -> PyTree:
    """The auxiliary state after an update (inside the jitted train step).

    Args:
      aux_state: the state this step's `loss_fn` read.
      params: the params after this step's update.
      step: int32 scalar, the number of updates applied (this one included).
    """
    del params, step
    return aux_state


class DelegatingModel(BaseModel):
  """A model built around another: it trains its own way (its `loss_fn`) but its config,
  loss normalization, scores and predictions are the inner model's, on the part of the
  params that is the inner model's (`inner_params`).

  Args:
    inner: the model that evaluates, scores, predicts and is restored for fine-tuning.
  """

  def __init__(self, inner: BaseModel):
    self.inner = inner
    self.input_vocabulary = inner.input_vocabulary
    self.output_vocabulary = inner.output_vocabulary

  def inner_params(self, params: PyTree) -> PyTree:
    """The inner model's params within this model's (all of them by default)."""
    return params

  @property
  def network_config(self) -> network.T5Config:
    """The inner model's: what checkpoints store and eval, infer, fine-tuning rebuild."""
    return self.inner.network_config

  def loss_normalization(self, batch: Batch) -> Normalization:
    """The inner model's (its `loss_normalizing_factor`)."""
    return self.inner.loss_normalization(batch)

  def score_batch(self, params: PyTree, batch: Batch) -> jax.Array:
    """The inner model's scores."""
    return self.inner.score_batch(self.inner_params(params), batch)

  def predict_batch_with_aux(
    self,
    params: PyTree,
    batch: Batch,
    rng: jax.Array | None = None,
    *,
    decoder_params: Mapping[str, Any] | None = None,
    return_all_decodes: bool = False,
    num_decodes: int = 1,
    decode_fn: str = "greedy",
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The inner model's predictions."""
    return self.inner.predict_batch_with_aux(
      self.inner_params(params),
      batch,
      rng,
      decoder_params=decoder_params,
      return_all_decodes=return_all_decodes,
      num_decodes=num_decodes,
      decode_fn=decode_fn,
    )

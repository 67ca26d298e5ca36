"""Pure train and eval steps, jitted once each with explicit shardings.

This is the one place that calls `jax.jit` on model code. Parameters shard by the
logical axes they were created with (`partitioning.logical_shardings`); optimizer
statistics shard like their parameters (`opt_state_shardings`); batches shard over
the mesh's 'data' axis; the step counter and metrics are replicated. Steps run under
`jax.set_mesh(mesh)` and `nn.logical_axis_rules(rules)` so the network's
`nn.with_logical_constraint` calls resolve against the same table.

Gradient accumulation: the batch's loss normalizing factor and weights are computed
once on the full batch; each of `num_microbatches` slices is then differentiated with
those, and gradients and metric sums are added in a `lax.scan`. The accumulated update
therefore equals the full-batch update for every normalizing mode.
"""

import contextlib
from typing import Any, Callable, Iterator, Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_lite import models, optimizers, partitioning

PyTree = Any
Batch = Mapping[str, jax.Array]
Rules = tuple[tuple[str, Any], ...]


class TrainState(flax.struct.PyTreeNode):
  """Everything a training step updates.

  Attributes:
    step: int32 scalar, number of updates applied so far.
    params: plain (unboxed) parameter tree.
    opt_state: the optax state for `params`.
  """

  step: jax.Array
  params: PyTree
  opt_state: optax.OptState


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Mesh and logical-axis rules in scope, so `nn.with_logical_constraint` applies.

  Steps made here enter it around every call; enter it yourself to trace or jit
  other model functions (e.g. `predict_batch`) with the same activation shardings.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def opt_state_shardings(
  abstract_opt_state: PyTree, abstract_params: PyTree, param_shardings: PyTree, mesh: Mesh
) -> PyTree:
  """Shardings for an optax state: parameter-shaped statistics follow their parameter.

  Every sub-tree of the optax state with the parameter tree's structure (Adafactor's
  v_row/v_col/v, Adam's mu/nu, ...) is matched leaf by leaf with the parameters: a
  leaf with its parameter's shape gets the parameter's sharding; smaller leaves
  (factored row/column vectors, (1,) placeholders) are replicated, as is every leaf
  outside such sub-trees (step counts).

  Args:
    abstract_opt_state: `jax.eval_shape(optimizer.init, abstract_params)`.
    abstract_params: unboxed parameter tree of ShapeDtypeStructs (or arrays).
    param_shardings: NamedSharding per parameter, same structure.
    mesh: the device mesh.

  Returns:
    A tree of NamedSharding with the structure of `abstract_opt_state`.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  params_def = jax.tree.structure(abstract_params)
  param_leaves = params_def.flatten_up_to(abstract_params)
  sharding_leaves = params_def.flatten_up_to(param_shardings)

  def is_params_like(node: PyTree) -> bool:
    return jax.tree.structure(node) == params_def

  def shard(node: PyTree) -> PyTree:
    if not is_params_like(node):
      return replicated
    leaves = params_def.flatten_up_to(node)
    return params_def.unflatten(
      [
        sharding if leaf.shape == param.shape else replicated
        for leaf, param, sharding in zip(leaves, param_leaves, sharding_leaves)
      ]
    )

  return jax.tree.map(shard, abstract_opt_state, is_leaf=is_params_like)


def abstract_train_state(
  model: models.EncoderDecoderModel,
  optimizer: optimizers.Optimizer,
  input_shapes: Mapping[str, tuple[int, ...]],
  mesh: Mesh,
  rules: Rules,
) -> tuple[TrainState, TrainState]:
  """The TrainState's shapes and shardings, without allocating anything.

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    input_shapes: feature shapes for `model.get_initial_variables`.
    mesh: device mesh with axes ('data', 'model').
    rules: logical-axis rules (`partitioning.standard_logical_axis_rules`).

  Returns:
    (abstract state, state_shardings): a TrainState of `jax.ShapeDtypeStruct`s that
    carry their sharding (a restore target for checkpoints), and the TrainState-shaped
    tree of NamedSharding (params by logical axes, optimizer statistics like their
    params, step replicated).
  """

  def init_params(key: jax.Array) -> PyTree:
    return model.get_initial_variables(key, input_shapes)["params"]

  with sharding_context(mesh, rules):
    boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  params = nn.meta.unbox(boxed)
  param_shardings = partitioning.logical_shardings(boxed, mesh, rules)
  opt_state = jax.eval_shape(optimizer.init, params)
  shardings = TrainState(
    step=NamedSharding(mesh, PartitionSpec()),
    params=param_shardings,
    opt_state=opt_state_shardings(opt_state, params, param_shardings, mesh),
  )
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=opt_state)
  abstract = jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    shapes,
    shardings,
  )
  return abstract, shardings


def init_train_state(
  model: models.EncoderDecoderModel,
  optimizer: optimizers.Optimizer,
  input_shapes: Mapping[str, tuple[int, ...]],
  rng: jax.Array,
  mesh: Mesh,
  rules: Rules,
) -> tuple[TrainState, TrainState]:
  """Initialises params and optimizer state directly in their shardings.

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    input_shapes: feature shapes for `model.get_initial_variables`.
    rng: PRNG key for parameter initialisation.
    mesh: device mesh with axes ('data', 'model').
    rules: logical-axis rules (`partitioning.standard_logical_axis_rules`).

  Returns:
    (state, state_shardings): a sharded step-0 TrainState, and the TrainState-shaped
    tree of NamedSharding used for it (pass it to `make_train_step`).
  """
  _, state_shardings = abstract_train_state(model, optimizer, input_shapes, mesh, rules)

  def init_fn(key: jax.Array) -> TrainState:
    params = nn.meta.unbox(model.get_initial_variables(key, input_shapes)["params"])
    return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )

  with sharding_context(mesh, rules):
    state = jax.jit(init_fn, out_shardings=state_shardings)(rng)
  return state, state_shardings


def _split_microbatches(batch: Batch, num_microbatches: int, mesh: Mesh) -> Batch:
  """[batch, ...] -> [num_microbatches, batch / num_microbatches, ...] per feature.

  Microbatch i takes rows i, i + n, i + 2n, ... so every device keeps its own rows
  (no resharding) when its local batch is divisible by n.
  """
  data_spec = partitioning.batch_sharding(mesh).spec
  sharding = NamedSharding(mesh, PartitionSpec(None, *data_spec[:1]))

  def split(x: jax.Array) -> jax.Array:
    if x.shape[0] % num_microbatches:
      raise ValueError(f"Batch {x.shape[0]} not divisible by {num_microbatches} parts.")
    rows = x.shape[0] // num_microbatches
    x = x.reshape((rows, num_microbatches) + x.shape[1:])  # [rows, n, ...]
    x = jnp.swapaxes(x, 0, 1)  # [n, rows, ...]
    return jax.lax.with_sharding_constraint(x, sharding)

  return {name: split(x) for name, x in batch.items()}


def accumulate_gradients(
  model: models.EncoderDecoderModel,
  params: PyTree,
  batch: Batch,
  rng: jax.Array,
  num_microbatches: int,
  mesh: Mesh,
  param_shardings: PyTree,
) -> tuple[PyTree, dict[str, jax.Array]]:
  """Gradients and metric sums of the full batch, over `num_microbatches` slices.

  Args:
    model: the model.
    params: plain params.
    batch: the full (global) batch.
    rng: dropout PRNG key for this step (microbatch i uses fold_in(rng, i)).
    num_microbatches: number of sequential slices (1: no accumulation).
    mesh: the device mesh.
    param_shardings: NamedSharding per parameter (gradients are kept in it).

  Returns:
    (grads, metric sums), both summed over microbatches.
  """
  factor, weights = model.loss_normalization(batch)
  batch = dict(batch, decoder_loss_weights=weights)
  grad_fn = jax.grad(model.loss_fn, has_aux=True)

  def micro_grads(mb: Batch, key: jax.Array) -> tuple[PyTree, dict[str, jax.Array]]:
    grads, sums = grad_fn(params, mb, key, normalization=(factor, mb["decoder_loss_weights"]))
    return jax.lax.with_sharding_constraint(grads, param_shardings), sums

  if num_microbatches == 1:
    return micro_grads(batch, rng)
  microbatches = _split_microbatches(batch, num_microbatches, mesh)

  def body(carry: PyTree, inputs: tuple[jax.Array, Batch]) -> tuple[PyTree, None]:
    index, mb = inputs
    result = micro_grads(mb, jax.random.fold_in(rng, index))
    return jax.tree.map(jnp.add, carry, result), None

  first = jax.tree.map(lambda x: x[0], microbatches)
  zeros = jax.tree.map(
    lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro_grads, first, rng)
  )
  zeros = (jax.lax.with_sharding_constraint(zeros[0], param_shardings), zeros[1])
  (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(num_microbatches), microbatches))
  return grads, sums


def train_step(
  model: models.EncoderDecoderModel,
  optimizer: optimizers.Optimizer,
  state: TrainState,
  batch: Batch,
  rng: jax.Array,
  *,
  num_microbatches: int,
  mesh: Mesh,
  param_shardings: PyTree,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update (pure; `make_train_step` jits it).

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    state: the current TrainState.
    batch: global batch of EncDecFeatureConverter features.
    rng: base PRNG key; the step's dropout key is fold_in(rng, state.step).
    num_microbatches: gradient-accumulation slices.
    mesh: the device mesh.
    param_shardings: NamedSharding per parameter.

  Returns:
    (new state, metrics): `models.EncoderDecoderModel.finalize_metrics` names plus
    learning_rate (applied at this step) and grad_norm (global, before clipping).
  """
  step_rng = jax.random.fold_in(rng, state.step)
  grads, sums = accumulate_gradients(
    model, state.params, batch, step_rng, num_microbatches, mesh, param_shardings
  )
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = model.finalize_metrics(sums)
  metrics["learning_rate"] = optimizer.learning_rate(state.step)
  metrics["grad_norm"] = optax.global_norm(grads)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def make_train_step(
  model: models.EncoderDecoderModel,
  optimizer: optimizers.Optimizer,
  mesh: Mesh,
  rules: Rules,
  state_shardings: TrainState,
  num_microbatches: int = 1,
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
  """Jits `train_step` once with explicit shardings and a donated state.

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    mesh: the device mesh.
    rules: logical-axis rules.
    state_shardings: from `init_train_state`.
    num_microbatches: gradient-accumulation slices (global batch must divide).

  Returns:
    fn(state, batch, rng) -> (state, metrics). The input state is donated (do not
    reuse it); batch leaves are [global_batch, ...] sharded over 'data' (host numpy
    arrays are placed accordingly); metrics are replicated device scalars.
  """
  replicated = NamedSharding(mesh, PartitionSpec())

  def step(state: TrainState, batch: Batch, rng: jax.Array):
    return train_step(
      model,
      optimizer,
      state,
      batch,
      rng,
      num_microbatches=num_microbatches,
      mesh=mesh,
      param_shardings=state_shardings.params,
    )

  jitted = jax.jit(
    step,
    in_shardings=(state_shardings, partitioning.batch_sharding(mesh), replicated),
    out_shardings=(state_shardings, replicated),
    donate_argnums=(0,),
  )

  def run(state: TrainState, batch: Batch, rng: jax.Array):
    with sharding_context(mesh, rules):
      return jitted(state, batch, rng)

  return run


def make_eval_step(
  model: models.EncoderDecoderModel,
  mesh: Mesh,
  rules: Rules,
  state_shardings: TrainState,
) -> Callable[[PyTree, Batch], dict[str, jax.Array]]:
  """Jits the eval step: teacher-forced loss and metrics without dropout.

  Args:
    model: the model.
    mesh: the device mesh.
    rules: logical-axis rules.
    state_shardings: from `init_train_state` (its `params` shardings are used).

  Returns:
    fn(params, batch) -> metrics (names of `finalize_metrics`), replicated scalars.
  """

  def step(params: PyTree, batch: Batch) -> dict[str, jax.Array]:
    return model.eval_fn(params, batch)[1]

  jitted = jax.jit(
    step,
    in_shardings=(state_shardings.params, partitioning.batch_sharding(mesh)),
    out_shardings=NamedSharding(mesh, PartitionSpec()),
  )

  def run(params: PyTree, batch: Batch) -> dict[str, jax.Array]:
    with sharding_context(mesh, rules):
      return jitted(params, batch)

  return run

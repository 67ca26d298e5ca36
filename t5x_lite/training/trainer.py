"""Pure train and eval steps, and their jitted forms with explicit shardings.

`train_step` and `eval_step` are pure. `make_train_step` / `make_eval_step` jit
them through the `partitioning.Partitioner` (the one place model code is jitted);
the returned `PartitionedFunction` is what training calls and what
`t5x_lite.run.precompile` lowers for a TPU slice. Parameters shard by the logical axes
they were created with; optimizer statistics shard like their parameters
(`opt_state_shardings`); batches shard over the mesh's 'data' axis; the step
counter and metrics are replicated. Steps run under the partitioner's mesh and
rules, so the network's `nn.with_logical_constraint` calls resolve against the same
table.

Gradient accumulation: the batch's loss normalizing factor and weights are computed
once on the full batch; each of `num_microbatches` slices is then differentiated with
those, and gradients and metric sums are added in a `lax.scan`. The accumulated update
therefore equals the full-batch update for every normalizing mode.

The steps call the model only through its contract (`t5x_lite.base_model.BaseModel`): a
model's auxiliary state (a distillation teacher's params, say) rides in
`TrainState.aux_state`, is passed to its `loss_fn` and replaced by its `update_aux_state`
after the optimizer.
"""

from typing import Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_lite.base_model import BaseModel
from t5x_lite.training import optimizers, partitioning
from t5x_lite.core.types import PyTree

Batch = Mapping[str, jax.Array]


class TrainState(flax.struct.PyTreeNode):
  """Everything a training step updates.

  Attributes:
    step: int32 scalar, number of updates applied so far.
    params: plain (unboxed) parameter tree.
    opt_state: the optax state for `params`.
    aux_state: the model's auxiliary state (`BaseModel.init_aux_state`; None for most
      models): not trained, never checkpointed; the training loop makes it with
      `BaseModel.start_aux_state` before the first step.
  """

  step: jax.Array
  params: PyTree
  opt_state: optax.OptState
  aux_state: PyTree = None


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
  model: BaseModel,
  optimizer: optimizers.Optimizer,
  partitioner: partitioning.Partitioner,
) -> tuple[TrainState, TrainState]:
  """The TrainState's shapes and shardings: nothing allocated, no PRNG key made.

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    partitioner: mesh and logical-axis rules.

  Returns:
    (abstract state, state_shardings): a TrainState of `jax.ShapeDtypeStruct`s that
    carry their sharding (a restore target for checkpoints; inputs to lower the step
    for compile-only devices), and the TrainState-shaped tree of NamedSharding
    (params by logical axes, optimizer statistics like their params, step replicated;
    the model's auxiliary state by its logical axes).
  """
  params, param_shardings = partitioner.abstract_params(model.init_params)
  optimizer = optimizer.with_param_axes(model.param_axes())
  opt_state = jax.eval_shape(optimizer.init, params)
  aux_state, aux_shardings = partitioner.abstract_params(model.init_aux_state)
  # Trees shaped like TrainState: of shardings, and of abstract values.
  shardings = TrainState(
    step=partitioner.replicated,  # pyright: ignore[reportArgumentType]
    params=param_shardings,
    opt_state=opt_state_shardings(opt_state, params, param_shardings, partitioner.mesh),
    aux_state=aux_shardings,
  )
  shapes = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),  # pyright: ignore[reportArgumentType]
    params=params,
    opt_state=opt_state,
    aux_state=aux_state,
  )
  abstract = jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    shapes,
    shardings,
  )
  return abstract, shardings


def init_train_state(
  model: BaseModel,
  optimizer: optimizers.Optimizer,
  rng: jax.Array,
  partitioner: partitioning.Partitioner,
) -> tuple[TrainState, TrainState]:
  """Initialises params and optimizer state directly in their shardings.

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    rng: PRNG key for parameter initialisation.
    partitioner: mesh and logical-axis rules.

  Returns:
    (state, state_shardings): a sharded step-0 TrainState, and the TrainState-shaped
    tree of NamedSharding used for it (pass it to `make_train_step`). The model's
    auxiliary state is not made here: set `aux_state` to `model.start_aux_state(...)`
    (`train_lib` does) before the first step.
  """
  _, state_shardings = abstract_train_state(model, optimizer, partitioner)
  optimizer = optimizer.with_param_axes(model.param_axes())

  def init_fn(key: jax.Array) -> TrainState:
    params = nn.meta.unbox(model.init_params(key))
    return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )

  init = partitioner.jit(
    init_fn,
    in_shardings=partitioner.replicated,
    out_shardings=state_shardings.replace(aux_state=None),
  )
  return init(rng), state_shardings


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
  model: BaseModel,
  params: PyTree,
  batch: Batch,
  rng: jax.Array,
  num_microbatches: int,
  mesh: Mesh,
  param_shardings: PyTree,
  aux_state: PyTree = None,
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
    aux_state: the model's auxiliary state, passed to `model.loss_fn` (which is
      differentiated with respect to `params` only).

  Returns:
    (grads, metric sums), both summed over microbatches.
  """
  factor, weights = model.loss_normalization(batch)
  batch = dict(batch, decoder_loss_weights=weights)
  grad_fn = jax.grad(model.loss_fn, has_aux=True)

  def micro_grads(mb: Batch, key: jax.Array) -> tuple[PyTree, dict[str, jax.Array]]:
    normalization = (factor, mb["decoder_loss_weights"])
    grads, sums = grad_fn(params, mb, key, normalization=normalization, aux_state=aux_state)
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
  model: BaseModel,
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
    batch: global batch of the model's features.
    rng: base PRNG key; the step's dropout key is fold_in(rng, state.step).
    num_microbatches: gradient-accumulation slices.
    mesh: the device mesh.
    param_shardings: NamedSharding per parameter.

  Returns:
    (new state, metrics): `model.finalize_metrics` names plus learning_rate (applied
    at this step) and grad_norm (global, before clipping).
  """
  step_rng = jax.random.fold_in(rng, state.step)
  grads, sums = accumulate_gradients(
    model,
    state.params,
    batch,
    step_rng,
    num_microbatches,
    mesh,
    param_shardings,
    aux_state=state.aux_state,
  )
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = model.finalize_metrics(sums)
  metrics["learning_rate"] = optimizer.learning_rate(state.step)
  metrics["grad_norm"] = optax.global_norm(grads)
  step = state.step + 1
  aux_state = model.update_aux_state(state.aux_state, params, step)
  new_state = state.replace(step=step, params=params, opt_state=opt_state, aux_state=aux_state)
  return new_state, metrics


def make_train_step(
  model: BaseModel,
  optimizer: optimizers.Optimizer,
  partitioner: partitioning.Partitioner,
  state_shardings: TrainState,
  num_microbatches: int = 1,
) -> partitioning.PartitionedFunction:
  """Jits `train_step` once with explicit shardings and a donated state.

  Args:
    model: the model.
    optimizer: an `optimizers.Optimizer`.
    partitioner: mesh and logical-axis rules.
    state_shardings: from `init_train_state` or `abstract_train_state`.
    num_microbatches: gradient-accumulation slices (global batch must divide).

  Returns:
    fn(state, batch, rng) -> (state, metrics); `fn.lower(...)` lowers this same
    function (`t5x_lite.run.precompile`). The input state is donated (do not reuse it);
    batch leaves are [global_batch, ...] sharded over 'data' (host numpy arrays are
    placed accordingly); metrics are replicated device scalars.
  """
  optimizer = optimizer.with_param_axes(model.param_axes())

  def step(state: TrainState, batch: Batch, rng: jax.Array):
    return train_step(
      model,
      optimizer,
      state,
      batch,
      rng,
      num_microbatches=num_microbatches,
      mesh=partitioner.mesh,
      param_shardings=state_shardings.params,
    )

  return partitioner.jit(
    step,
    in_shardings=(state_shardings, partitioner.batch_sharding, partitioner.replicated),
    out_shardings=(state_shardings, partitioner.replicated),
    donate_argnums=(0,),
  )


def eval_step(model: BaseModel, params: PyTree, batch: Batch) -> dict[str, jax.Array]:
  """Teacher-forced loss and metrics without dropout (pure; `make_eval_step` jits it).

  The metrics are the training objective's (`finalize_metrics`: loss with z-loss and
  label smoothing, accuracy, ...), so they compare with the training curve.
  """
  return model.eval_fn(params, batch)[1]


def make_eval_step(
  model: BaseModel,
  partitioner: partitioning.Partitioner,
  param_shardings: PyTree,
) -> partitioning.PartitionedFunction:
  """Jits `eval_step` with explicit shardings.

  Args:
    model: the model.
    partitioner: mesh and logical-axis rules.
    param_shardings: the training state's `params` shardings.

  Returns:
    fn(params, batch) -> metrics (names of `finalize_metrics`), replicated scalars.
  """
  return partitioner.jit(
    lambda params, batch: eval_step(model, params, batch),
    in_shardings=(param_shardings, partitioner.batch_sharding),
    out_shardings=partitioner.replicated,
  )

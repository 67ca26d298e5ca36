"""Multi-teacher and self-distillation: one teacher is exactly standard distillation,
the weighted sum matches a hand computation, the EMA teacher moves only by its rule,
and both train through the real loop; bad settings are one-line errors."""

import dataclasses
import json
import os

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import seqio
import tensorflow as tf

from t5x_lite import distillation, distillation_modes, models
from t5x_lite.checkpoint import checkpoints
from t5x_lite.core import errors, gin_config
from t5x_lite.data import pipeline
from t5x_lite.nn import network
from t5x_lite.training import optimizers, partitioning, trainer
from text_tasks import VOCAB, register_text_task
from tiny_models import (
  random_batch,
  train_on_task,
  init_params,
  save_params_checkpoint,
  tiny_checkpoint_config,
)

TASK = "distillation_modes_test_text"


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} line {i}: " + "ab" * (i % 5) for i in range(32)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts[::-1]})


register_text_task(TASK, _source, ["train", "validation"])


def _other_source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} other {i}: " + "cd" * (i % 3) for i in range(32)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts})


OTHER_TASK = register_text_task("distillation_modes_test_other", _other_source, ["train"])
MIXTURE = "distillation_modes_test_mix"
if MIXTURE not in seqio.MixtureRegistry.names():
  seqio.MixtureRegistry.add(MIXTURE, [TASK, OTHER_TASK], default_rate=1.0)
pytestmark = pytest.mark.usefixtures("clean_gin")
KWARGS = dict(z_loss=1e-4, label_smoothing=0.1, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS")


def _model(config: network.T5Config, **kwargs) -> models.EncoderDecoderModel:
  return models.EncoderDecoderModel(network.Transformer(config), VOCAB, VOCAB, **kwargs)


def _value_and_grad(model, params, batch, aux_state):
  fn = jax.value_and_grad(model.loss_fn, has_aux=True)
  return jax.jit(lambda p, a: fn(p, batch, None, aux_state=a))(params, aux_state)


def test_one_teacher_with_weight_one_is_exactly_standard_distillation():
  teacher_config = tiny_checkpoint_config(emb_dim=48, num_decoder_layers=2)
  student = _model(tiny_checkpoint_config(), **KWARGS)
  single = distillation.DistillationModel(
    student, _model(teacher_config), teacher_checkpoint="unused", alpha=0.4, temperature=2.0
  )
  multi = distillation_modes.MultiTeacherDistillationModel(
    student,
    [_model(teacher_config)],
    teacher_checkpoints=["unused"],
    weights=[1.0],
    alpha=0.4,
    temperature=2.0,
  )
  params, teacher = init_params(student.network_config, 0), init_params(teacher_config, 1)
  batch = random_batch(batch=8)
  (loss, sums), grads = _value_and_grad(single, params, batch, teacher)
  (multi_loss, multi_sums), multi_grads = _value_and_grad(multi, params, batch, (teacher,))
  np.testing.assert_array_equal(multi_loss, loss)
  jax.tree.map(np.testing.assert_array_equal, multi_grads, grads)
  for name, value in sums.items():
    np.testing.assert_array_equal(multi_sums[name], value, err_msg=name)
  assert float(sums["distill_kl"]) > 0.01
  np.testing.assert_array_equal(multi_sums["distill_kl_0"], sums["distill_kl"])


def test_several_teachers_give_the_weighted_sum_of_their_kls():
  configs = [tiny_checkpoint_config(emb_dim=48), tiny_checkpoint_config(num_decoder_layers=2)]
  student = _model(tiny_checkpoint_config(), **KWARGS)
  alpha, t, weights = 0.6, 3.0, (0.25, 0.75)
  multi = distillation_modes.MultiTeacherDistillationModel(
    student,
    [_model(c) for c in configs],
    teacher_checkpoints=["a", "b"],
    weights=weights,
    alpha=alpha,
    temperature=t,
  )
  params = init_params(student.network_config, 0)
  teachers = (init_params(configs[0], 10), init_params(configs[1], 11))
  # A sharper second teacher, so that the two KLs differ and the weights matter.
  teachers[1]["decoder"]["logits_dense"]["kernel"] *= 8.0
  batch = random_batch(seed=3, batch=8)
  loss, sums = multi.loss_fn(params, batch, None, aux_state=teachers)
  # By hand: each KL from the student's and that teacher's logits, normalised by the
  # number of real target tokens (the student's loss_normalizing_factor).
  logits = student.teacher_forced_logits(params, batch, None)
  w = batch["decoder_loss_weights"]
  kls = []
  for config, teacher_params in zip(configs, teachers):
    teacher_logits = _model(config).teacher_forced_logits(teacher_params, batch, None)
    kls.append(np.sum(distillation.soft_target_kl(logits, teacher_logits, t) * w) / w.sum())
  plain_loss, _ = student.loss_fn(params, batch, None)
  soft = weights[0] * kls[0] + weights[1] * kls[1]
  np.testing.assert_allclose(sums["distill_kl_0"], kls[0], rtol=1e-5)
  np.testing.assert_allclose(sums["distill_kl_1"], kls[1], rtol=1e-5)
  np.testing.assert_allclose(sums["distill_kl"], soft, rtol=1e-5)
  np.testing.assert_allclose(loss, alpha * t**2 * soft + (1 - alpha) * plain_loss, rtol=1e-5)
  assert abs(kls[0] - kls[1]) > 0.05  # two different teachers: the weights matter
  metrics = multi.finalize_metrics(sums)
  assert {"distill_kl", "distill_kl_0", "distill_kl_1"} <= set(metrics)
  teacher_grads = jax.grad(lambda tp: multi.loss_fn(params, batch, None, aux_state=tp)[0])(teachers)
  assert all(not np.any(g) for g in jax.tree.leaves(teacher_grads))


def test_per_task_teachers_teach_only_their_tasks_tokens():
  configs = [
    tiny_checkpoint_config(emb_dim=48),
    tiny_checkpoint_config(num_decoder_layers=2),
    tiny_checkpoint_config(num_encoder_layers=2),
  ]
  student = _model(tiny_checkpoint_config(), **KWARGS)
  params = init_params(student.network_config, 0)
  teachers = tuple(init_params(c, 20 + i) for i, c in enumerate(configs))
  teachers[1]["decoder"]["logits_dense"]["kernel"] *= 8.0  # KLs far apart
  batch = random_batch(seed=5, batch=8, targets=9)
  # Tasks "x" (id 1), "y" (id 2) and a task no teacher names (0), mixed within rows.
  ids = np.random.default_rng(5).integers(0, 3, batch["decoder_target_tokens"].shape)
  batch[pipeline.DECODER_TASK_IDS] = ids.astype(np.int32)
  w = batch["decoder_loss_weights"]
  logits = student.teacher_forced_logits(params, batch, None)
  kls = [
    np.asarray(
      distillation.soft_target_kl(logits, _model(c).teacher_forced_logits(p, batch, None), 2.0)
    )
    for c, p in zip(configs, teachers)
  ]  # each [batch, len]
  # Teacher 0 teaches "y"; teachers 1 and 2 share "x"; teacher 2 also teaches "y".
  tasks = [["y"], ["x"], ["x", "y"]]
  taught = [np.isin(ids, [2]), np.isin(ids, [1]), np.isin(ids, [1, 2])]
  by_mean = distillation_modes.MultiTeacherDistillationModel(
    student,
    [_model(c) for c in configs],
    teacher_checkpoints=["a", "b", "c"],
    weights=None,
    alpha=0.5,
    temperature=2.0,
    teacher_tasks=tasks,
  )
  assert by_mean.train_task_ids == ("x", "y")
  _, sums = jax.jit(lambda p, b: by_mean.loss_fn(p, b, None, aux_state=teachers))(params, batch)
  for i in range(3):
    np.testing.assert_allclose(
      sums[f"distill_kl_{i}"], np.sum(kls[i] * w * taught[i]) / w.sum(), rtol=1e-5
    )
  # Each token: the mean over its task's teachers; no teacher (id 0): no soft term.
  mean = np.where(ids == 1, (kls[1] + kls[2]) / 2, np.where(ids == 2, (kls[0] + kls[2]) / 2, 0))
  np.testing.assert_allclose(sums["distill_kl"], np.sum(mean * w) / w.sum(), rtol=1e-5)
  weighted = distillation_modes.MultiTeacherDistillationModel(
    student,
    [_model(c) for c in configs],
    teacher_checkpoints=["a", "b", "c"],
    weights=[0.5, 0.25, 2.0],
    alpha=0.5,
    temperature=2.0,
    teacher_tasks=tasks,
  )
  _, sums = weighted.loss_fn(params, batch, None, aux_state=teachers)
  by_hand = sum(wi * np.sum(kl * w * t) for wi, kl, t in zip((0.5, 0.25, 2.0), kls, taught))
  np.testing.assert_allclose(sums["distill_kl"], by_hand / w.sum(), rtol=1e-5)
  del batch[pipeline.DECODER_TASK_IDS]
  with pytest.raises(ValueError, match="decoder_task_ids"):
    by_mean.loss_fn(params, batch, None, aux_state=teachers)


def test_self_distillation_teacher_moves_only_by_the_ema_rule():
  decay = 0.75
  model = distillation_modes.SelfDistillationModel(
    _model(tiny_checkpoint_config(), **KWARGS), ema_decay=decay, alpha=0.5, temperature=2.0
  )
  params = init_params(model.network_config, 0)
  batch = random_batch(seed=4, batch=8)
  # The loss has no gradient with respect to the teacher (its logits are stopped).
  teacher = init_params(model.network_config, 1)
  teacher_grads = jax.grad(lambda tp: model.loss_fn(params, batch, None, aux_state=tp)[0])(teacher)
  assert all(not np.any(g) for g in jax.tree.leaves(teacher_grads))

  partitioner = partitioning.Partitioner(num_partitions=2)
  optimizer = optimizers.adafactor(learning_rate=0.05)
  state, shardings = trainer.init_train_state(model, optimizer, jax.random.PRNGKey(0), partitioner)
  abstract, _ = trainer.abstract_train_state(model, optimizer, partitioner)
  state = state.replace(aux_state=model.start_aux_state(abstract.aux_state, state.params))
  kernel = ("decoder", "logits_dense", "kernel")  # [embed, vocab]: vocab over 'model'
  aux_kernel = state.aux_state[kernel[0]][kernel[1]][kernel[2]]
  assert aux_kernel.sharding.spec == shardings.aux_state[kernel[0]][kernel[1]][kernel[2]].spec
  # It starts as a copy of the starting params.
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(state.aux_state), jax.device_get(state.params)
  )
  step = trainer.make_train_step(model, optimizer, partitioner, shardings)
  teacher_before, params_before = jax.device_get((state.aux_state, state.params))
  state, metrics = step(state, batch, jax.random.PRNGKey(1))
  assert abs(float(metrics["distill_kl"])) < 1e-6  # the teacher equals the student at step 0
  teacher_1, params_1 = jax.device_get((state.aux_state, state.params))
  state, metrics = step(state, batch, jax.random.PRNGKey(1))
  teacher_2, params_2 = jax.device_get((state.aux_state, state.params))
  assert float(metrics["distill_kl"]) > 0
  # By hand, in float64: t1 = d t0 + (1 - d) p1, t2 = d t1 + (1 - d) p2.
  for path, t0 in jax.tree_util.tree_leaves_with_path(teacher_before):
    p0 = _at(params_before, path)
    p1, p2 = _at(params_1, path), _at(params_2, path)
    assert not np.array_equal(p0, p1) or not np.array_equal(p1, p2), path
    t1 = decay * t0.astype(np.float64) + (1 - decay) * p1
    t2 = decay * t1 + (1 - decay) * p2
    np.testing.assert_allclose(_at(teacher_1, path), t1, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_at(teacher_2, path), t2, rtol=1e-6, atol=1e-7)


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return np.asarray(tree)


def test_decay_one_keeps_the_starting_params_as_the_teacher():
  model = distillation_modes.SelfDistillationModel(
    _model(tiny_checkpoint_config()), ema_decay=1.0, alpha=0.5, temperature=1.0
  )
  start, later = init_params(model.network_config, 0), init_params(model.network_config, 1)
  kept = model.update_aux_state(start, later, jax.numpy.int32(5))
  jax.tree.map(np.testing.assert_array_equal, kept, start)


def _train_records(model_dir) -> list[dict]:
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["split"] == "train"]


def test_multi_teacher_and_self_distillation_train_and_save_the_student(tmp_path):
  configs = [tiny_checkpoint_config(emb_dim=48), tiny_checkpoint_config(num_decoder_layers=2)]
  for i, config in enumerate(configs):
    save_params_checkpoint(tmp_path / f"teacher{i}", config, seed=7 + i)
  build = dict(config=tiny_checkpoint_config(), vocabulary=VOCAB)
  multi = distillation_modes.build_multi_teacher_distillation_model(
    teacher_checkpoint_paths=[str(tmp_path / "teacher0"), str(tmp_path / "teacher1")],
    teacher_weights=[0.5, 0.5],
    **build,
  )
  assert [t.network_config for t in multi.teachers] == configs
  selfd = distillation_modes.build_self_distillation_model(ema_decay=0.9, **build)
  plain_target = jax.eval_shape(lambda: init_params(tiny_checkpoint_config(), 0))
  for name, model in (("multi", multi), ("self", selfd)):
    state = train_on_task(TASK, tmp_path / name, 2, model)
    records = _train_records(tmp_path / name)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["distill_kl"] > 0
    # The checkpoint is the student's alone: it restores as a plain model.
    saved = checkpoints.saved_shapes(tmp_path / name / "2" / checkpoints.PARAMS)
    assert saved == checkpoints.flat_shapes(jax.device_get(state.params))
    restored = checkpoints.restore_params(tmp_path / name, plain_target)
    jax.tree.map(np.testing.assert_array_equal, restored, jax.device_get(state.params))


def test_per_task_teachers_train_on_a_mixture_and_must_name_its_tasks(tmp_path):
  for i in range(2):
    save_params_checkpoint(tmp_path / f"teacher{i}", tiny_checkpoint_config(), seed=3 + i)
  model = distillation_modes.build_multi_teacher_distillation_model(
    teacher_checkpoint_paths=[str(tmp_path / "teacher0"), str(tmp_path / "teacher1")],
    teacher_tasks=[OTHER_TASK, [TASK]],
    config=tiny_checkpoint_config(),
    vocabulary=VOCAB,
  )
  assert model.weights is None and model.train_task_ids == tuple(sorted([TASK, OTHER_TASK]))
  train_on_task(MIXTURE, tmp_path / "student", 2, model)
  last = _train_records(tmp_path / "student")[-1]
  assert last["step"] == 2 and last["distill_kl_0"] > 0 and last["distill_kl_1"] > 0
  # One teacher per task: the two teach disjoint tokens, which together are every token.
  np.testing.assert_allclose(
    last["distill_kl"], last["distill_kl_0"] + last["distill_kl_1"], rtol=1e-5
  )
  with pytest.raises(errors.ConfigError, match=f"task '{OTHER_TASK}', which is not in the "):
    train_on_task(TASK, tmp_path / "only_one_task", 2, model)
  # Resuming with other task ids would read other batches: refused, naming the binding.
  one_task = distillation_modes.build_multi_teacher_distillation_model(
    teacher_checkpoint_paths=[str(tmp_path / "teacher0")],
    teacher_tasks=[TASK],
    config=tiny_checkpoint_config(),
    vocabulary=VOCAB,
  )
  with pytest.raises(errors.ConfigError, match=r"teacher_tasks names\) are \['distillation"):
    train_on_task(MIXTURE, tmp_path / "student", 3, one_task)


def test_a_resumed_self_distillation_run_continues_its_average_exactly(tmp_path):
  build = dict(ema_decay=0.5, config=tiny_checkpoint_config(), vocabulary=VOCAB)
  model = distillation_modes.build_self_distillation_model(**build)
  straight = train_on_task(TASK, tmp_path / "straight", 4, model)
  train_on_task(TASK, tmp_path / "resumed", 2, model)
  saved = checkpoints.saved_shapes(tmp_path / "resumed" / "2" / checkpoints.AUX_STATE)
  assert saved == checkpoints.saved_shapes(tmp_path / "resumed" / "2" / checkpoints.PARAMS)
  resumed = train_on_task(TASK, tmp_path / "resumed", 4, model)
  # Restarting the average from the resumed params would change steps 3 and 4.
  for a, b in ((straight.aux_state, resumed.aux_state), (straight.params, resumed.params)):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
  last = [_train_records(tmp_path / run)[-1] for run in ("straight", "resumed")]
  assert [(r["step"], r["loss"], r["distill_kl"]) for r in last] == [
    (4, last[0]["loss"], last[0]["distill_kl"])
  ] * 2


def _one_line_error(build, message: str, **kwargs) -> None:
  with pytest.raises(errors.UserError, match=message) as e:
    build(**kwargs)
  lines = [line for line in str(e.value).splitlines() if "In call to configurable" not in line]
  assert len(lines) == 1, str(e.value)


def test_bad_settings_are_one_line_errors_naming_the_binding(tmp_path):
  save_params_checkpoint(tmp_path / "a", tiny_checkpoint_config())
  save_params_checkpoint(tmp_path / "wide", tiny_checkpoint_config(vocab_size=384))
  build = dict(config=tiny_checkpoint_config(), vocabulary=VOCAB)
  multi = distillation_modes.build_multi_teacher_distillation_model
  paths = [str(tmp_path / "a"), str(tmp_path / "a")]
  name = "build_multi_teacher_distillation_model"
  cases = [
    (dict(teacher_checkpoint_paths=paths, teacher_weights=[1.0]), f"{name}.teacher_weights has 1"),
    (dict(teacher_checkpoint_paths=paths, teacher_weights=[1.0, -0.5]), f"{name}.teacher_weights"),
    (dict(teacher_checkpoint_paths=paths, teacher_weights=[0.0, 0.0]), "not all 0"),
    (dict(teacher_checkpoint_paths=paths, alpha=-0.1), f"{name}.alpha must be in"),
    (dict(teacher_checkpoint_paths=[]), f"{name}.teacher_checkpoint_paths names no"),
    (dict(teacher_checkpoint_paths=paths, teacher_tasks=[TASK]), f"{name}.teacher_tasks has 1"),
    (
      dict(teacher_checkpoint_paths=paths, teacher_tasks=[TASK, TASK + "s"]),
      rf"{name}.teacher_tasks\[1\]: No seqio task or mixture named '{TASK}s' \(closest: {TASK}",
    ),
    (
      dict(teacher_checkpoint_paths=paths, teacher_tasks=[TASK, []]),
      r"teacher_tasks\[1\] names no",
    ),
    (
      dict(teacher_checkpoint_paths=paths, teacher_tasks=[TASK, MIXTURE]),
      rf"{name}.teacher_tasks\[1\]: '{MIXTURE}' is a mixture; name its tasks",
    ),
    (
      dict(teacher_checkpoint_paths=[paths[0], str(tmp_path / "wide")]),
      rf"{name}.teacher_checkpoint_paths\[1\].*vocab_size 384",
    ),
  ]
  for kwargs, message in cases:
    _one_line_error(multi, message, **kwargs, **build)
  selfd = distillation_modes.build_self_distillation_model
  name = "build_self_distillation_model"
  for kwargs, message in [
    (dict(ema_decay=-0.01), f"{name}.ema_decay must be in"),
    (dict(ema_decay=1.5), f"{name}.ema_decay must be in"),
    (dict(alpha=2.0), f"{name}.alpha must be in"),
    (dict(temperature=0.0), f"{name}.temperature must be positive"),
  ]:
    _one_line_error(selfd, message, **kwargs, **build)


def _save_teacher_with_vocabulary(root, digest: str) -> None:
  """A teacher whose train_meta records a SentencePiece vocabulary (as training does)."""
  config = tiny_checkpoint_config()
  fingerprint = {"sentencepiece_model_file": root.name, "sha256": digest, "extra_ids": 100}
  items = {
    checkpoints.PARAMS: ocp.args.StandardSave(jax.device_get(init_params(config, 7))),
    checkpoints.TRAIN_META: ocp.args.JsonSave(
      {
        checkpoints.MODEL_CONFIG_KEY: dataclasses.asdict(config),
        checkpoints.VOCABULARY_KEY: fingerprint,
      }
    ),
  }
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(root, options=options) as manager:
    manager.save(0, args=ocp.args.Composite(**items), force=True)
  checkpoints.write_file_manifest(root / "0")


def test_teachers_trained_with_different_vocabularies_are_refused(tmp_path):
  for name, digest in (("a", "0" * 64), ("b", "1" * 64)):
    _save_teacher_with_vocabulary(tmp_path / name, digest)
  assert checkpoints.read_json_item(tmp_path / "a" / "0", checkpoints.TRAIN_META) is not None
  _one_line_error(
    distillation_modes.build_multi_teacher_distillation_model,
    r"build_multi_teacher_distillation_model.teacher_checkpoint_paths: teachers 0 .* and 1 "
    ".*different vocabularies",
    teacher_checkpoint_paths=[str(tmp_path / "a"), str(tmp_path / "b")],
    config=tiny_checkpoint_config(),
    vocabulary=VOCAB,
  )


@pytest.mark.parametrize(
  "gin_file, builder",
  [
    ("runs/distill_multi.gin", "build_multi_teacher_distillation_model"),
    ("runs/self_distill.gin", "build_self_distillation_model"),
  ],
)
def test_gin_files_bind_the_models(gin_file, builder):
  bindings = ["TEACHER_CHECKPOINT_PATHS = ['./runs/a', './runs/b']"] * ("multi" in gin_file)
  gin_config.parse_gin([gin_file], bindings)
  assert gin.query_parameter("train.model").selector == f"distillation_modes.{builder}"
  value = gin.query_parameter(f"distillation_modes.{builder}.alpha")
  assert gin_config.resolved_macro(value) == 0.5

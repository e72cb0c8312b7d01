"""The trainer: config in, trained model, metrics and checkpoints out.

``train_and_evaluate(config, workdir)`` builds the mesh, model, data and
optimizer from an ``ml_collections.ConfigDict``, runs the steps, evaluates,
checkpoints and writes metrics. The absl launcher, notebooks and tests all
call it.

Local-update methods (``diloco``, ``local_sgd``) keep a leading worker axis on
every array of the state, sharded over the mesh's ``worker`` axis; their
per-worker step runs under ``jax.shard_map`` manual over ``worker`` only, and
the inner and the sync step are compiled as two programs so that the inner
one provably has no cross-worker collective. ``data_parallel`` keeps one
replicated copy and all-reduces gradients every step.
"""

import dataclasses
import functools
import json
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from loc_opt import data as data_lib
from loc_opt import inner as inner_lib
from loc_opt import models
from loc_opt import parallel
from loc_opt import schedules
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import methods as methods_lib
from loc_opt.train import metrics as metrics_lib

P = jax.P


def config_to_json(config: ml_collections.ConfigDict) -> str:
  return json.dumps(config.to_dict(), sort_keys=True, default=str)


def validate_config(config: ml_collections.ConfigDict, num_devices: int):
  """Raises ``ValueError`` naming the first bad field of ``config``."""

  def positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
        or value <= 0:
      raise ValueError(f'{name} must be a positive int, got {value!r}')

  for name in ('workers', 'data', 'fsdp', 'tensor'):
    positive(f'mesh.{name}', config.mesh[name])
  m = config.mesh
  shape = m.workers * m.data * m.fsdp * m.tensor
  if shape != num_devices:
    raise ValueError(
        f'mesh.workers * mesh.data * mesh.fsdp * mesh.tensor = {m.workers} * '
        f'{m.data} * {m.fsdp} * {m.tensor} = {shape}, but there are '
        f'{num_devices} devices; the worker count must divide the devices '
        'and the product must equal them.')
  positive('num_steps', config.num_steps)
  positive('batch_size', config.batch_size)
  positive('data.seq_len', config.data.seq_len)
  if config.batch_size % m.workers:
    raise ValueError(f'batch_size={config.batch_size} does not divide across '
                     f'mesh.workers={m.workers}')
  per_worker = config.batch_size // m.workers
  if per_worker % (m.data * m.fsdp):
    raise ValueError(
        f'batch_size={config.batch_size} gives {per_worker} sequences per '
        f'worker, which does not divide across the {m.data * m.fsdp} '
        'data-parallel devices (mesh.data * mesh.fsdp) of a worker')
  eval_batch = config.data.get('eval_batch_size') or config.batch_size
  if eval_batch % num_devices:
    raise ValueError(f'data.eval_batch_size={eval_batch} must divide '
                     f'across the {num_devices} devices')
  if config.data.seq_len > config.model.max_len:
    raise ValueError(f'data.seq_len={config.data.seq_len} exceeds '
                     f'model.max_len={config.model.max_len}')
  methods_lib.get_method(config.outer.method)
  if methods_lib.get_method(config.outer.method).syncs is not None:
    methods_lib.check_sync_every(config.outer)
  if config.outer.method != 'data_parallel':
    methods_lib.make_compressor(config.outer)
  if config.model.name == 'transformer' and \
      config.model.vocab_size < 256:
    raise ValueError('model.vocab_size must be >= 256 for byte-level data')


def _make_inner(config) -> optax.GradientTransformation:
  opt = config.optimizer
  schedule = schedules.make_schedule(
      opt.schedule, opt.learning_rate, config.num_steps,
      **dict(opt.get('schedule_kwargs', {})))
  return inner_lib.make_optimizer(
      opt.name, schedule, grad_clip_norm=opt.get('grad_clip_norm'),
      **dict(opt.get('kwargs', {})))


def _leaf_spec(path, leaf, param_specs: dict[tuple, Any]):
  """The within-worker spec of a state leaf: the param whose key path is the
  longest suffix of the leaf's path (and shape matches), else replicated."""
  keys = tuple(str(k) for k in path)
  for start in range(len(keys)):
    hit = param_specs.get(keys[start:])
    if hit is not None and hit[1] == tuple(leaf.shape[-len(hit[1]):] if
                                           hit[1] else ()):
      return hit[0]
  return P()


def state_shardings(abstract_state, param_specs, mesh, per_worker: bool):
  """NamedShardings for every leaf of the train state."""
  params_abstract = abstract_state['params']
  specs = {}
  for (path, leaf), spec in zip(
      jax.tree_util.tree_leaves_with_path(params_abstract),
      jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))):
    shape = leaf.shape[1:] if per_worker else leaf.shape
    specs[tuple(str(k) for k in path)] = (spec, tuple(shape))

  def leaf_sharding(path, leaf):
    top = str(path[0]) if path else ''
    if top in ("['opt_state']", "['params']"):
      spec = _leaf_spec(path[1:], leaf, specs)
      if per_worker:
        spec = P(parallel.WORKER, *spec)
      return jax.NamedSharding(mesh, spec)
    return jax.NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)


@dataclasses.dataclass
class Programs:
  """The compiled steps and what their collectives move."""
  steps: dict[bool, Any]          # sync? -> jitted train step
  bytes_per_step: dict[bool, int]  # sync? -> cross-worker bytes (all devices)
  eval_fn: Any


def _loss_fn(model, params, batch):
  logits = model.apply(params, batch[..., :-1])
  return models.lm_loss(logits, batch[..., 1:])


def _build_programs(config, model, tx, method, mesh, shardings,
                    abstract_state) -> Programs:
  m = config.mesh
  batch_axes = ('data', 'fsdp')
  if method.per_worker:
    batch_sharding = jax.NamedSharding(mesh, P(parallel.WORKER, batch_axes))
    batch_shape = (m.workers, config.batch_size // m.workers,
                   config.data.seq_len + 1)
  else:
    batch_sharding = jax.NamedSharding(
        mesh, P((parallel.WORKER,) + batch_axes))
    batch_shape = (config.batch_size, config.data.seq_len + 1)
  abstract_batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32,
                                        sharding=batch_sharding)
  loss_sharding = jax.NamedSharding(
      mesh, P(parallel.WORKER) if method.per_worker else P())

  def worker_step(params, opt_state, batch, *, sync):
    loss, grads = jax.value_and_grad(functools.partial(_loss_fn, model))(
        params, batch)
    extra = {} if sync is None else {'sync': sync}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, loss

  def make_step(sync):
    if method.per_worker:
      run = parallel.shard_map_workers(
          functools.partial(worker_step, sync=sync), mesh)
    else:
      run = functools.partial(worker_step, sync=None)

    def step(state, batch):
      params, opt_state, loss = run(state['params'], state['opt_state'], batch)
      new = dict(state, params=params, opt_state=opt_state,
                 step=state['step'] + 1,
                 data_position=state['data_position'] + 1)
      return new, loss

    return jax.jit(step, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, loss_sharding),
                   donate_argnums=0)

  variants = (False, True) if method.syncs is not None else (False,)
  steps, nbytes = {}, {}
  for sync in variants:
    jitted = make_step(sync)
    compiled = jitted.lower(abstract_state, abstract_batch).compile()
    report = parallel.collective_bytes(compiled, mesh)
    steps[sync] = compiled
    nbytes[sync] = int(report.cross_worker_bytes)

  # Evaluation: every worker evaluates its eval weights on its slice of the
  # eval batch, so evaluation itself crosses no worker boundary.
  def worker_eval(params, opt_state, batch):
    return _loss_fn(model, method.eval_params(opt_state, params), batch)

  if method.per_worker:
    eval_run = parallel.shard_map_workers(worker_eval, mesh)
    eval_sharding = jax.NamedSharding(mesh, P(parallel.WORKER, batch_axes))
  else:
    eval_run = worker_eval
    eval_sharding = jax.NamedSharding(mesh,
                                      P((parallel.WORKER,) + batch_axes))
  eval_fn = jax.jit(
      lambda state, batch: eval_run(state['params'], state['opt_state'],
                                    batch),
      in_shardings=(shardings, eval_sharding))
  return Programs(steps=steps, bytes_per_step=nbytes, eval_fn=eval_fn)


@dataclasses.dataclass
class Experiment:
  """Everything a run needs but the data: mesh, model, optimizer, programs.

  Attributes:
    config: the config it was built from.
    mesh: the worker mesh.
    model: the model's functional interface.
    method: the training method.
    tx: the optimizer (inner optimizer wrapped by the method).
    shardings: ``NamedSharding`` of every leaf of the train state.
    abstract_state: the train state's shapes, dtypes and shardings.
    programs: the compiled steps, their cross-worker bytes, and evaluation.
  """

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model: models.Model
  method: methods_lib.Method
  tx: optax.GradientTransformation
  shardings: Any
  abstract_state: Any
  programs: Programs

  def init_state(self) -> dict[str, Any]:
    """The initial train state: one model initialisation on every worker."""
    init = functools.partial(_init_state, model=self.model, tx=self.tx,
                             method=self.method,
                             workers=self.config.mesh.workers)
    return jax.jit(init, out_shardings=self.shardings)(
        jax.random.key(self.config.seed))


def build_experiment(config: ml_collections.ConfigDict,
                     mesh: jax.sharding.Mesh | None = None) -> Experiment:
  """Validates ``config`` and builds and compiles everything but the data."""
  validate_config(config, jax.device_count() if mesh is None else mesh.size)
  if mesh is None:
    mesh = parallel.make_worker_mesh(config.mesh.workers, config.mesh.data,
                                     config.mesh.fsdp, config.mesh.tensor)
  method = methods_lib.get_method(config.outer.method)
  model = models.build_model(config.model)
  tx = method.build(config.outer, _make_inner(config), parallel.WORKER)
  init = functools.partial(_init_state, model=model, tx=tx, method=method,
                           workers=config.mesh.workers)
  abstract = jax.eval_shape(init, jax.random.key(config.seed))
  shardings = state_shardings(abstract, _specs(model, mesh), mesh,
                              method.per_worker)
  abstract = ckpt_lib.abstract_with_shardings(abstract, shardings)
  programs = _build_programs(config, model, tx, method, mesh, shardings,
                             abstract)
  return Experiment(config, mesh, model, method, tx, shardings, abstract,
                    programs)


def data_parallel_bytes_per_step(config: ml_collections.ConfigDict) -> int:
  """Cross-worker bytes of one compiled data-parallel step for ``config``.

  The reference a local-update method is compared with: the same model,
  optimizer and mesh, gradients all-reduced every step.
  """
  dp_config = ml_collections.ConfigDict(config.to_dict())
  dp_config.outer.method = 'data_parallel'
  return build_experiment(dp_config).programs.bytes_per_step[False]


def _specs(model, mesh):
  return models.resolve_specs(model.specs, mesh.axis_names)


def _init_state(rng, *, model, tx, method, workers):
  """One model initialisation, copied to every worker (identical init)."""
  params = model.init(rng)
  if method.per_worker:
    params = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (workers,) + x.shape), params)
    opt_state = jax.vmap(tx.init)(params)
  else:
    opt_state = tx.init(params)
  return {
      'params': params,
      'opt_state': opt_state,
      'step': jnp.zeros([], jnp.int32),
      'data_position': jnp.zeros([], jnp.int32),
      'rng': jax.random.key_data(rng),
  }


def _is_sync(method, config, step: int, since_sync: int) -> bool:
  return bool(method.syncs and method.syncs(config.outer, step, since_sync))


def _eval(programs, state, eval_batches, config, per_worker) -> float:
  losses = []
  for batch in eval_batches:
    if per_worker:
      batch = batch.reshape(config.mesh.workers, -1, batch.shape[-1])
    loss = programs.eval_fn(state, batch)
    losses.append(np.mean(np.asarray(loss)))
  return float(np.mean(losses))


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains per ``config``, writing checkpoints and metrics to ``workdir``.

  If ``workdir`` holds a checkpoint, training resumes from it and ends with
  exactly the state an uninterrupted run would have (bit for bit on CPU).

  Args:
    config: see ``configs/diloco_lm.py`` for every field.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and
      ``summary.json`` go.

  Returns:
    The summary: final eval loss, cross-worker bytes moved, the bytes the
    data-parallel step would have moved for the same steps, timings.
  """
  workdir = pathlib.Path(workdir)
  config_json = config_to_json(config)
  t0 = time.perf_counter()
  exp = build_experiment(config)
  compile_s = time.perf_counter() - t0
  method, programs = exp.method, exp.programs
  data = data_lib.make_lm_data(
      config.data, num_workers=config.mesh.workers,
      global_batch=config.batch_size, seq_len=config.data.seq_len,
      seed=config.seed)
  eval_batches = data.eval_batches(config.eval_batches)

  progress = metrics_lib.Progress(config.num_steps,
                                  every=config.log_every,
                                  enabled=config.get('progress', True))
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt = ckpt_lib.Checkpointer(workdir, every=config.checkpoint_every,
                               max_to_keep=config.keep_checkpoints)
  if ckpt.latest_step() is not None:
    start, state = ckpt.restore(exp.abstract_state, config_json)
    progress.message(f'resumed from checkpoint at step {start} in {ckpt.dir}')
  else:
    start = 0
    state = exp.init_state()
  # The input position is part of the state: batches are a pure function of
  # (seed, position), so restoring it resumes the exact data order.
  position = int(jax.device_get(state['data_position']))
  writer = metrics_lib.MetricWriter(workdir, resume_step=start)
  # Which steps synced is a pure function of the config, so the counters of
  # an interrupted run are replayed rather than stored.
  since_sync, syncs, cum_bytes = 0, 0, 0
  for s in range(start):
    sync = _is_sync(method, config, s, since_sync)
    since_sync = 0 if sync else since_sync + 1
    syncs += int(sync)
    cum_bytes += programs.bytes_per_step[sync]
  summary_path = workdir / 'summary.json'

  tokens_per_step = config.batch_size * config.data.seq_len
  halt_after = config.get('halt_after_steps', 0) or 0
  last_time, last_step = time.perf_counter(), start
  loss = float('nan')
  train_time = 0.0
  step = start
  try:
    while step < config.num_steps:
      if halt_after and step - start >= halt_after:
        break
      sync = _is_sync(method, config, step, since_sync)
      batch = data.train.batch(position)
      position += 1
      if not method.per_worker:
        batch = batch.reshape(-1, batch.shape[-1])
      state, loss_arr = programs.steps[sync](state, batch)
      step += 1
      since_sync = 0 if sync else since_sync + 1
      syncs += int(sync)
      step_bytes = programs.bytes_per_step[sync]
      cum_bytes += step_bytes
      log_now = step % config.log_every == 0 or step == config.num_steps
      eval_now = (config.eval_every and step % config.eval_every == 0) or \
          step == config.num_steps
      if log_now or eval_now:
        loss = float(np.mean(np.asarray(loss_arr)))
        now = time.perf_counter()
        dt = now - last_time
        train_time += dt
        tps = tokens_per_step * (step - last_step) / max(dt, 1e-9)
        scalars = {
            'train/loss': loss,
            'perf/tokens_per_s': tps,
            'comm/cross_worker_bytes_step': step_bytes,
            'comm/cross_worker_bytes_total': cum_bytes,
            'comm/syncs': syncs,
        }
        sync_bytes = programs.bytes_per_step.get(True)
        if sync_bytes is not None:
          scalars['comm/cross_worker_bytes_per_sync'] = sync_bytes
        if eval_now:
          scalars['eval/loss'] = _eval(programs, state, eval_batches,
                                       config, method.per_worker)
        writer.write(step, scalars)
        progress.update(step, loss=loss, tokens_per_s=tps,
                        cross_worker_bytes=cum_bytes)
      if ckpt.should_save(step, config.num_steps):
        ckpt.save(step, state, config_json)
      if log_now or eval_now:  # throughput excludes evaluation and saving
        last_time, last_step = time.perf_counter(), step
  except KeyboardInterrupt:
    progress.message(f'interrupted at step {step}; saving a checkpoint')
    ckpt.save(step, state, config_json)
    raise
  finally:
    writer.close()
  ckpt.close()

  finished = step >= config.num_steps
  summary = {'step': step, 'finished': finished}
  if finished:
    records = metrics_lib.read_metrics(workdir)
    evals = [r['eval/loss'] for r in records if 'eval/loss' in r]
    dp_step = (programs.bytes_per_step[False] if not method.per_worker else
               data_parallel_bytes_per_step(config))
    summary.update({
        'method': config.outer.method,
        'final_eval_loss': evals[-1] if evals else None,
        'final_train_loss': loss,
        'cross_worker_bytes': cum_bytes,
        'syncs': syncs,
        'data_parallel_cross_worker_bytes': dp_step * config.num_steps,
        'bytes_per_inner_step': programs.bytes_per_step[False],
        'bytes_per_sync_step': programs.bytes_per_step.get(True),
        'num_params': exp.model.num_params,
        'compile_seconds': compile_s,
        'train_seconds_this_run': train_time,
    })
    tmp = summary_path.with_suffix('.tmp')
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, summary_path)
  summary['state'] = state
  return summary


def format_summary(summary: dict[str, Any]) -> str:
  """A short human-readable end-of-run summary."""
  if not summary.get('finished'):
    return f'stopped at step {summary["step"]} (resume to finish)'
  fb = metrics_lib.format_bytes
  dp = summary['data_parallel_cross_worker_bytes']
  moved = summary['cross_worker_bytes']
  ratio = f'{dp / moved:.0f}x less' if moved else 'none moved'
  lines = [
      f'method: {summary["method"]}   steps: {summary["step"]}   '
      f'params: {summary["num_params"]:,}',
      f'final eval loss: {summary["final_eval_loss"]:.4f}',
      f'cross-worker bytes moved: {fb(moved)} ({summary["syncs"]} syncs)',
      f'data-parallel would have moved: {fb(dp)} ({ratio})',
  ]
  return '\n'.join(lines)

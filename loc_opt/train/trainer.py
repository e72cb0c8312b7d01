"""The trainer: config in, trained model, metrics and checkpoints out.

``train_and_evaluate(config, workdir)`` builds the mesh, model, data and
optimizer from an ``ml_collections.ConfigDict``, runs the steps, evaluates,
checkpoints and writes metrics. The absl launcher, notebooks and tests all
call it.

Local-update methods (``diloco``, ``local_sgd`` and the rest of the DiLoCo
family in ``loc_opt.train.family``) keep a leading worker axis on every array
of the state, sharded over the mesh's ``worker`` axis; their per-worker step
runs under ``jax.shard_map`` manual over ``worker`` only. Each *phase* of a
method (an inner step, a sync, a fragment's send, a peer-group exchange, a
state sync; see ``loc_opt.outer.plan``) is compiled as its own program, so
the inner one provably has no cross-worker collective and every program's
bytes are read from its HLO. Which one runs next is decided on the host: from
the sync-period schedule for DiLoCo and local SGD (``outer.sync_schedule``:
constant, step or QSR, so a changing period recompiles nothing), from the
method's plan for the others. ``data_parallel`` keeps one replicated copy and
all-reduces gradients every step. The summary adds the simulated wall-clock
of the run (``wallclock`` config section, ``loc_opt.train.simulated_time``).

Evaluation uses each method's evaluation weights: the anchor under DiLoCo and
local SGD, the schedule-free average for a schedule-free optimizer otherwise
(``loc_opt.train.methods.eval_params_fn``).

A run can start from another run's checkpoint (``init_from``): the decay
branch of WSD / WSD-S (``loc_opt.train.branch_and_evaluate``). Saved
checkpoints of a run can be merged into one evaluation model (WSM,
``loc_opt.train.merge_and_evaluate``).
"""

import collections
import collections.abc
import copy
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
from loc_opt.train import simulated_time
from loc_opt.train import spikes as spikes_lib

P = jax.P
# Programs compiled when an experiment is built (further phases: on use).
_EAGER_COMPILE_PHASES = 16


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
  method = methods_lib.get_method(config.outer.method)
  lr_schedule = _lr_schedule(config)
  if method.has_sync:
    methods_lib.make_sync_every(config, lr_schedule)
  if method.plan is not None:
    sched = config.outer.get('sync_schedule', 'constant')
    if sched != 'constant':
      raise ValueError(f'outer.method={config.outer.method!r} syncs on a '
                       f'fixed plan; outer.sync_schedule must be '
                       f"'constant', got {sched!r}")
    method.plan(config)  # validates the method's own fields
  simulated_time.validate(config)
  if config.outer.method != 'data_parallel':
    methods_lib.make_compressor(config.outer)
  spikes_lib.spikes_from_config(config.optimizer, config.num_steps)
  _check_init_from(config)
  if config.model.name == 'transformer' and \
      config.model.vocab_size < 256:
    raise ValueError('model.vocab_size must be >= 256 for byte-level data')


def _check_init_from(config) -> None:
  """Validates the ``init_from`` fields (a branch off another run)."""
  init = config.get('init_from')
  if init is None or not init.get('workdir'):
    return
  step = init.get('step')
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or \
      step <= 0:
    raise ValueError(f'init_from.step must be a positive int (a checkpoint '
                     f'step of init_from.workdir), got {step!r}')
  if step >= config.num_steps:
    raise ValueError(f'init_from.step={step} must be below num_steps='
                     f'{config.num_steps} (the branch must take steps)')


def _lr_schedule(config) -> optax.Schedule:
  """The inner learning-rate schedule (``optimizer.schedule``)."""
  opt = config.optimizer
  return schedules.make_schedule(
      opt.schedule, opt.learning_rate, config.num_steps,
      **dict(opt.get('schedule_kwargs', {})))


def _make_inner(config, lr_schedule: optax.Schedule | None = None
                ) -> optax.GradientTransformation:
  """The inner optimizer: spike injection (if on), clip, optimizer."""
  opt = config.optimizer
  schedule = _lr_schedule(config) if lr_schedule is None else lr_schedule
  tx = inner_lib.make_optimizer(
      opt.name, schedule, grad_clip_norm=opt.get('grad_clip_norm'),
      **dict(opt.get('kwargs', {})))
  spike, _ = spikes_lib.spikes_from_config(opt, config.num_steps)
  return tx if spike is None else optax.chain(spike, tx)


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


class StepPrograms(collections.abc.Mapping):
  """``phase -> compiled train step``, compiled on first use.

  A phase is the static ``sync`` value a method's ``update`` takes
  (``loc_opt.outer.plan``): ``False`` for an inner step, ``True`` for a
  DiLoCo sync, a fragment / peer-group / state tuple for the methods that
  send different things on different steps. Compiling one program per phase
  keeps each program's collectives exactly what that step sends; they are
  read from the compiled HLO when the program is built.

  Iterating lists the phases compiled so far.
  """

  def __init__(self, compile_fn, phases):
    self._compile = compile_fn
    self.phases = tuple(phases)  # every phase this run may use
    self._steps: dict[Any, Any] = {}
    self.bytes: dict[Any, int] = {}  # cross-worker bytes (all devices)
    # cross-worker collectives: (kind, bytes one worker contributes)
    self.transfers: dict[Any, tuple[tuple[str, float], ...]] = {}

  def __getitem__(self, phase):
    if phase not in self._steps:
      if phase not in self.phases:
        raise KeyError(phase)
      compiled, report = self._compile(phase)
      self._steps[phase] = compiled
      self.bytes[phase] = int(report.cross_worker_bytes)
      self.transfers[phase] = parallel.cross_worker_transfers(report)
    return self._steps[phase]

  def __iter__(self):
    return iter(self._steps)

  def __len__(self):
    return len(self._steps)


class _BytesView(collections.abc.Mapping):
  """``phase -> cross-worker bytes``; compiles the phase if needed."""

  def __init__(self, steps: StepPrograms):
    self._steps = steps

  def __getitem__(self, phase):
    self._steps[phase]
    return self._steps.bytes[phase]

  def __iter__(self):
    return iter(self._steps.bytes)

  def __len__(self):
    return len(self._steps.bytes)


@dataclasses.dataclass
class Programs:
  """The compiled steps and what their collectives move.

  Attributes:
    steps: phase -> the compiled train step (``jax.stages.Compiled``, so it
      can never recompile); see :class:`StepPrograms`.
    eval_fn: ``(state, batch) -> per-worker loss`` at the eval weights.
    eval_params_fn: ``state -> eval weights`` (laid out like the params).
    params_loss_fn: ``(params, batch) -> per-worker loss`` of given weights
      (e.g. a WSM merge).
  """
  steps: StepPrograms
  eval_fn: Any
  eval_params_fn: Any
  params_loss_fn: Any

  @property
  def bytes_per_step(self) -> collections.abc.Mapping:
    """phase -> cross-worker bytes of that step (all devices)."""
    return _BytesView(self.steps)


def _loss_fn(model, params, batch):
  logits = model.apply(params, batch[..., :-1])
  return models.lm_loss(logits, batch[..., 1:])


def _build_programs(config, model, tx, method, mesh, shardings,
                    abstract_state, eval_params, phases) -> Programs:
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

  def compile_phase(phase):
    compiled = make_step(phase).lower(abstract_state,
                                      abstract_batch).compile()
    return compiled, parallel.collective_bytes(compiled, mesh)

  steps = StepPrograms(compile_phase, phases)
  # The run's programs are compiled now (so throughput excludes compiling),
  # unless a plan has very many phases: those compile on first use.
  for phase in phases[:_EAGER_COMPILE_PHASES]:
    steps[phase]

  # Evaluation: every worker evaluates its eval weights on its slice of the
  # eval batch, so evaluation itself crosses no worker boundary.
  def worker_eval(params, opt_state, batch):
    return _loss_fn(model, eval_params(opt_state, params), batch)

  def worker_params_loss(params, batch):
    return _loss_fn(model, params, batch)

  per_worker = (functools.partial(parallel.shard_map_workers, mesh=mesh)
                if method.per_worker else lambda fn: fn)
  if method.per_worker:
    eval_sharding = jax.NamedSharding(mesh, P(parallel.WORKER, batch_axes))
  else:
    eval_sharding = jax.NamedSharding(mesh,
                                      P((parallel.WORKER,) + batch_axes))
  eval_run = per_worker(worker_eval)
  eval_fn = jax.jit(
      lambda state, batch: eval_run(state['params'], state['opt_state'],
                                    batch),
      in_shardings=(shardings, eval_sharding))
  params_run = per_worker(lambda opt_state, params: eval_params(opt_state,
                                                                params))
  eval_params_fn = jax.jit(
      lambda state: params_run(state['opt_state'], state['params']),
      in_shardings=(shardings,), out_shardings=shardings['params'])
  params_loss_fn = jax.jit(per_worker(worker_params_loss),
                           in_shardings=(shardings['params'], eval_sharding))
  return Programs(steps=steps, eval_fn=eval_fn,
                  eval_params_fn=eval_params_fn,
                  params_loss_fn=params_loss_fn)


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
    lr_schedule: the inner learning-rate schedule.
    sync_plan: which steps sync, for DiLoCo-style methods whose period
      may follow a schedule (None otherwise).
    plan: the phase of every step, for methods that send different things
      on different steps (``loc_opt.outer.Plan``; None otherwise).
    spike_steps: the counts at which gradient spikes are injected.
  """

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model: models.Model
  method: methods_lib.Method
  tx: optax.GradientTransformation
  shardings: Any
  abstract_state: Any
  programs: Programs
  lr_schedule: optax.Schedule
  sync_plan: methods_lib.SyncPlan | None
  plan: Any
  spike_steps: list[int]

  def phase(self, step: int, since_sync: int) -> Any:
    """The phase (static ``sync`` value) of the step after ``step`` steps."""
    if self.plan is not None:
      return self.plan(step)
    return self.sync_plan is not None and self.sync_plan.syncs(step,
                                                               since_sync)

  def is_sync(self, phase: Any) -> bool:
    """Whether a step of ``phase`` counts as a sync."""
    if self.plan is not None:
      return self.plan.is_sync(phase)
    return bool(phase)

  @functools.cached_property
  def _init_fn(self):
    init = functools.partial(_init_state, model=self.model, tx=self.tx,
                             method=self.method,
                             workers=self.config.mesh.workers)
    return jax.jit(init, out_shardings=self.shardings)

  def init_state(self) -> dict[str, Any]:
    """The initial train state: one model initialisation on every worker."""
    return self._init_fn(jax.random.key(self.config.seed))

  def eval_params(self, state: dict[str, Any]) -> Any:
    """The weights evaluation uses (per worker for local-update methods)."""
    return self.programs.eval_params_fn(state)

  def evaluate_params(self, params: Any, eval_batches: Any) -> float:
    """Mean eval loss of ``params`` (laid out like ``state['params']``)."""
    return _mean_loss(lambda b: self.programs.params_loss_fn(params, b),
                      eval_batches, self.config, self.method.per_worker)


def build_experiment(config: ml_collections.ConfigDict,
                     mesh: jax.sharding.Mesh | None = None) -> Experiment:
  """Validates ``config`` and builds and compiles everything but the data."""
  validate_config(config, jax.device_count() if mesh is None else mesh.size)
  if mesh is None:
    mesh = parallel.make_worker_mesh(config.mesh.workers, config.mesh.data,
                                     config.mesh.fsdp, config.mesh.tensor)
  method = methods_lib.get_method(config.outer.method)
  model = models.build_model(config.model)
  lr_schedule = _lr_schedule(config)
  sync_every = (methods_lib.make_sync_every(config, lr_schedule)
                if method.has_sync else None)
  plan = None if method.plan is None else method.plan(config)
  tx = method.build(config, _make_inner(config, lr_schedule),
                    parallel.WORKER, sync_every)
  init = functools.partial(_init_state, model=model, tx=tx, method=method,
                           workers=config.mesh.workers)
  abstract = jax.eval_shape(init, jax.random.key(config.seed))
  shardings = state_shardings(abstract, _specs(model, mesh), mesh,
                              method.per_worker)
  abstract = ckpt_lib.abstract_with_shardings(abstract, shardings)
  eval_params = methods_lib.eval_params_fn(method, abstract['opt_state'])
  if plan is not None:
    phases = plan.phases(config.num_steps)
  else:
    phases = (False, True) if method.has_sync else (False,)
  programs = _build_programs(config, model, tx, method, mesh, shardings,
                             abstract, eval_params, phases)
  sync_plan = (methods_lib.SyncPlan(sync_every, config.num_steps)
               if method.has_sync and plan is None else None)
  _, spike_steps = spikes_lib.spikes_from_config(config.optimizer,
                                                 config.num_steps)
  return Experiment(config, mesh, model, method, tx, shardings, abstract,
                    programs, lr_schedule, sync_plan, plan, spike_steps)


# Fields that do not change what build_experiment compiles: runs that differ
# only in these share one Experiment within a process (resumes, branches,
# merges, tests).
_RUN_CONTROL_FIELDS = ('eval_every', 'eval_batches', 'log_every',
                       'checkpoint_every', 'keep_checkpoints', 'progress',
                       'halt_after_steps', 'init_from')
_EXPERIMENT_CACHE: collections.OrderedDict[str, Experiment] = \
    collections.OrderedDict()
_EXPERIMENT_CACHE_SIZE = 4


def _experiment_key(config: ml_collections.ConfigDict) -> str:
  fields = {k: v for k, v in config.to_dict().items()
            if k not in _RUN_CONTROL_FIELDS}
  return json.dumps(fields, sort_keys=True, default=str)


def get_experiment(config: ml_collections.ConfigDict) -> Experiment:
  """:func:`build_experiment`, reusing one built in this process for a
  config that differs only in run-control fields (logging, evaluation,
  checkpointing, ``halt_after_steps``, ``init_from``)."""
  key = _experiment_key(config)
  exp = _EXPERIMENT_CACHE.get(key)
  if exp is None:
    exp = build_experiment(copy.deepcopy(config))
    _EXPERIMENT_CACHE[key] = exp
    while len(_EXPERIMENT_CACHE) > _EXPERIMENT_CACHE_SIZE:
      _EXPERIMENT_CACHE.popitem(last=False)
  else:
    validate_config(config, exp.mesh.size)
    _EXPERIMENT_CACHE.move_to_end(key)
  return exp


def data_parallel_bytes_per_step(config: ml_collections.ConfigDict) -> int:
  """Cross-worker bytes of one compiled data-parallel step for ``config``.

  The reference a local-update method is compared with: the same model,
  optimizer and mesh, gradients all-reduced every step.
  """
  dp_config = ml_collections.ConfigDict(config.to_dict())
  # Only what shapes the collectives is kept (so runs that differ in the
  # outer method's settings, the schedule, spikes or length share one
  # compiled reference): the data-parallel step ignores the other outer
  # fields, and schedules and spikes only scale values.
  dp_config.outer = ml_collections.ConfigDict({'method': 'data_parallel'})
  dp_config.num_steps = 1
  dp_config.optimizer.schedule = 'constant'
  dp_config.optimizer.schedule_kwargs = {}
  dp_config.optimizer.spike_num = 0
  dp_config.init_from = ml_collections.ConfigDict({'workdir': '', 'step': 0})
  return get_experiment(dp_config).programs.bytes_per_step[False]


_DATA_CACHE: collections.OrderedDict[str, Any] = collections.OrderedDict()


def load_data(config: ml_collections.ConfigDict) -> data_lib.LMData:
  """The run's data (``loc_opt.data.make_lm_data``), read once per process
  for a given data config, worker count, batch, length and seed."""
  key = json.dumps([config.data.to_dict(), config.mesh.workers,
                    config.batch_size, config.data.seq_len, config.seed],
                   sort_keys=True, default=str)
  data = _DATA_CACHE.get(key)
  if data is None:
    data = data_lib.make_lm_data(
        config.data, num_workers=config.mesh.workers,
        global_batch=config.batch_size, seq_len=config.data.seq_len,
        seed=config.seed)
    _DATA_CACHE[key] = data
    while len(_DATA_CACHE) > 2:
      _DATA_CACHE.popitem(last=False)
  else:
    _DATA_CACHE.move_to_end(key)
  return data


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


def _mean_loss(loss_fn, eval_batches, config, per_worker) -> float:
  losses = []
  for batch in eval_batches:
    if per_worker:
      batch = batch.reshape(config.mesh.workers, -1, batch.shape[-1])
    losses.append(np.mean(np.asarray(loss_fn(batch))))
  return float(np.mean(losses))


def _eval(programs, state, eval_batches, config, per_worker) -> float:
  return _mean_loss(lambda b: programs.eval_fn(state, b), eval_batches,
                    config, per_worker)


def _sync_bytes(exp: Experiment) -> int | None:
  """Cross-worker bytes of a sync step: DiLoCo's one sync program, or the
  largest of the phases compiled so far for methods with a plan."""
  nbytes = exp.programs.bytes_per_step
  if exp.plan is not None:
    synced = [v for k, v in nbytes.items() if exp.plan.is_sync(k)]
    return max(synced) if synced else None
  return nbytes.get(True)


def wallclock_summary(exp: Experiment) -> dict[str, Any]:
  """Simulated wall-clock of a full run (``loc_opt.train.simulated_time``)."""
  return simulated_time.wallclock_summary(exp)


def _counters(exp: Experiment, state, step: int) -> tuple[int, int, int]:
  """``(since_sync, syncs, cross-worker bytes)`` after ``step`` steps of a
  restored state: read from the state, so branches from another run's
  checkpoint (whose sync schedule may differ) count right too."""
  nbytes = exp.programs.bytes_per_step
  if exp.plan is not None:  # a fixed plan: replay it
    since = syncs = total = 0
    for count in range(step):
      phase = exp.plan(count)
      total += nbytes[phase]
      synced = exp.plan.is_sync(phase)
      syncs += synced
      since = 0 if synced else since + 1
    return since, syncs, total
  if exp.method.counters is None:
    return 0, 0, step * nbytes[False]
  syncs, since = (int(np.asarray(jax.device_get(x)).reshape(-1)[0])
                  for x in exp.method.counters(state['opt_state']))
  return since, syncs, syncs * nbytes[True] + (step - syncs) * nbytes[False]


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains per ``config``, writing checkpoints and metrics to ``workdir``.

  If ``workdir`` holds a checkpoint, training resumes from it and ends with
  exactly the state an uninterrupted run would have (bit for bit on CPU).
  Otherwise, if ``config.init_from.workdir`` is set, the run starts from
  that run's checkpoint at ``config.init_from.step`` (see
  :func:`loc_opt.train.branch_and_evaluate`); else from the initialisation.

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
  validate_config(config, jax.device_count())
  init_from = config.get('init_from')
  branching = (init_from is not None and bool(init_from.get('workdir'))
               and ckpt_lib.latest_step(workdir) is None)
  if branching:  # fail before compiling anything
    ckpt_lib.check_branch(init_from.workdir, init_from.step, config_json)
  exp = get_experiment(config)
  compile_s = time.perf_counter() - t0
  method, programs = exp.method, exp.programs
  data = load_data(config)
  eval_batches = data.eval_batches(config.eval_batches)

  progress = metrics_lib.Progress(config.num_steps,
                                  every=config.log_every,
                                  enabled=config.get('progress', True))
  branch = None
  if branching:
    # Read the other run's state before anything is written here, so a bad
    # branch leaves no trace.
    branch = ckpt_lib.restore_branch(
        init_from.workdir, init_from.step, exp.abstract_state, config_json)
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt = ckpt_lib.Checkpointer(workdir, every=config.checkpoint_every,
                               max_to_keep=config.keep_checkpoints)
  if ckpt.latest_step() is not None:
    start, state = ckpt.restore(exp.abstract_state, config_json)
    progress.message(f'resumed from checkpoint at step {start} in {ckpt.dir}')
  elif branch is not None:
    start, state = branch
    progress.message(f'branched from {init_from.workdir} at step {start}')
  else:
    start = 0
    state = exp.init_state()
  # The input position is part of the state: batches are a pure function of
  # (seed, position), so restoring it resumes the exact data order.
  position = int(jax.device_get(state['data_position']))
  writer = metrics_lib.MetricWriter(workdir, resume_step=start)
  # The sync counters live in the optimizer state, so a resumed or branched
  # run continues them exactly.
  since_sync, syncs, cum_bytes = _counters(exp, state, start)
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
      phase = exp.phase(step, since_sync)
      synced = exp.is_sync(phase)
      batch = data.train.batch(position)
      position += 1
      if not method.per_worker:
        batch = batch.reshape(-1, batch.shape[-1])
      state, loss_arr = programs.steps[phase](state, batch)
      step += 1
      since_sync = 0 if synced else since_sync + 1
      syncs += int(synced)
      step_bytes = programs.bytes_per_step[phase]
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
        sync_bytes = _sync_bytes(exp)
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
        'bytes_per_inner_step': programs.bytes_per_step[
            programs.steps.phases[0]],
        'bytes_per_sync_step': _sync_bytes(exp),
        'peak_bytes_per_step': max(programs.bytes_per_step.values()),
        'bytes_per_phase': {str(k): v for k, v in
                            programs.bytes_per_step.items()},
        'wallclock': wallclock_summary(exp),
        'num_params': exp.model.num_params,
        'compile_seconds': compile_s,
        'train_seconds_this_run': train_time,
    })
    if init_from is not None and init_from.get('workdir'):
      summary['init_from'] = {'workdir': str(init_from.workdir),
                              'step': int(init_from.step)}
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

"""An experiment: everything a run needs but the data, built from a config.

:func:`build_experiment` validates the config, builds the mesh, model,
optimizer and train-state layout, and compiles the method's programs;
:func:`get_experiment` reuses one built in this process for a config that
differs only in run-control fields. :func:`load_data` reads the run's data
once per process.
"""

import collections
import copy
import dataclasses
import functools
import json
import math
from typing import Any

import jax
from jax.experimental import multihost_utils
import ml_collections
import optax

from loc_opt import _checks
from loc_opt import data as data_lib
from loc_opt import models
from loc_opt import outer as outer_lib
from loc_opt import parallel
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import faults
from loc_opt.train import hosts
from loc_opt.train import layout as layout_lib
from loc_opt.train import outer_layout
from loc_opt.train import programs as programs_lib
from loc_opt.train import registry
from loc_opt.train import simulated_time
from loc_opt.train import spikes as spikes_lib
from loc_opt.train import startup
from loc_opt.train import state as state_lib
from loc_opt.train.method import eval_params_fn
from loc_opt.train.method import Method


def worker_groups(config: ml_collections.ConfigDict, num_devices: int) -> int:
  """The size of the mesh's worker axis for ``num_devices`` devices:
  ``mesh.workers``, or with ``mesh.simulate_workers`` the groups of
  ``mesh.data * mesh.fsdp * mesh.tensor`` devices the stacked workers are
  split over (one group: all workers on every device; G groups, e.g. one
  per process: ``mesh.workers / G`` stacked on each)."""
  m = config.mesh
  if not cfg_lib.simulates_workers(config):
    return m.workers
  return num_devices // (m.data * m.fsdp * m.tensor)


def _check_mesh(config, num_devices: int) -> None:
  m = config.mesh
  for name in ('workers', 'data', 'fsdp', 'tensor'):
    _checks.positive_int(m[name], f'mesh.{name}', arrays=True)
  if cfg_lib.simulates_workers(config):
    group = m.data * m.fsdp * m.tensor
    groups = worker_groups(config, num_devices)
    if num_devices % group or m.workers % groups:
      raise ValueError(
          f'mesh.simulate_workers=True stacks the {m.workers} workers on '
          f'groups of mesh.data * mesh.fsdp * mesh.tensor = {m.data} * '
          f'{m.fsdp} * {m.tensor} = {group} devices, so the {num_devices} '
          f'devices must form a number of groups that divides the '
          f'{m.workers} workers (1 group: every worker on every device; G: '
          f'{m.workers} / G workers on each group).')
    if cfg_lib.state_layout(config) == 'sharded':
      raise ValueError("outer.state_layout='sharded' splits the outer state "
                       'over the workers\' devices, which '
                       'mesh.simulate_workers=True does not have; use '
                       "'replicated'.")
    return
  shape = m.workers * m.data * m.fsdp * m.tensor
  if shape != num_devices:
    raise ValueError(
        f'mesh.workers * mesh.data * mesh.fsdp * mesh.tensor = {m.workers} * '
        f'{m.data} * {m.fsdp} * {m.tensor} = {shape}, but there are '
        f'{num_devices} devices; the worker count must divide the devices '
        'and the product must equal them (or set mesh.simulate_workers=True '
        'to stack the workers on shared devices).')


def _check_batches(config, num_devices: int) -> None:
  m = config.mesh
  for name in ('num_steps', 'batch_size'):
    _checks.positive_int(config[name], name, arrays=True)
  _checks.positive_int(config.data.seq_len, 'data.seq_len', arrays=True)
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
  group = m.data * m.fsdp * m.tensor
  simulated = cfg_lib.simulates_workers(config)
  if simulated and eval_batch % (m.workers * group):
    raise ValueError(
        f'data.eval_batch_size={eval_batch} must divide across the '
        f'{m.workers} simulated workers x {group} devices (each worker '
        'evaluates its slice on every device of its group)')
  # A model with positions has a longest sequence (the MLP has none).
  max_len = config.model.get('max_len')
  if max_len is not None and config.data.seq_len > max_len:
    raise ValueError(f'data.seq_len={config.data.seq_len} exceeds '
                     f'model.max_len={max_len}')


def _check_run_control(config) -> None:
  """Validates the fields of how a run logs, evaluates and saves:
  ``log_every``, ``eval_batches`` and ``keep_checkpoints`` positive ints;
  ``eval_every`` and ``checkpoint_every`` non-negative ints (0: only at the
  end); ``halt_after_steps`` a non-negative int (0: never halt)."""
  for name in ('log_every', 'eval_batches', 'keep_checkpoints'):
    _checks.positive_int(config[name], name, arrays=True)
  for name, zero in (('eval_every', 'only at the end'),
                     ('checkpoint_every', 'only at the end'),
                     ('halt_after_steps', 'never halt')):
    if name in config:
      try:
        _checks.nonnegative_int(config[name], name)
      except ValueError as e:
        raise ValueError(f'{e} (0: {zero})') from None


def _syncs_within(plan: outer_lib.Plan, num_steps: int) -> bool:
  """Whether ``plan`` syncs at least once in ``num_steps`` steps from 0."""
  return any(plan.is_sync(phase) for phase in plan.walk(0, num_steps))


def _check_syncs(config, plan: outer_lib.Plan) -> None:
  """A method that syncs on a period must sync within ``num_steps``.

  A period plan (DiLoCo, local SGD) always means to sync; a fixed plan
  means to if it syncs once the run is ``outer.sync_every`` steps longer
  (data parallel never syncs; DeMo exchanges every step).
  """
  n = config.num_steps
  if _syncs_within(plan, n):
    return
  h = config.outer.get('sync_every')
  if plan.period_fn is None and not (
      isinstance(h, int) and _syncs_within(plan, n + h)):
    return  # the plan's silence is not H's doing
  raise ValueError(
      f'outer.sync_every={h} (with outer.sync_schedule='
      f'{config.outer.get("sync_schedule", "constant")!r}) gives no sync in '
      f'num_steps={n}: outer.method={config.outer.method!r} would never '
      f'sync; lower outer.sync_every or raise num_steps')


def _check_method(config) -> None:
  method = registry.get_method(config.outer.method)
  sched = config.outer.get('sync_schedule', 'constant')
  if not method.follows_sync_schedule and sched != 'constant':
    raise ValueError(f'outer.method={config.outer.method!r} syncs on a '
                     f'fixed plan; outer.sync_schedule must be '
                     f"'constant', got {sched!r}")
  registry.check_section(config)
  outer_layout.check(config, method, registry.METHODS)
  cfg_lib.check_aggregate(config)
  # validates the sync schedule and the method's fields
  _check_syncs(config, method.plan(config))
  if method.per_worker:
    cfg_lib.make_compressor(config)
  _check_overlap(config, method)


# Methods whose sync's result is read only some steps later.
_OVERLAPPED = ('streaming_diloco (outer.streaming_diloco.overlap > 0), '
               'eager_diloco, co2')


def _check_overlap(config, method) -> None:
  """``outer.overlap``: 'none', or 'compiled' for a method whose sync's
  collective may overlap the steps after it (``Method.overlap_steps``)."""
  mode = config.outer.get('overlap', 'none')
  if mode not in ('none', 'compiled'):
    raise ValueError(f"outer.overlap must be 'none' or 'compiled', got "
                     f'{mode!r}')
  if mode == 'none':
    return
  name = config.outer.method
  if method.step_inputs is not None:  # a simulated timeline of learners
    raise ValueError(
        f"outer.overlap='compiled': outer.method={name!r} runs on a "
        'simulated timeline of learners, not one collective per sync; '
        f'methods that support it: {_OVERLAPPED}')
  if not method.per_worker or method.overlap_steps(config) <= 0:
    raise ValueError(
        f"outer.overlap='compiled': outer.method={name!r} reads every "
        'sync\'s result at once, so no step can overlap its collective; '
        f'methods that support it: {_OVERLAPPED}')


def _check_dropout(config) -> None:
  """Worker dropout (``faults.drop_*``) needs a method whose mean can leave
  a worker out, and no codec whose shared estimate assumes every worker's
  message (EF21, EControl)."""
  if not faults.drops_workers(config):
    return
  if registry.get_method(config.outer.method).left_out is None:
    supported = sorted(k for k, m in registry.METHODS.items()
                       if m.left_out is not None)
    raise ValueError(
        f'faults.drop_syncs / faults.drop_fraction: outer.method='
        f'{config.outer.method!r} does not support worker dropout '
        f'(supported: {", ".join(supported)})')
  feedback = config.outer.get('error_feedback', 'none')
  if config.outer.get('codec', 'none') != 'none' and \
      feedback in ('ef21', 'econtrol'):
    raise ValueError(
        f'faults.drop_syncs / faults.drop_fraction: outer.error_feedback='
        f'{feedback!r} keeps a shared estimate of every worker\'s messages, '
        "which an absent worker would break; use 'ef' or 'none'")


def _check_failures(config) -> None:
  """Learner failures (``faults.failures``, the chaos model) need a method
  that runs on a timeline (``Method.step_inputs``)."""
  if faults.kills_workers(config) and \
      registry.get_method(config.outer.method).step_inputs is None:
    supported = sorted(k for k, m in registry.METHODS.items()
                       if m.step_inputs is not None)
    raise ValueError(
        f'faults.failures / faults.chaos_mtbf_steps: outer.method='
        f'{config.outer.method!r} does not simulate learner failures '
        f'(supported: {", ".join(supported)}; for a synchronous method use '
        'faults.drop_syncs)')


def _check_init_from(config) -> None:
  """Validates the ``init_from`` fields (a branch off another run)."""
  init = config.get('init_from')
  if init is None or not init.get('workdir'):
    return
  step = init.get('step')
  try:
    _checks.positive_int(step, 'init_from.step', arrays=True)
  except ValueError:
    raise ValueError(f'init_from.step must be a positive int (a checkpoint '
                     f'step of init_from.workdir), got {step!r}') from None
  if step >= config.num_steps:
    raise ValueError(f'init_from.step={step} must be below num_steps='
                     f'{config.num_steps} (the branch must take steps)')


def _check_experts(config) -> None:
  """A Mixture-of-Experts LM's experts split evenly over the mesh axes of
  the logical axis ``'expert'`` (``model.axis_rules``)."""
  moe = config.model.get('moe')
  experts = moe.get('num_experts', 0) if moe is not None else 0
  if config.model.name != 'transformer' or not experts:
    return
  rules = config.model.get('axis_rules')
  rules = dict(models.sharding.normalize_rules(
      rules.to_dict() if hasattr(rules, 'to_dict') else rules))
  axes = [a for a in rules.get('expert', ()) if a in config.mesh]
  split = math.prod(int(config.mesh[a]) for a in axes)
  if experts % split:
    raise ValueError(
        f'model.moe.num_experts ({experts}) must be a multiple of the '
        f'devices the experts are split over inside a worker (mesh axes '
        f'{axes} of the rule for \'expert\': {split})')


def validate_config(config: ml_collections.ConfigDict, num_devices: int):
  """Raises ``ValueError`` naming the first bad field of ``config``.

  Nothing is built or written first: ``train_and_evaluate`` calls it before
  it touches the workdir. Besides the mesh, batch and method fields it
  checks the run-control fields (``log_every``, ``eval_every``,
  ``checkpoint_every``, ``keep_checkpoints``, ``eval_batches``,
  ``halt_after_steps``), every learning rate (finite, ``>= 0``) and
  momentum (``[0, 1)``), the step-or-fraction schedule arguments, the codec
  arguments, and that a method that syncs on a period syncs within
  ``num_steps``.
  """
  _check_mesh(config, num_devices)
  _check_batches(config, num_devices)
  _check_run_control(config)
  cfg_lib.check_rates(config)
  cfg_lib.check_step_fields(config)
  cfg_lib.lr_schedule(config)
  _check_method(config)
  simulated_time.validate(config)
  spikes_lib.spikes_from_config(config.optimizer, config.num_steps)
  faults.settings(config)
  _check_dropout(config)
  _check_failures(config)
  _check_init_from(config)
  if config.model.name == 'transformer' and \
      config.model.vocab_size < 256:
    raise ValueError('model.vocab_size must be >= 256 for byte-level data')
  _check_experts(config)
  if config.model.name == 'mlp':
    for field in ('in_dim', 'out_dim'):
      if config.model.get(field, 256) < 256:
        raise ValueError(f'model.{field} must be >= 256 for byte-level data')


@dataclasses.dataclass
class Experiment:
  """Everything a run needs but the data: mesh, model, optimizer, programs.

  Attributes:
    config: the config it was built from.
    mesh: the worker mesh.
    model: the model's functional interface.
    method: the training method.
    tx: the optimizer (inner optimizer wrapped by the method).
    shardings: ``NamedSharding`` of every leaf of the train state between
      steps (``outer.state_layout='offloaded'``: the outer fields in
      ``pinned_host`` memory).
    abstract_state: the train state's shapes, dtypes and shardings.
    programs: the compiled steps, their cross-worker bytes, and evaluation.
    lr_schedule: the inner learning-rate schedule.
    plan: the phase of every step (``loc_opt.outer.Plan``).
    spike_steps: the counts at which gradient spikes are injected.
  """

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model: models.Model
  method: Method
  tx: optax.GradientTransformation
  shardings: Any
  abstract_state: Any
  programs: programs_lib.Programs
  lr_schedule: optax.Schedule
  plan: outer_lib.Plan
  spike_steps: list[int]

  @functools.cached_property
  def _init_fn(self):
    init = functools.partial(state_lib.init_state, model=self.model,
                             tx=self.tx, method=self.method,
                             workers=self.config.mesh.workers)
    return jax.jit(init, out_shardings=self.shardings)

  @functools.cached_property
  def layout(self) -> layout_lib.StateLayout:
    """How checkpoints store the train state (shared fields once)."""
    return layout_lib.StateLayout(
        self.method, self.tx, self.abstract_state, self.config.mesh.workers,
        self.config.batch_size,
        outer_state_layout=cfg_lib.state_layout(self.config))

  def init_state(self) -> dict[str, Any]:
    """The initial train state: one model initialisation on every worker."""
    return self._init_fn(jax.random.key(self.config.seed))

  def eval_params(self, state: dict[str, Any]) -> Any:
    """The weights evaluation uses (per worker for local-update methods)."""
    return self.programs.eval_params_fn(state)

  def evaluate(self, state: dict[str, Any], eval_batches: Any) -> float:
    """Mean eval loss of the state's evaluation weights."""
    return programs_lib.mean_loss(
        lambda b: self.programs.eval_fn(state, b), eval_batches, self.config,
        self.method.per_worker)

  def evaluate_params(self, params: Any, eval_batches: Any) -> float:
    """Mean eval loss of ``params`` (laid out like ``state['params']``)."""
    return programs_lib.mean_loss(
        lambda b: self.programs.params_loss_fn(params, b), eval_batches,
        self.config, self.method.per_worker)

  def sync_bytes(self) -> int | None:
    """Cross-worker bytes of a sync step: the largest of the sync phases
    compiled so far (None if the method never syncs)."""
    synced = [v for k, v in self.programs.bytes_per_step.items()
              if self.plan.is_sync(k)]
    return max(synced) if synced else None


def build_experiment(config: ml_collections.ConfigDict,
                     mesh: jax.sharding.Mesh | None = None) -> Experiment:
  """Validates ``config`` and builds and compiles everything but the data."""
  validate_config(config, jax.device_count() if mesh is None else mesh.size)
  if mesh is None:
    groups = worker_groups(config, jax.device_count())
    mesh = parallel.make_worker_mesh(groups, config.mesh.data,
                                     config.mesh.fsdp, config.mesh.tensor)
  state_layout = cfg_lib.state_layout(config)
  model = models.build_model(config.model)
  method = outer_layout.for_layout(registry.get_method(config.outer.method),
                                   state_layout,
                                   state_lib.param_specs(model, mesh))
  lr_schedule = cfg_lib.lr_schedule(config)
  plan = method.plan(config)
  tx = method.build(config, cfg_lib.make_inner(config, lr_schedule),
                    parallel.WORKER)
  init = functools.partial(state_lib.init_state, model=model, tx=tx,
                           method=method, workers=config.mesh.workers)
  abstract = jax.eval_shape(init, jax.random.key(config.seed))
  on_device = state_lib.state_shardings(
      abstract, state_lib.param_specs(model, mesh), mesh, method.per_worker,
      row_shards=outer_layout.row_shards(method, state_layout))
  shardings = outer_layout.at_rest(on_device, method, state_layout)
  abstract = ckpt_lib.abstract_with_shardings(abstract, shardings)
  programs = programs_lib.build_programs(
      config, model, tx, method, plan, mesh, shardings, abstract,
      eval_params_fn(method, abstract['opt_state']),
      on_device=None if on_device == shardings else on_device)
  _, spike_steps = spikes_lib.spikes_from_config(config.optimizer,
                                                 config.num_steps)
  return Experiment(config, mesh, model, method, tx, shardings, abstract,
                    programs, lr_schedule, plan, spike_steps)


# Fields that do not change what build_experiment compiles: runs that differ
# only in these share one Experiment within a process (resumes, branches,
# merges, tests).
_RUN_CONTROL_FIELDS = ('eval_every', 'eval_batches', 'log_every',
                       'checkpoint_every', 'keep_checkpoints', 'progress',
                       'halt_after_steps', 'init_from', 'logging')
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
  if config.mesh.workers == 1 or cfg_lib.simulates_workers(config):
    return 0  # nothing crosses devices' workers; no compile
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
  dp_config.faults = ml_collections.ConfigDict()  # no injected faults
  with startup.phase('compiling the data-parallel step (the summary '
                     'compares its bytes)'), startup.report_to(None):
    exp = get_experiment(dp_config)
  return exp.programs.bytes_per_step[exp.plan.inner]


_DATA_CACHE: collections.OrderedDict[str, Any] = collections.OrderedDict()


def load_data(config: ml_collections.ConfigDict) -> data_lib.LMData:
  """The run's data (``loc_opt.data.make_lm_data``), read once per process
  for a given data config, worker count, batch, length and seed."""
  key = json.dumps([config.data.to_dict(), config.mesh.workers,
                    config.batch_size, config.data.seq_len, config.seed],
                   sort_keys=True, default=str)
  data = _DATA_CACHE.get(key)
  if data is None:
    make = functools.partial(
        data_lib.make_lm_data, config.data, num_workers=config.mesh.workers,
        global_batch=config.batch_size, seq_len=config.data.seq_len,
        seed=config.seed)
    if jax.process_count() == 1:
      data = make()
    else:  # process 0 prepares the dataset first (no concurrent builds)
      if hosts.is_writer():
        data = make()
      multihost_utils.sync_global_devices('loc_opt: data prepared')
      if not hosts.is_writer():
        data = make()
    _DATA_CACHE[key] = data
    while len(_DATA_CACHE) > 2:
      _DATA_CACHE.popitem(last=False)
  else:
    _DATA_CACHE.move_to_end(key)
  return data


def _batch_layout(exp: Experiment, rows: int):
  """``(global shape, sharding, rows per worker or None)`` of a batch of
  ``rows`` sequences as the programs take it."""
  c, per_worker = exp.config, exp.method.per_worker
  length = c.data.seq_len + 1
  sharding = programs_lib.batch_sharding(exp.mesh, per_worker)
  if per_worker:
    per = rows // c.mesh.workers
    return (c.mesh.workers, per, length), sharding, per
  return (rows, length), sharding, None


def train_batch(exp: Experiment, data: data_lib.LMData,
                position: int) -> jax.Array:
  """The train batch at ``position`` as a global array; this process reads
  only the rows its devices hold."""
  shape, sharding, per = _batch_layout(exp, exp.config.batch_size)
  return hosts.global_batch(sharding, shape, functools.partial(
      hosts.lm_rows_block,
      lambda lo, hi: data.train.rows(position, lo, hi), per))


def eval_batches(exp: Experiment, data: data_lib.LMData,
                 num_batches: int) -> list[jax.Array]:
  """The fixed eval batches as global arrays laid out for the programs;
  this process reads only the rows its devices hold."""
  shape, sharding, per = _batch_layout(exp, data.eval_batch_size)
  read = functools.lru_cache(lambda lo, hi: data.eval_batches(
      num_batches, rows=slice(lo, hi)))
  return [hosts.global_batch(sharding, shape, functools.partial(
      hosts.lm_rows_block, lambda lo, hi, i=i: read(lo, hi)[i], per))
          for i in range(num_batches)]

"""The compiled programs of a run: one train step per phase, and evaluation.

A phase is the static ``sync`` value a method's ``update`` takes
(``loc_opt.outer.plan``): ``False`` for an inner step, ``True`` for a DiLoCo
sync, a fragment / peer-group / state tuple for the methods that send
different things on different steps.
Compiling one program per phase keeps each program's collectives exactly
what that step sends, so the inner program provably moves zero cross-worker
bytes; they are read from the compiled HLO when the program is built.

Local-update methods run their per-worker step under ``jax.shard_map``
manual over ``worker`` only (``loc_opt.parallel.shard_map_workers``); GSPMD
keeps sharding the model inside each worker.
"""

import collections.abc
import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from loc_opt import models
from loc_opt import parallel
from loc_opt.train import config as cfg_lib
from loc_opt.train import faults
from loc_opt.train import hosts
from loc_opt.train import outer_layout
from loc_opt.train import routing as routing_lib
from loc_opt.train import startup
from loc_opt.train.method import Method
from loc_opt.train.method import shared_mask

P = jax.P
# Programs compiled when an experiment is built (further phases: on use).
EAGER_COMPILE_PHASES = 16
# A window's runs of at least this many equal phases (Eager / CO2: the
# round's inner steps) compile as one lax.scan; shorter ones are unrolled.
WINDOW_SCAN_FROM = 4
# The batch axes inside a worker.
_BATCH_AXES = ('data', 'fsdp')


class StepPrograms(collections.abc.Mapping):
  """``phase -> compiled train step``, compiled on first use.

  Iterating lists the phases compiled so far; ``bytes`` and ``transfers``
  hold what each compiled phase's cross-worker collectives move, and
  ``reports`` their whole ``CollectiveReport``.
  """

  def __init__(self, compile_fn, phases):
    self._compile = compile_fn
    self.phases = tuple(phases)  # every phase this run may use
    self._steps: dict[Any, Any] = {}
    self.bytes: dict[Any, int] = {}  # cross-worker bytes (all devices)
    # cross-worker collectives: (kind, bytes one worker contributes)
    self.transfers: dict[Any, tuple[tuple[str, float], ...]] = {}
    # the collectives of each compiled phase (loc_opt.parallel.hlo)
    self.reports: dict[Any, parallel.CollectiveReport] = {}

  def __getitem__(self, phase):
    if phase not in self._steps:
      if phase not in self.phases:
        raise KeyError(phase)
      compiled, report = self._compile(phase)
      self._steps[phase] = compiled
      self.bytes[phase] = int(report.cross_worker_bytes)
      self.transfers[phase] = parallel.cross_worker_transfers(report)
      self.reports[phase] = report
    return self._steps[phase]

  def __iter__(self):
    return iter(self._steps)

  def __len__(self):
    return len(self._steps)


class WindowPrograms:
  """Overlapped programs (``outer.overlap='compiled'``), compiled on use.

  ``windows.phases(count, steps_since_sync)`` is the window that starts at
  a sync step (``loc_opt.outer.Plan.window`` over the method's
  ``overlap_steps``); ``windows[phases]`` its program, ``(state, batches)
  -> (state, loss of the last step)`` with one batch per phase, which runs
  the sync step and the steps that overlap its collective as one program
  (``loc_opt.parallel.overlap_window``). ``reports`` holds each compiled
  window's collectives.
  """

  def __init__(self, compile_fn, plan, overlap_steps: int):
    self._compile = compile_fn
    self.plan, self.overlap_steps = plan, overlap_steps
    self._programs: dict[tuple, Any] = {}
    self.reports: dict[tuple, parallel.CollectiveReport] = {}

  def phases(self, count: int, steps_since_sync: int | None = None
             ) -> tuple:
    """The phases of the window that starts at ``count`` (a sync)."""
    return self.plan.window(count, self.overlap_steps, steps_since_sync)

  def __getitem__(self, phases: tuple):
    phases = tuple(phases)
    if phases not in self._programs:
      compiled, report = self._compile(phases)
      self._programs[phases] = compiled
      self.reports[phases] = report
    return self._programs[phases]

  def __len__(self):
    return len(self._programs)


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
    windows: with ``outer.overlap='compiled'``, the overlapped programs
      (:class:`WindowPrograms`); else None.
    routing: ``(params, batch) -> routing statistics`` of a
      Mixture-of-Experts LM (``loc_opt.train.routing``); else None.
  """
  steps: StepPrograms
  eval_fn: Any
  eval_params_fn: Any
  params_loss_fn: Any
  windows: 'WindowPrograms | None' = None
  routing: Any = None

  @property
  def bytes_per_step(self) -> collections.abc.Mapping:
    """phase -> cross-worker bytes of that step (all devices)."""
    return _BytesView(self.steps)


def loss_fn(model: models.Model, params: Any, batch: jax.Array) -> jax.Array:
  """Next-token loss of ``params`` on a ``[..., seq_len + 1]`` batch."""
  logits = model.apply(params, batch[..., :-1])
  with jax.named_scope('loss'):
    return models.lm_loss(logits, batch[..., 1:])


def train_loss_fn(model: models.Model, params: Any, batch: jax.Array
                  ) -> jax.Array:
  """The training objective: :func:`loss_fn` plus the model's auxiliary
  loss where it has one (a Mixture-of-Experts LM's load-balancing and
  router z-losses); evaluation reports :func:`loss_fn` alone."""
  if model.apply_aux is None:
    return loss_fn(model, params, batch)
  logits, aux = model.apply_aux(params, batch[..., :-1])
  with jax.named_scope('loss'):
    return models.lm_loss(logits, batch[..., 1:]) + aux['aux_loss']


def batch_sharding(mesh, per_worker: bool) -> jax.NamedSharding:
  """Batches: ``[workers, rows, len]`` split over workers and the batch axes
  inside them, or ``[rows, len]`` split over all of them."""
  if per_worker:
    return jax.NamedSharding(mesh, P(parallel.WORKER, _BATCH_AXES))
  return jax.NamedSharding(mesh, P((parallel.WORKER,) + _BATCH_AXES))


def _abstract_batch(config, mesh, per_worker) -> jax.ShapeDtypeStruct:
  m, length = config.mesh, config.data.seq_len + 1
  shape = ((m.workers, config.batch_size // m.workers, length) if per_worker
           else (config.batch_size, length))
  return jax.ShapeDtypeStruct(shape, jnp.int32,
                              sharding=batch_sharding(mesh, per_worker))


def _pinned(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
  """``tree`` constrained to the partition ``specs`` (a tree of ``P``):
  as specs under the mesh in context (inside the workers' ``shard_map``),
  else as shardings on ``mesh`` (one worker, no map)."""
  if not jax.sharding.get_abstract_mesh().empty:
    return jax.lax.with_sharding_constraint(tree, specs)
  shardings = jax.tree.map(lambda p: jax.NamedSharding(mesh, p), specs,
                           is_leaf=lambda x: isinstance(x, P))
  return jax.lax.with_sharding_constraint(tree, shardings)


def _worker_step(model, tx, fault_cfg, method: Method, absent=None,
                 reset=None, inputs=None, specs=None, mesh=None,
                 vmapped=False):
  """One worker's step: gradients (with injected faults), the update, and
  the skip of a non-finite step (``loc_opt.train.faults``). With ``absent``
  (``faults.absences``), a step that syncs tells the method whether this
  worker is present (``update(..., present=...)``). With ``reset``
  (``(opt_state, params) -> the anchor``), a worker whose parameters are
  still not finite after a step that syncs (its pseudo-gradient was left
  out; an update cannot move a NaN) restarts from the anchor. With
  ``inputs`` (``Method.step_inputs``), every step passes ``inputs(step,
  worker)`` to the update. With ``specs`` (the model's within-worker
  partition specs on ``mesh``), the parameters entering the loss and their
  gradients are pinned to them: otherwise, in a program that also syncs,
  sharding propagation can carry the sync's layout (the pseudo-gradient
  spread over the data-parallel devices) back into the model, which then
  computes partial products over the data axis and all-reduces activations
  (seen with the MLP, whose activations carry no constraints of their
  own). ``vmapped``: the step runs under ``jax.vmap`` over the workers
  (``parallel.shard_map_workers``' stacked path), where it orders the
  skip's selects so that the optimizer state is updated in place."""
  nan_steps, nan_workers = fault_cfg['nan_grad_steps'], \
      fault_cfg['nan_grad_workers']
  per_worker = method.per_worker

  def worker_step(params, opt_state, counters, batch, step, *, sync,
                  skippable):
    worker = jax.lax.axis_index(parallel.WORKER) if per_worker else None
    params = faults.inject(params, step, worker,
                           fault_cfg['nan_param_steps'],
                           fault_cfg['nan_param_workers'])
    pin = (lambda tree: tree) if specs is None else (
        lambda tree: _pinned(tree, specs, mesh))
    loss, grads = jax.value_and_grad(functools.partial(train_loss_fn, model))(
        pin(params), batch)
    grads = faults.inject(pin(grads), step, worker, nan_steps, nan_workers)
    with jax.named_scope('non_finite_guard'):
      ok = jnp.isfinite(loss) & faults.all_finite(grads)
      if not skippable:  # the step talks to other workers: send finite values
        grads = faults.zero_if_not(ok, grads)
    extra = {} if inputs is None else inputs(step, worker)
    if absent is not None and not skippable:
      extra['present'] = faults.present(step, worker, absent)
    # Named scopes show in profiles (experiments.profile_step) and traces.
    with jax.named_scope('optimizer'):
      updates, new_state = tx.update(grads, opt_state, params, sync=sync,
                                     **extra)
      new_params = optax.apply_updates(params, updates)
    with jax.named_scope('non_finite_guard'):
      if skippable:  # an inner step: skip it where it went bad
        new_params = faults.keep_if(ok, new_params, params)
        if vmapped:
          # The parameters' update and the state's select both read the old
          # state (AdamW's moments), which the select overwrites in place
          # (donated); ordered by nothing, XLA copied every moment leaf
          # each step. The barrier puts the state's select after the
          # parameters' (1.02-1.03x the stacked 853k and 1.48M LM steps).
          # Under shard_map the same barrier only moves the copies to the
          # outputs, so it stays off there.
          _, opt_state = jax.lax.optimization_barrier(
              (new_params, opt_state))
        new_state = faults.keep_if(ok, new_state, opt_state,
                                   shared_mask(method, new_state))
      elif reset is not None:
        new_params = faults.keep_if(faults.all_finite(new_params),
                                    new_params, reset(new_state, new_params))
    return new_params, new_state, faults.advance(counters, ok), loss

  return worker_step


def _train_steps(config, model, tx, method: Method, plan, mesh, shardings,
                 abstract_state, phases, on_device=None) -> StepPrograms:
  """The train step of every phase, the first few compiled now. With
  ``on_device`` (the state's shardings while a step runs, where
  ``shardings`` keep the outer state in host memory between steps), every
  phase but the inner one moves the state there and back."""
  abstract_batch = _abstract_batch(config, mesh, method.per_worker)
  loss_sharding = jax.NamedSharding(
      mesh, P(parallel.WORKER) if method.per_worker else P())
  absent = None
  if faults.drops_workers(config):
    absent = faults.absences(config, plan)
  # Methods that leave a non-finite worker out of a sync share an anchor
  # (their evaluation weights) to reset it to.
  reset = method.eval_params if method.left_out is not None else None
  inputs = (method.step_inputs(config) if method.step_inputs is not None
            else None)
  specs = models.resolve_specs(model.specs, mesh.axis_names)
  stacked = cfg_lib.simulates_workers(config)
  vmapped = parallel.runs_under_vmap(mesh, stacked=stacked)
  worker_step = _worker_step(model, tx, faults.settings(config), method,
                             absent, reset, inputs, specs, mesh, vmapped)

  def step_fn(state, batch, sync):
    # Only a step that talks to no other worker can be skipped on its own.
    skippable = method.local_inner_steps and sync == plan.inner
    run = functools.partial(worker_step, sync=sync, skippable=skippable)
    if method.per_worker:
      run = parallel.shard_map_workers(run, mesh,
                                       in_axes=(0, 0, 0, 0, None),
                                       stacked=stacked)
    params, opt_state, counters, loss = run(
        state['params'], state['opt_state'], state['faults'], batch,
        state['step'])
    new = dict(state, params=params, opt_state=opt_state, faults=counters,
               step=state['step'] + 1,
               data_position=state['data_position'] + 1)
    return new, loss

  def compile_phase(phase):
    run = functools.partial(step_fn, sync=phase)
    if on_device is not None and phase != plan.inner:
      run = outer_layout.offloaded_step(run, on_device, shardings)

    def step(state, batch):  # the program's name in logs: jit(step)
      return run(state, batch)

    step = jax.jit(step,
                   in_shardings=(shardings, abstract_batch.sharding),
                   out_shardings=(shardings, loss_sharding),
                   donate_argnums=0)
    return _compile(step, method, mesh, abstract_state, abstract_batch)

  def compile_window(phases):
    if on_device is not None:  # the checks keep the two options apart
      raise ValueError('outer.overlap=compiled does not run with '
                       "outer.state_layout='offloaded'")
    window = parallel.overlap_window(step_fn, phases,
                                     scan_from=WINDOW_SCAN_FROM)
    k = len(phases)
    step = jax.jit(lambda state, batches: _last_loss(window(state, batches)),
                   in_shardings=(shardings, (abstract_batch.sharding,) * k),
                   out_shardings=(shardings, loss_sharding),
                   donate_argnums=0)
    return _compile(step, method, mesh, abstract_state, (abstract_batch,) * k,
                    parallel.overlap.COMPILER_OPTIONS)

  steps = StepPrograms(compile_phase, phases)
  # The run's programs are compiled now (so throughput excludes compiling),
  # unless a plan has very many phases: those compile on first use.
  eager = phases[:EAGER_COMPILE_PHASES]
  for k, phase in enumerate(eager, 1):
    t0 = time.perf_counter()
    what = (f'train step {k} of {len(eager)} '
            f'({_phase_name(phase, plan.inner)})')
    startup.say(f'compiling {what} ...')
    steps[phase]
    startup.say(f'compiled {what} in {time.perf_counter() - t0:.1f} s')
  windows = None
  if config.outer.get('overlap', 'none') == 'compiled':
    windows = WindowPrograms(compile_window, plan,
                             method.overlap_steps(config))
  return steps, windows


def _phase_name(phase: Any, inner: Any) -> str:
  """A phase as the startup lines name it."""
  if phase == inner:
    return 'inner steps'
  return 'sync' if phase is True else f'phase {phase}'


def _last_loss(out):
  """``(state, loss of the window's last step)`` of a window's output."""
  state, losses = out
  return state, losses[-1]


def _compile(step, method, mesh, abstract_state, abstract_batch,
             options=None):
  """The compiled ``step`` and its collectives (``options``: XLA's)."""
  # A method without a worker axis (data parallel) is traced with the mesh
  # in context, so that the model's activation constraints apply as they
  # do inside ``shard_map`` (there the mesh comes with the shard_map).
  with (contextlib.nullcontext() if method.per_worker
        else jax.set_mesh(mesh)):
    lowered = step.lower(abstract_state, abstract_batch)
  compiled = lowered.compile(compiler_options=options)
  return compiled, parallel.collective_bytes(compiled, mesh)


def build_programs(config: ml_collections.ConfigDict, model: models.Model,
                   tx: optax.GradientTransformation, method: Method,
                   plan: Any, mesh: jax.sharding.Mesh, shardings: Any,
                   abstract_state: Any, eval_params: Any, *,
                   on_device: Any = None) -> Programs:
  """Compiles the train step of each phase and the evaluation programs.

  Every worker evaluates its eval weights on its slice of the eval batch,
  so evaluation itself crosses no worker boundary. ``on_device``: the
  state's shardings while a program runs, when ``shardings`` (between
  steps) keep the outer state in host memory (``outer.state_layout=
  'offloaded'``); None otherwise.
  """
  steps, windows = _train_steps(config, model, tx, method, plan, mesh,
                                shardings, abstract_state,
                                plan.phases(config.num_steps), on_device)

  def worker_eval(params, opt_state, batch):
    return loss_fn(model, eval_params(opt_state, params), batch)

  stacked = cfg_lib.simulates_workers(config)
  per_worker = (functools.partial(parallel.shard_map_workers, mesh=mesh,
                                  stacked=stacked)
                if method.per_worker else lambda fn: fn)
  eval_sharding = batch_sharding(mesh, method.per_worker)
  eval_run = per_worker(worker_eval)
  params_run = per_worker(lambda opt_state, params: eval_params(opt_state,
                                                                params))

  def on_dev(fn):  # evaluation reads the anchor: on the device
    if on_device is None:
      return fn
    return outer_layout.to_device(fn, on_device, shardings)

  eval_fn = jax.jit(
      on_dev(lambda state, batch: eval_run(state['params'],
                                           state['opt_state'], batch)),
      in_shardings=(shardings, eval_sharding))
  eval_params_fn = jax.jit(
      on_dev(lambda state: params_run(state['opt_state'], state['params'])),
      in_shardings=(shardings,), out_shardings=shardings['params'])
  params_loss_fn = jax.jit(per_worker(functools.partial(loss_fn, model)),
                           in_shardings=(shardings['params'], eval_sharding))
  routing = routing_lib.routing_program(
      model, mesh, shardings['params'], eval_sharding, method.per_worker,
      stacked)
  return Programs(steps=steps, eval_fn=eval_fn,
                  eval_params_fn=eval_params_fn,
                  params_loss_fn=params_loss_fn, windows=windows,
                  routing=routing)


def mean_loss(loss_of_batch, eval_batches, config, per_worker) -> float:
  """Mean of ``loss_of_batch`` over ``eval_batches``: global ``[rows,
  len]`` batches (split per worker for local-update methods here), or
  global arrays already laid out for the program
  (``loc_opt.train.experiment.eval_batches``)."""
  losses = []
  for batch in eval_batches:
    if per_worker and batch.ndim == 2:
      batch = batch.reshape(config.mesh.workers, -1, batch.shape[-1])
    losses.append(np.mean(hosts.fetch(loss_of_batch(batch))))
  return float(np.mean(losses))

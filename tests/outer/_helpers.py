"""Pieces shared by the tests of loc_opt.outer (a helper, not a test module).

Small models and per-worker data, runners that train ``M`` workers under
``vmap`` (each step's program picked by ``lax.cond`` or by the method's
plan), and the collectives of one compiled step on a worker mesh, with the
checks that every two-phase method (inner / sync) passes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import parallel
from tests import optax_conformance as conf

M = 4


def stack(tree, m=M):
  """``tree`` broadcast to ``m`` identical workers (a leading axis)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (m,) + x.shape), tree)


def worker(tree, m):
  """Worker ``m``'s slice of a stacked tree."""
  return jax.tree.map(lambda x: x[m], tree)


# ---------------------------------------------------------------- models ---
def quad_loss(params, batch):
  """``mean((tanh(x w) + b - y)^2)``: the loss of both models below."""
  x, y = batch
  pred = jnp.tanh(x @ params['w']) + params['b']
  return jnp.mean((pred - y) ** 2)


def worker_batches(step, m=M):
  """Per-worker batches of 8 for the 4 -> 3 model of
  ``conf.example_params``."""
  key = jax.random.fold_in(jax.random.key(42), step)
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (m, 8, 4)), jax.random.normal(ky, (m, 8, 3)))


def wide_batches(step, m=M):
  """Per-worker batches of 4 for a 16 -> 8 model (``w`` 16 x 8, ``b`` 8)."""
  kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(42), step))
  return (jax.random.normal(kx, (m, 4, 16)), jax.random.normal(ky, (m, 4, 8)))


# DeMo and SparseLoCo: a 16 x 8 weight and a bias of 8, gradients given.
TILE_SHAPES = {'w': (16, 8), 'b': (8,)}


def tile_params():
  keys = jax.random.split(jax.random.key(0), len(TILE_SHAPES))
  return {k: jax.random.normal(key, s) for key, (k, s) in
          zip(keys, sorted(TILE_SHAPES.items()))}


def tile_grads(step, m=M):
  """Different gradients on every worker, for :func:`tile_params`."""
  key = jax.random.fold_in(jax.random.key(7), step)
  keys = jax.random.split(key, len(TILE_SHAPES))
  return {k: jax.random.normal(key, (m,) + s) for key, (k, s) in
          zip(keys, sorted(TILE_SHAPES.items()))}


# --------------------------------------------------------------- runners ---
def train_step(tx, sync=None, loss=quad_loss):
  """One worker's step: the gradient of ``loss``, then ``tx`` with the
  static phase ``sync``."""

  def step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params, sync=sync)
    return optax.apply_updates(params, updates), state

  return step


def step_jaxpr(tx, m=M):
  """The jaxpr of one step of ``m`` stacked workers under ``tx``, as text:
  two transforms with equal step jaxprs are the same operations in the
  same order, so their runs agree bit for bit on any machine."""
  params = stack(conf.example_params(), m)
  state = jax.vmap(tx.init)(params)
  return str(jax.make_jaxpr(parallel.vmap_workers(train_step(tx)))(
      params, state, worker_batches(0, m)))


def grads_step(tx):
  """The jitted step of stacked workers fed their gradients directly (for
  hand-computed traces), deciding syncs on device."""

  @jax.jit
  @parallel.vmap_workers
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run_workers(tx, steps, m=M, runner=None):
  """Trains m workers of the 4 -> 3 model with tx under vmap (or
  ``runner``); returns (stacked params, state)."""

  def step(params, state, batch):
    grads = jax.grad(quad_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  runner = runner or parallel.vmap_workers
  fn = jax.jit(runner(step))
  params = stack(conf.example_params(), m)
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    params, state = fn(params, state, worker_batches(i, m))
  return params, state


def run_sharded(tx, steps):
  """As :func:`run_workers`, under ``shard_map`` on :func:`worker_mesh`."""
  return run_workers(tx, steps, runner=functools.partial(
      parallel.shard_map_workers, mesh=worker_mesh()))


def run_planned(tx, plan, steps, m=M):
  """As :func:`run_workers`, but each step runs the program of its phase
  (``sync=plan(count)``); returns (stacked params, state, the programs)."""
  programs = {s: jax.jit(parallel.vmap_workers(train_step(tx, s)))
              for s in plan.phases(steps)}
  params = stack(conf.example_params(), m)
  state = jax.vmap(tx.init)(params)
  for i in range(steps):
    params, state = programs[plan(i)](params, state, worker_batches(i, m))
  return params, state, programs


def check_plan_matches_cond(tx, plan, steps):
  """Asserts that the plan's two static programs (inner, sync) give the
  numbers of the ``lax.cond`` program; returns the planned state."""
  params, state, programs = run_planned(tx, plan, steps)
  assert set(programs) == {False, True}
  want, want_state = run_workers(tx, steps)
  conf.assert_trees_close(params, want, rtol=1e-6, atol=1e-7)
  conf.assert_trees_close(state, want_state, rtol=1e-6, atol=1e-7)
  return state


# ------------------------------------------------------------------- HLO ---
@functools.cache
def worker_mesh():
  """``M`` workers x 2 data-parallel devices (the 8 CPU devices)."""
  return parallel.make_worker_mesh(M, data=2)


def phase_report(tx, params, sync, mesh):
  """Collectives of one compiled step of ``tx`` with phase ``sync`` on
  ``mesh`` (stacked ``params``; the gradients are shaped like them). The
  state is initialized under the named worker axis, as the sharded outer
  state's ``init`` needs."""
  state = jax.eval_shape(parallel.vmap_workers(tx.init), params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, sync=sync)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(parallel.shard_map_workers(step, mesh)).lower(
      params, state, params).compile()
  return parallel.collective_bytes(compiled, mesh)


def check_two_phase_bytes(tx, params, theory):
  """Asserts the cross-worker bytes of a method with an inner and a sync
  phase: none in the inner program, ``theory`` per worker in the sync
  program, and the ``lax.cond`` program sending only inside its sync
  branch."""

  def report(sync):
    return phase_report(tx, params, sync, worker_mesh())

  assert report(False).cross_worker_bytes_range == (0, 0)
  np.testing.assert_allclose(report(True).cross_worker_bytes_per_worker,
                             theory, rtol=0.1)
  cond = report(None)
  assert cond.cross_worker_bytes == 0
  (branches,) = cond.branches.values()
  assert sorted(branches)[0] == 0
  np.testing.assert_allclose(sorted(branches)[1] / M, theory, rtol=0.1)

"""The small problem of the reference tests (a helper, not a test module).

Four workers minimise their own quadratics
``f_m(theta) = 1/2 sum(a * (theta - c_{m,t})**2)`` over a 4-vector ``b`` and
a 4 x 4 matrix ``w``; the targets ``c_{m,t}`` change every step (a
minibatch's noise), so the gradient ``a * (theta - c_{m,t})`` depends on
where each worker is and the order of a method's operations shows in the
numbers. :func:`run` trains a library transform on it (float32, workers
under ``vmap``); the tests replay the same steps in float64 NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import parallel

M = 4
SHAPES = {'b': (4,), 'w': (4, 4)}


def _f32(x):
  """``x`` rounded to float32 and held in float64 (both sides start from
  the same numbers)."""
  return np.asarray(np.asarray(x, np.float32), np.float64)


def start():
  """The initial parameters (one copy)."""
  rng = np.random.default_rng(0)
  return {k: _f32(rng.standard_normal(s)) for k, s in SHAPES.items()}


def curvature():
  """The per-coordinate curvature ``a`` in [0.5, 1.5]."""
  rng = np.random.default_rng(1)
  return {k: _f32(rng.uniform(0.5, 1.5, s)) for k, s in SHAPES.items()}


def targets(step, scale=None):
  """``c_{m,t}`` for every worker at step ``step`` (0-based): a fixed
  per-worker target plus fresh noise; ``scale`` multiplies a leaf's."""
  base = np.random.default_rng(2)
  noise = np.random.default_rng(100 + step)
  out = {}
  for k, s in SHAPES.items():
    c = base.standard_normal((M,) + s) + 0.3 * noise.standard_normal(
        (M,) + s)
    out[k] = _f32(c * (scale or {}).get(k, 1.0))
  return out


def grads(theta, step, scale=None):
  """NumPy float64 gradients of every worker (``theta`` stacked)."""
  a, c = curvature(), targets(step, scale)
  return {k: a[k] * (theta[k] - c[k]) for k in theta}


def stacked(tree):
  """``tree`` copied for every worker (a leading axis of ``M``)."""
  return {k: np.repeat(v[None], M, axis=0) for k, v in tree.items()}


def mean(tree):
  """The worker mean of a stacked tree, still stacked."""
  return {k: np.repeat(v.mean(0, keepdims=True), M, axis=0)
          for k, v in tree.items()}


def run(tx, steps, *, phase=None, scale=None, targets_fn=None):
  """Trains ``tx`` on the problem for ``steps`` steps.

  Args:
    tx: a per-worker transform (worker axis ``'worker'``).
    steps: number of steps.
    phase: ``step -> sync`` (the static phase of each step), or ``None``
      (the transform decides on device).
    scale: per-leaf scale of the targets (see :func:`targets`).
    targets_fn: ``step -> targets`` in place of :func:`targets`.

  Returns:
    ``(params, state)``: stacked params as float64 NumPy, and the state.
  """
  a = {k: jnp.asarray(v, jnp.float32) for k, v in curvature().items()}
  programs = {}

  def program(sync):
    if sync not in programs:
      kwargs = {} if phase is None else {'sync': sync}

      def step(params, state, c):
        g = jax.tree.map(lambda aa, p, cc: aa * (p - cc), a, params, c)
        updates, state = tx.update(g, state, params, **kwargs)
        return jax.tree.map(lambda p, u: p + u, params, updates), state

      programs[sync] = jax.jit(parallel.vmap_workers(step))
    return programs[sync]

  params = {k: jnp.asarray(v, jnp.float32) for k, v in
            stacked(start()).items()}
  state = jax.vmap(tx.init)(params)
  targets_fn = targets_fn or (lambda t: targets(t, scale))
  for t in range(steps):
    c = {k: jnp.asarray(v, jnp.float32) for k, v in targets_fn(t).items()}
    params, state = program(None if phase is None else phase(t))(
        params, state, c)
  return {k: np.asarray(v, np.float64) for k, v in params.items()}, state


def assert_close(got, want, rtol, atol):
  """Leaf-by-leaf ``assert_allclose`` of two dicts."""
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol,
                               err_msg=k)

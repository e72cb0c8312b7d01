r"""L-GreCo: layer-wise compression levels chosen under an error budget.

Given candidate compressors (PowerSGD ranks, top-k densities, bit widths),
L-GreCo picks one per layer to minimise the bytes sent while the total
compression error stays within that of a known-good uniform choice ``c*``:

.. math::

  \min_{c_1..c_L} \sum_\ell s_{\ell, c_\ell} \quad \text{s.t.} \quad
  \sum_\ell \epsilon_{\ell, c_\ell} \le E = \sum_\ell \epsilon_{\ell, c^*},
  \qquad \epsilon_{\ell, c} = \lVert A_\ell - C_c(A_\ell) \rVert^2,

a multiple-choice knapsack solved by dynamic programming over the error
discretised into ``bins`` steps of ``E / bins``.

Planning runs on the host between steps (:func:`lgreco_errors`,
:func:`lgreco_plan`, :func:`lgreco_replan`) and yields a :func:`per_leaf`
compressor. The choices fix static shapes (ranks, ``k``), so a re-plan means
a new compressor, a new state for it and a re-compiled step: keep the
re-plan period long (the paper re-plans every few thousand steps after a
warmup at ``c*``). Error-feedback buffers of an outer wrapper keep their
shapes and can be carried over.

Reference:
  Alimohammadi, Markov, Frantar, Alistarh, *L-GreCo: Layerwise-Adaptive
  Gradient Compression for Efficient and Accurate Deep Learning*, MLSys
  2024 (arXiv 2022).
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import _checks
from loc_opt.compression import codecs as codecs_lib
from loc_opt.compression import comm as comm_lib
from loc_opt.compression import compressor as compressor_lib

Compressor = compressor_lib.Compressor
Scheme = Compressor | codecs_lib.Codec | None


def per_leaf(schemes: Sequence[Scheme], name: str = 'per_leaf') -> Compressor:
  """A compressor that sends leaf ``i`` (in ``jax.tree.leaves`` order)
  through ``schemes[i]``.

  Args:
    schemes: one compressor, codec or ``None`` (fp32 mean) per leaf.
    name: the compressor's name.

  Returns:
    The compressor; its state is a tuple of the schemes' states, each for a
    one-leaf list.
  """
  compressors = tuple(compressor_lib.to_compressor(s) for s in schemes)

  def check(leaves):
    if len(leaves) != len(compressors):
      raise ValueError(f'{name} has {len(compressors)} schemes for '
                       f'{len(leaves)} leaves')

  def init(tree):
    leaves = jax.tree.leaves(tree)
    check(leaves)
    return tuple(c.init([x]) for c, x in zip(compressors, leaves))

  def mean(tree, state, comm, key):
    leaves, treedef = jax.tree.flatten(tree)
    check(leaves)
    means, sent, new = [], [], []
    for i, (c, x, s) in enumerate(zip(compressors, leaves, state)):
      (m,), (t,), s = c.mean([x], s, comm, jax.random.fold_in(key, i))
      means.append(m)
      sent.append(t)
      new.append(s)
    return treedef.unflatten(means), treedef.unflatten(sent), tuple(new)

  def payload_bytes(tree):
    leaves = jax.tree.leaves(tree)
    check(leaves)
    return int(sum(c.payload_bytes([x]) for c, x in zip(compressors, leaves)))

  return Compressor(name, init, mean, payload_bytes)


def _reconstruct(compressor: Compressor, leaves: list[jax.Array],
                 key: jax.Array) -> list[jax.Array]:
  """``C(x)`` of every leaf as one worker (a worker axis of size 1) sees it."""
  def one(vs):
    _, sent, _ = compressor.mean(vs, compressor.init(vs),
                                 comm_lib.Comm('lgreco_worker'), key)
    return sent
  fn = jax.jit(jax.vmap(one, axis_name='lgreco_worker'))
  out = fn([jnp.asarray(x, jnp.float32)[None] for x in leaves])
  return [y[0] for y in out]


def lgreco_errors(tree: Any, candidates: Sequence[Scheme], *,
                  key: jax.Array | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
  r"""Per-leaf compression errors and sizes of every candidate.

  ``errors[l, c] = ||A_l - C_c(A_l)||^2`` where ``C_c(A_l)`` is what
  candidate ``c`` reconstructs from one worker's message for leaf ``l`` of
  ``tree`` (``A``: the error-compensated gradient, or a running average of
  it), computed with a fresh state (no warm start) by one call of the
  candidate on the whole tree (one compilation per candidate; candidates are
  assumed to treat leaves independently, as leaf-wise compressors do);
  ``sizes[l, c]`` is the bytes the candidate sends for that leaf. Runs on
  the host, between steps.

  All workers must plan from the same statistics (e.g. ``A`` averaged over
  workers) so that they pick the same compressors.

  Args:
    tree: a pytree of arrays (one worker's values, no worker axis).
    candidates: compressors or codecs (``None``: fp32).
    key: PRNG key for randomized candidates (default ``key(0)``).

  Returns:
    ``(errors, sizes)``, float64 and int64 arrays of shape
    ``[num_leaves, num_candidates]``.
  """
  key = jax.random.key(0) if key is None else key
  comps = [compressor_lib.to_compressor(c) for c in candidates]
  leaves = jax.tree.leaves(tree)
  errors = np.zeros((len(leaves), len(comps)), np.float64)
  sizes = np.zeros((len(leaves), len(comps)), np.int64)
  for j, c in enumerate(comps):
    recs = _reconstruct(c, leaves, key)
    for i, (x, rec) in enumerate(zip(leaves, recs)):
      diff = np.asarray(x, np.float64) - np.asarray(rec, np.float64)
      errors[i, j] = float(np.sum(diff * diff))
      sizes[i, j] = c.payload_bytes([x])
  return errors, sizes


def lgreco_plan(errors: Any, sizes: Any, budget: float | None = None,
                bins: int = 1000, *,
                reference: int | None = None) -> tuple[int, ...]:
  r"""Cheapest per-layer choice whose total error is within ``budget``.

  Multiple-choice knapsack by dynamic programming over the error rounded
  **up** to multiples of ``budget / bins``:
  ``dp[l][b] = min_c dp[l-1][b - bin(e_{l,c})] + s_{l,c}``, the answer the
  least ``dp[L][b]`` over ``b <= bins``, then backtracking. Rounding up
  keeps the true total error within the budget (up to a relative 1e-12
  that absorbs float rounding of exact multiples); the result is optimal up to
  that rounding: never more expensive than the best choice whose error is
  within ``budget - L * budget / bins``. Cost ``O(L |C| bins)``.

  Args:
    errors: ``[L, C]`` errors ``e_{l,c}`` (non-negative).
    sizes: ``[L, C]`` bytes ``s_{l,c}``.
    budget: the total error allowed; default the uniform ``reference``'s
      total error.
    bins: the error discretisation ``D``.
    reference: a candidate index ``c*``. When given, the plan is never more
      expensive than using ``c*`` on every leaf if that is within budget.

  Returns:
    The chosen candidate index per leaf.

  Raises:
    ValueError: if no choice is within the budget.
  """
  errors = np.asarray(errors, np.float64)
  sizes = np.asarray(sizes, np.float64)
  if errors.shape != sizes.shape or errors.ndim != 2:
    raise ValueError(f'errors {errors.shape} and sizes {sizes.shape} must be '
                     'the same [layers, candidates] shape')
  if np.any(errors < 0):
    raise ValueError('errors must be non-negative')
  num_layers, num_cands = errors.shape
  if budget is None:
    if reference is None:
      raise ValueError('lgreco_plan needs a budget or a reference candidate')
    budget = float(errors[:, reference].sum())
  _checks.positive_int(bins, 'bins', arrays=True)
  if budget <= 0:
    # Only exact choices fit: take the cheapest error-free one per layer.
    choice = []
    for l in range(num_layers):
      ok = np.flatnonzero(errors[l] <= 0)
      if not ok.size:
        raise ValueError(f'no error-free candidate for leaf {l} at budget 0')
      choice.append(int(ok[np.argmin(sizes[l, ok])]))
    return tuple(choice)

  unit = budget / bins
  # Bins beyond the capacity are infeasible; mark them with bins + 1.
  with np.errstate(over='ignore', invalid='ignore'):
    cost = np.ceil(errors / unit * (1 - 1e-12))
  cost = np.where(cost > bins, bins + 1, cost).astype(np.int64)
  inf = np.inf
  dp = np.full(bins + 1, inf)
  dp[0] = 0.0
  back = np.zeros((num_layers, bins + 1), np.int64)
  for l in range(num_layers):
    new = np.full(bins + 1, inf)
    arg = np.full(bins + 1, -1, np.int64)
    for c in range(num_cands):
      w = cost[l, c]
      if w > bins:
        continue
      cand = np.full(bins + 1, inf)
      cand[w:] = dp[:bins + 1 - w] + sizes[l, c]
      better = cand < new
      new = np.where(better, cand, new)
      arg = np.where(better, c, arg)
    dp = new
    back[l] = arg
  best = int(np.argmin(dp))
  if not np.isfinite(dp[best]):
    if reference is not None:
      return (int(reference),) * num_layers
    raise ValueError('no choice of candidates is within the error budget')
  choice = []
  b = best
  for l in reversed(range(num_layers)):
    c = int(back[l, b])
    choice.append(c)
    b -= int(cost[l, c])
  choice = tuple(reversed(choice))
  if reference is not None:
    uniform = (int(reference),) * num_layers
    if (errors[:, reference].sum() <= budget and
        sizes[:, reference].sum() < plan_bytes(sizes, choice)):
      return uniform
  return choice


def plan_bytes(sizes: Any, choice: Sequence[int]) -> float:
  """Total of ``sizes[l, choice[l]]``."""
  sizes = np.asarray(sizes)
  return float(sum(sizes[l, c] for l, c in enumerate(choice)))


def plan_error(errors: Any, choice: Sequence[int]) -> float:
  """Total of ``errors[l, choice[l]]``."""
  errors = np.asarray(errors, np.float64)
  return float(sum(errors[l, c] for l, c in enumerate(choice)))


class LGreCoPlan(NamedTuple):
  """A re-plan: the choices and the compressor that applies them.

  Attributes:
    choice: candidate index per leaf.
    errors: ``[L, C]`` measured errors.
    sizes: ``[L, C]`` bytes.
    budget: the error budget (the uniform reference's error).
    compressor: :func:`per_leaf` over the chosen candidates.
  """

  choice: tuple[int, ...]
  errors: np.ndarray
  sizes: np.ndarray
  budget: float
  compressor: Compressor


def lgreco_replan(tree: Any, candidates: Sequence[Scheme], reference: int,
                  *, bins: int = 1000,
                  key: jax.Array | None = None) -> LGreCoPlan:
  """Measures, plans and builds the per-leaf compressor (host side).

  Call between steps with the statistics all workers agree on. The returned
  compressor has new static shapes: initialise its state
  (``plan.compressor.init(params)``), rebuild the transform
  (``compressed_all_reduce(plan.compressor, ...)``) and re-jit the step.

  Args:
    tree: the statistics ``A`` (e.g. the error-compensated mean gradient).
    candidates: compressors or codecs, e.g. ``[powersgd(1), powersgd(2),
      powersgd(4), powersgd(8)]``.
    reference: index of the uniform choice ``c*`` that sets the budget.
    bins: the DP's error discretisation.
    key: PRNG key for randomized candidates.

  Returns:
    An :class:`LGreCoPlan`.
  """
  errors, sizes = lgreco_errors(tree, candidates, key=key)
  budget = float(errors[:, reference].sum())
  choice = lgreco_plan(errors, sizes, budget, bins, reference=reference)
  names = ','.join(str(c) for c in choice)
  comp = per_leaf([candidates[c] for c in choice], name=f'lgreco({names})')
  return LGreCoPlan(choice, errors, sizes, budget, comp)


def uniform_bytes(sizes: Any, reference: int) -> float:
  """Bytes of the uniform choice ``reference`` on every leaf."""
  return float(np.asarray(sizes)[:, reference].sum())


"""Elastic resume: continue a run's checkpoint with another worker count.

A run of a method whose workers share an anchor (``Method.elastic``:
DiLoCo, local SGD, Streaming DiLoCo) may restart from its checkpoint with
another ``mesh.workers`` (and other within-worker axes), e.g. after losing a
host. From the checkpoint (``loc_opt.train.layout``, shared fields stored
once):

* the shared fields (anchor, outer optimizer state, in-flight averages,
  counters), the step, the input position and the RNG carry over;
* workers ``i < min(old, new)`` keep their own leaves: parameters, inner
  optimizer state, codec state, fault counters;
* each new worker starts from the anchor: parameters = the anchor in the
  parameters' dtypes, and a fresh per-worker optimizer state initialised at
  them (``tx.init``), except its integer leaves (step counters such as the
  inner optimizer's ``count``, which indexes the learning-rate schedule),
  which are worker 0's, so the schedule continues at the run's step;
  fault counters at zero;
* the global batch (``batch_size``) stays and is split over the new worker
  count (``validate_config`` refuses a count that does not divide it).

The data order of a worker is a function of the seed, the input position
and the worker count, so after the resume each worker reads its share of
the new partition of the data from the same position.
"""

from typing import Any

import jax
import jax.numpy as jnp


def _span(lo: int, hi: int) -> str:
  """``'worker 3'`` or ``'workers 0-2'`` for ``range(lo, hi)``."""
  return f'worker {lo}' if hi - lo == 1 else f'workers {lo}-{hi - 1}'


def note(step: int, old: int, new: int, batch_size: int) -> str:
  """The line that reports an elastic resume."""
  keep = min(old, new)
  parts = [f'elastic resume at step {step}: {old} -> {new} workers',
           f'{_span(0, keep)} continue']
  if new > old:
    parts.append(f'{_span(old, new)} start from the anchor (fresh inner '
                 'state)')
  else:
    parts.append(f'{_span(new, old)} dropped (their steps since the last '
                 'sync are lost)')
  parts.append('anchor, outer state and counters carried over')
  parts.append(f'global batch {batch_size} = {new} x {batch_size // new} '
               'per worker')
  return '; '.join(parts)


def _grow(old: jax.Array, fresh: jax.Array, keep: int, new: int
          ) -> jax.Array:
  """The first ``keep`` workers of ``old``, then ``fresh`` for the rest."""
  kept = old[:keep]
  if new == keep:
    return kept
  extra = jnp.broadcast_to(fresh[None], (new - keep,) + fresh.shape)
  return jnp.concatenate([kept, extra.astype(kept.dtype)])


def _new_worker_state(tx, per_fields: dict[str, Any], anchor: Any,
                      params: Any) -> tuple[Any, dict[str, Any]]:
  """A new worker's parameters and per-worker state fields: fresh at the
  anchor, with worker 0's integer leaves (step counters)."""
  fresh_params = jax.tree.map(lambda a, p: a.astype(p.dtype), anchor,
                              jax.tree.map(lambda p: p[0], params))
  fresh = tx.init(fresh_params)._asdict()
  fields = {f: fresh[f] for f in per_fields}

  def counters_of_worker0(f, old):
    return old[0] if jnp.issubdtype(f.dtype, jnp.integer) else f

  return fresh_params, jax.tree.map(counters_of_worker0, fields, per_fields)


def resize(layout, shared: dict[str, Any], per_worker: dict[str, Any],
           saved_fields: tuple[str, ...], old: int, step: int
           ) -> tuple[dict[str, Any], str]:
  """The train state for ``layout.workers`` workers from a checkpoint of
  ``old`` workers (see the module docstring).

  Args:
    layout: the new run's ``loc_opt.train.layout.StateLayout``.
    shared: the restored shared tree (shared fields without worker axis).
    per_worker: the restored per-worker tree, leading size ``old``.
    saved_fields: the shared fields the checkpoint stored once.
    old: the checkpoint's worker count.
    step: the checkpoint's step (for the note).

  Returns:
    ``(state, note)``: the state laid out like ``layout.abstract_state``,
    and the line that reports what happened.

  Raises:
    ValueError: if the method is not elastic or the checkpoint stores no
      shared anchor.
  """
  method, new = layout.method, layout.workers
  if not method.elastic or 'anchor' not in saved_fields:
    raise ValueError(
        f'the checkpoint has {old} workers and this run {new}: only methods '
        'with a shared anchor (Method.elastic) can change their worker '
        f'count, and the checkpoint stores {list(saved_fields)} once')
  keep = min(old, new)
  abstract = layout.abstract_state
  shardings = jax.tree.map(lambda x: x.sharding, abstract)

  def build(shared_opt, per):
    fresh_params, fresh_fields = _new_worker_state(
        layout.tx, per['opt_state'], shared_opt['anchor'], per['params'])
    params = jax.tree.map(lambda o, f: _grow(o, f, keep, new),
                          per['params'], fresh_params)
    fields = jax.tree.map(lambda o, f: _grow(o, f, keep, new),
                          per['opt_state'], fresh_fields)
    faults = jax.tree.map(lambda o: _grow(o, jnp.zeros_like(o[0]), keep, new),
                          per['faults'])
    shared_b = jax.tree.map(
        lambda x: jnp.broadcast_to(x[None], (new,) + x.shape), shared_opt)
    opt = type(abstract['opt_state'])(**shared_b, **fields)
    return params, opt, faults

  params, opt, faults = jax.jit(
      build, out_shardings=(shardings['params'], shardings['opt_state'],
                            shardings['faults']))(shared['opt_state'],
                                                  per_worker)
  state = {'params': params, 'opt_state': opt, 'faults': faults,
           **{k: v for k, v in shared.items() if k != 'opt_state'}}
  return state, note(step, old, new, layout.batch_size)

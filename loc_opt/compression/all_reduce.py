r"""The compressed all-reduce: a gradient mean where only payloads cross.

:func:`build_compressor` assembles the pieces a config names (a compressor
or codec, an error feedback from :mod:`loc_opt.compression.feedback`, and
the leaves to compress, :func:`~loc_opt.compression.partition`);
:func:`compressed_all_reduce` runs the result as the first transformation of
an Optax chain, so that data-parallel workers average their gradients
through it. With classic error feedback (``error_feedback='ef'``):

.. math::

  p_w = g_w + e_w, \qquad \bar g = \operatorname{mean}_w C(p_w), \qquad
  e_w \leftarrow p_w - C(p_w),

and without it ``e_w = 0``.

This module sits above :mod:`~loc_opt.compression.compressor` and
:mod:`~loc_opt.compression.feedback`, which never import it.

References:
  Seide, Fu, Droppo, Li, Yu, *1-Bit Stochastic Gradient Descent and its
  Application to Data-Parallel Distributed Training of Speech DNNs*, 2014.
  Karimireddy, Rebjock, Stich, Jaggi, *Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes*, 2019.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loc_opt import _checks
from loc_opt.compression import comm as comm_lib
from loc_opt.compression import compressor as compressor_lib
from loc_opt.compression import feedback as feedback_lib
from loc_opt.compression import registry

Compressor = compressor_lib.Compressor
Eligible = compressor_lib.Eligible
Scheme = registry.Scheme


def build_compressor(
    scheme: Scheme,
    *,
    error_feedback: str = 'none',
    econtrol_eta: float = 0.1,
    ef_decay: float = 1.0,
    eligible: Eligible | None = None,
) -> Compressor:
  """``scheme`` wrapped in error feedback, applied to eligible leaves only.

  Args:
    scheme: a compressor, codec, registered name or ``(name, kwargs)``
      (see :func:`~loc_opt.compression.as_compressor`; ``None``: fp32
      mean).
    error_feedback: ``'none'``, ``'ef'``, ``'ef21'`` or ``'econtrol'``.
    econtrol_eta: EControl's feedback strength.
    ef_decay: the decay ``beta`` of classic error feedback,
      ``e <- beta (p - C(p))`` (1: the plain recursion).
    eligible: ``(path, leaf) -> bool``; other leaves take an fp32 mean and
      get no error buffer. ``None``: every leaf (see
      :func:`~loc_opt.compression.skip_paths` for names).

  Returns:
    The compressor.

  Example::

    scheme = build_compressor(compression.int8(), error_feedback='ef',
                              eligible=compression.min_size(1024))
  """
  scheme = registry.as_compressor(scheme)
  if scheme.feedback and error_feedback != 'none':
    raise ValueError(f'{scheme.name} keeps its own error feedback; use '
                     f'error_feedback=\'none\', not {error_feedback!r}')
  return compressor_lib.partition(
      feedback_lib.with_feedback(scheme, error_feedback, eta=econtrol_eta,
                                 decay=ef_decay),
      eligible)


class CompressedAllReduceState(NamedTuple):
  """State of :func:`compressed_all_reduce`.

  Attributes:
    count: int32 scalar, calls so far.
    compressor: the compressor's per-worker state (e.g. error buffers).
  """

  count: jax.Array  # int32 []
  compressor: Any


def compressed_all_reduce(
    scheme: Scheme,
    axis_name: str = 'worker',
    *,
    error_feedback: str = 'none',
    econtrol_eta: float = 0.1,
    ef_decay: float = 1.0,
    eligible: Eligible | None = None,
    start_step: int = 0,
    seed: int = 0,
    spread_over=comm_lib.INNER_AXES,
) -> optax.GradientTransformation:
  r"""Averages gradients over workers through a compression scheme.

  Put it first in a chain, before the optimizer, to train data-parallel with
  compressed gradients: every worker computes its own gradient (the step runs
  per worker under ``jax.shard_map`` or ``jax.vmap`` over ``axis_name``),
  and only the compressed payloads cross workers::

    tx = optax.chain(
        compressed_all_reduce(compression.int8(), 'worker',
                              error_feedback='ef'),
        optax.adamw(1e-3))

  Args:
    scheme: a :class:`~loc_opt.compression.Compressor`, codec, registered
      name (``'int8'``) or ``(name, kwargs)``.
    axis_name: the worker axis.
    error_feedback: ``'none'``, ``'ef'`` (Seide et al. 2014; Karimireddy et
      al. 2019), ``'ef21'`` (Richtárik et al. 2021) or ``'econtrol'`` (Gao et
      al. 2023); see :mod:`loc_opt.compression.feedback`.
    econtrol_eta: EControl's feedback strength.
    ef_decay: classic error feedback's decay (``'ef'`` only).
    eligible: leaves to compress (``(path, leaf) -> bool``); the rest are
      averaged in fp32 and get no error-feedback state. ``None``: all.
    start_step: steps before this one use the plain fp32 mean (PowerSGD and
      DGC start compressing after a warmup).
    seed: seed of the keys shared by all workers (random-k masks, PowerSGD's
      first query); per-worker draws fold in the worker index.
    spread_over: within-worker mesh axes over which payloads are spread.

  Returns:
    A gradient transformation whose output is the mean gradient, identical on
    all workers, in the gradients' dtypes.
  """
  compressor = build_compressor(scheme, error_feedback=error_feedback,
                                econtrol_eta=econtrol_eta, ef_decay=ef_decay,
                                eligible=eligible)
  comm = comm_lib.Comm(axis_name, spread_over)
  _checks.nonnegative_int(start_step, 'start_step')

  def init_fn(params):
    return CompressedAllReduceState(
        count=jnp.zeros([], jnp.int32), compressor=compressor.init(params))

  def update_fn(updates, state, params=None):
    del params
    key = jax.random.fold_in(jax.random.key(seed), state.count)

    def compressed(_):
      mean, _, new = compressor.mean(updates, state.compressor, comm, key)
      return comm.varying((mean, new))

    def plain(_):
      return comm.varying(
          (compressor_lib.f32(comm.pmean(updates)), state.compressor))

    if start_step > 0:
      mean, new = jax.lax.cond(state.count < start_step, plain, compressed,
                               None)
    else:
      mean, new = compressed(None)
    mean = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, updates)
    return mean, CompressedAllReduceState(
        optax.safe_increment(state.count), new)

  return optax.GradientTransformation(init_fn, update_fn)


def compressed_mean(tree: Any, scheme: Scheme, axis_name: str, *,
                    key: jax.Array | None = None,
                    spread_over=comm_lib.INNER_AXES,
                    bucket_size: int | None = None) -> Any:
  """One stateless mean of ``tree`` over ``axis_name`` through ``scheme``.

  For schemes with state (error feedback, PowerSGD warm starts) use
  :func:`compressed_all_reduce` or ``loc_opt.diloco(..., codec=...)``, which
  carry it across steps; here any state starts fresh and is dropped.

  Args:
    tree: this worker's pytree of float arrays.
    scheme: a compressor, codec, registered name or ``(name, kwargs)``;
      ``None`` is the fp32 mean.
    axis_name: the worker axis.
    key: PRNG key identical on all workers (default: ``key(0)``).
    spread_over: within-worker mesh axes to spread payloads over.
    bucket_size: fp32 (``None`` scheme): the most elements packed into one
      flat buffer (see ``Comm.pmean_buckets``); ``None``: the default.

  Returns:
    The mean, same structure, shapes and dtypes, identical on all workers.
  """
  compressor = registry.as_compressor(scheme)
  comm = comm_lib.Comm(axis_name, spread_over, bucket_size)
  key = jax.random.key(0) if key is None else key
  mean, _, _ = compressor.mean(tree, compressor.init(tree), comm, key)
  return jax.tree.map(lambda m, x: m.astype(jnp.result_type(x)), mean, tree)

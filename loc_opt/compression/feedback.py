"""Error feedback around any compressor: EF, EF21 and EControl.

Biased compressors (top-k, round-to-nearest, low rank) lose the part of each
message they drop. Error feedback keeps that part per worker and sends it
later, so nothing is lost over time. Each wrapper here takes any
:class:`~loc_opt.compression.compressor.Compressor` and returns one, with its
buffers (float32, one per leaf) in the state.

References:
  Seide, Fu, Droppo, Li, Yu, *1-Bit Stochastic Gradient Descent and its
  Application to Data-Parallel Distributed Training of Speech DNNs*, 2014.
  Karimireddy, Rebjock, Stich, Jaggi, *Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes*, 2019.
  Richtárik, Sokolov, Fatkhullin, *EF21: A New, Simpler, Theoretically Better,
  and Practically Faster Error Feedback*, 2021.
  Gao, Islamov, Stich, *EControl: Fast Distributed Optimization with
  Compression and Error Control*, 2023.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loc_opt import _checks
from loc_opt.compression import compressor as compressor_lib

Compressor = compressor_lib.Compressor


def _zeros(tree):
  return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def _add(a, b):
  return jax.tree.map(lambda x, y: x + y, a, b)


def _sub(a, b):
  return jax.tree.map(lambda x, y: x - y, a, b)


class ErrorFeedbackState(NamedTuple):
  """State of :func:`error_feedback`.

  Attributes:
    inner: the wrapped compressor's state.
    error: float32 tree like the input, what was not sent yet.
  """

  inner: Any
  error: Any


def error_feedback(compressor: Compressor, decay: float = 1.0) -> Compressor:
  r"""Classic error feedback, with an optional decay of the error.

  .. math::

    p = g + e, \quad \text{send } C(p), \quad
    e \leftarrow \beta \, (p - C(p)).

  With ``decay = 1`` (``beta``, the default) the invariant
  ``e_old + g == transmitted + e_new`` holds exactly (up to float rounding
  of one subtraction). A decay below 1 forgets old errors geometrically;
  it is MuLoCo's accumulator ``e <- beta e + Delta; e <- e - Q(e)`` written
  with the decay applied when the residual is stored (the paper's sweeps
  use ``beta = 0.9``).

  Args:
    compressor: the compressor to wrap.
    decay: ``beta`` in ``[0, 1]``; 0 is no error feedback (but keeps the
      buffer).

  Returns:
    The compressor.

  References:
    Thérien et al., *MuLoCo: Muon is a practical inner optimizer for
    DiLoCo*, 2025 (the decay).
  """
  decay = _checks.in_interval(decay, 'error feedback decay', 0, 1)

  def init(tree):
    return ErrorFeedbackState(compressor.init(tree), _zeros(tree))

  def mean(tree, state, comm, key):
    p = _add(compressor_lib.f32(tree), state.error)
    avg, sent, inner = compressor.mean(p, state.inner, comm, key)
    error = _sub(p, sent)
    if decay != 1.0:
      error = jax.tree.map(lambda e: decay * e, error)
    return avg, sent, ErrorFeedbackState(inner, error)

  name = 'ef' if decay == 1.0 else f'ef{decay:g}'
  return Compressor(f'{name}({compressor.name})', init, mean,
                    compressor.payload_bytes, True)


class EF21State(NamedTuple):
  """State of :func:`ef21` (and :func:`econtrol` without ``error``).

  Attributes:
    inner: the wrapped compressor's state.
    local: float32 tree, this worker's gradient estimate ``h_i``.
    shared: float32 tree, the mean estimate ``h``, identical on all workers.
  """

  inner: Any
  local: Any
  shared: Any


def ef21(compressor: Compressor) -> Compressor:
  r"""EF21: send the compressed change of a per-worker gradient estimate.

  .. math::

    c_i = C(g_i - h_i), \quad h_i \leftarrow h_i + c_i, \quad
    h \leftarrow h + \operatorname{mean}_i c_i,

  and the result is ``h``. Estimates start at zero, so the first step sends
  ``C(g)``. ``h`` is updated from the averaged messages only, so it stays
  identical on all workers.
  """

  def init(tree):
    return EF21State(compressor.init(tree), _zeros(tree), _zeros(tree))

  def mean(tree, state, comm, key):
    diff = _sub(compressor_lib.f32(tree), state.local)
    avg, sent, inner = compressor.mean(diff, state.inner, comm, key)
    shared = _add(state.shared, avg)
    return shared, sent, EF21State(inner, _add(state.local, sent), shared)

  return Compressor(f'ef21({compressor.name})', init, mean,
                    compressor.payload_bytes, True)


class EControlState(NamedTuple):
  """State of :func:`econtrol`.

  Attributes:
    inner: the wrapped compressor's state.
    error: float32 tree, the error ``e_i``.
    local: float32 tree, this worker's estimate ``h_i``.
    shared: float32 tree, the mean estimate ``h`` (identical everywhere).
  """

  inner: Any
  error: Any
  local: Any
  shared: Any


def econtrol(compressor: Compressor, eta: float = 0.1) -> Compressor:
  r"""EControl: error feedback with a controlled error term.

  .. math::

    \Delta_i = C(\eta e_i + g_i - h_i), \quad
    e_i \leftarrow e_i + g_i - h_i - \Delta_i, \quad
    h_i \leftarrow h_i + \Delta_i, \quad
    h \leftarrow h + \operatorname{mean}_i \Delta_i,

  returning ``h``. With ``eta = 0`` this is :func:`ef21`. The paper's theory
  uses ``eta`` about ``delta / 400`` for a ``delta``-contractive compressor;
  in practice it is tuned.

  Args:
    compressor: a contractive compressor (e.g. top-k).
    eta: feedback strength in ``[0, 1]``.

  Returns:
    The compressor.
  """
  _checks.in_interval(eta, 'econtrol eta', 0, 1)

  def init(tree):
    z = _zeros(tree)
    return EControlState(compressor.init(tree), z, z, z)

  def mean(tree, state, comm, key):
    g = compressor_lib.f32(tree)
    resid = _sub(g, state.local)
    msg = jax.tree.map(lambda e, r: eta * e + r, state.error, resid)
    avg, sent, inner = compressor.mean(msg, state.inner, comm, key)
    error = jax.tree.map(lambda e, r, s: e + r - s, state.error, resid, sent)
    shared = _add(state.shared, avg)
    return shared, sent, EControlState(inner, error, _add(state.local, sent),
                                       shared)

  return Compressor(f'econtrol({compressor.name})', init, mean,
                    compressor.payload_bytes, True)


# name -> (compressor, econtrol eta, ef decay) -> compressor
FEEDBACK = {
    'none': lambda compressor, eta, decay: compressor,
    'ef': lambda compressor, eta, decay: error_feedback(compressor, decay),
    'ef21': lambda compressor, eta, decay: ef21(compressor),
    'econtrol': lambda compressor, eta, decay: econtrol(compressor, eta),
}


def with_feedback(compressor: Compressor, mode: str, *,
                  eta: float = 0.1, decay: float = 1.0) -> Compressor:
  """Wraps ``compressor`` in the error feedback named ``mode`` (``eta``:
  EControl's strength; ``decay``: classic EF's error decay)."""
  if decay != 1.0 and mode != 'ef':
    raise ValueError(f'an error-feedback decay ({decay}) applies to '
                     f"error_feedback='ef' only, not {mode!r}")
  return FEEDBACK[_checks.one_of(mode, 'error feedback', FEEDBACK)](
      compressor, eta, decay)

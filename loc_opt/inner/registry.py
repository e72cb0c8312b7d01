"""Inner (per-worker) optimizers by name.

Each entry maps a name to a factory ``(learning_rate, **hyperparams) ->
GradientTransformation``. :func:`make_optimizer` adds global-norm gradient
clipping (before the optimizer) and ``optax.inject_hyperparams`` so the
learning rate is visible in the state for logging.
"""

from collections.abc import Callable, Mapping
from typing import Any

import optax

from loc_opt import _checks
# Each algorithm's module is shadowed in `loc_opt.inner` by the function of
# the same name, so the functions are imported from the modules.
from loc_opt.inner.dion import dion
from loc_opt.inner.drop_muon import drop_muon
from loc_opt.inner.fira import fira
from loc_opt.inner.frugal import frugal
from loc_opt.inner.multi_timescale import multi_timescale_adam
from loc_opt.inner.muon_adamw import muon_adamw
from loc_opt.inner.spam import spam
from loc_opt.inner.stable_spam import stable_spam
from loc_opt.inner.swan import swan
from loc_opt.schedules import schedule_free as _schedule_free

def _momentum(learning_rate: optax.ScalarOrSchedule,
              momentum: float = 0.9, nesterov: bool = False
              ) -> optax.GradientTransformation:
  """SGD with heavy-ball (or Nesterov) momentum, 0.9 by default."""
  return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)


OPTIMIZERS: Mapping[str, Callable[..., optax.GradientTransformation]] = {
    'sgd': optax.sgd,
    'momentum': _momentum,
    'adam': optax.adam,
    'adamw': optax.adamw,
    'lion': optax.lion,
    'adafactor': optax.adafactor,
    'spam': spam,
    'stable_spam': stable_spam,
    'swan': swan,
    'frugal': frugal,
    'fira': fira,
    'dion': dion,
    'drop_muon': drop_muon,
    # MuLoCo's inner optimizer: Muon on hidden matrices, AdamW (its own
    # learning rate) on embeddings, head and norms, chosen by path.
    'muon_adamw': muon_adamw,
    # MT-DAO's inner optimizer (slow momenta mixed with the gradient).
    'multi_timescale_adam': multi_timescale_adam,
    # Schedule-free (evaluate at loc_opt.schedules.schedule_free_eval_params).
    'schedule_free_adamw': _schedule_free.schedule_free_adamw,
    'schedule_free_sgd': _schedule_free.schedule_free_sgd,
}


# Integer arguments that set state shapes: `inject_hyperparams` must leave
# them static rather than turn them into traced hyperparameters.
STATIC_ARGS: Mapping[str, tuple[str, ...]] = {
    'adafactor': ('min_dim_size_to_factor',),
    'spam': ('density',),
    'frugal': ('rank', 'density'),
    'fira': ('rank',),
    'dion': ('rank', 'rank_fraction'),
    # Tuples: one entry per slow momentum (their count sets state shapes).
    'multi_timescale_adam': ('slow_betas', 'slow_weights'),
    'muon_adamw': ('ns_steps', 'ns_coeffs', 'nesterov', 'width_scale'),
}


def make_optimizer(
    name: str,
    learning_rate: float | optax.Schedule,
    *,
    grad_clip_norm: float | None = None,
    **hyperparams: Any,
) -> optax.GradientTransformation:
  """Builds the inner optimizer ``name`` from :data:`OPTIMIZERS`.

  Args:
    name: a key of :data:`OPTIMIZERS`.
    learning_rate: a float or a schedule.
    grad_clip_norm: clip gradients to this global norm first (None: off).
    **hyperparams: passed to the factory (e.g. ``b2=0.95``,
      ``weight_decay=0.1``).

  Returns:
    ``optax.chain(clip, inject_hyperparams(factory)(learning_rate, ...))``.

  Raises:
    ValueError: for an unknown name or a non-positive clip norm.
  """
  if name not in OPTIMIZERS:
    raise ValueError(f'unknown optimizer {name!r} (field optimizer.name); '
                     f'choose one of {sorted(OPTIMIZERS)}')
  try:
    tx = optax.inject_hyperparams(
        OPTIMIZERS[name], static_args=STATIC_ARGS.get(name, ()))(
            learning_rate=learning_rate, **hyperparams)
  except TypeError as e:
    raise ValueError(f'bad hyperparameters for optimizer {name!r}: {e}') from e
  if grad_clip_norm is None or grad_clip_norm == 0:
    return tx
  _checks.positive_float(grad_clip_norm, 'optimizer.grad_clip_norm')
  return optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)

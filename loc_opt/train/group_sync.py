"""A parameter group (a router) on a sync period of its own, in the trainer
(``outer.method='group_diloco'``).

The section ``outer.group_diloco`` (see ``configs/diloco_lm.py``) names
the group's leaves (``pattern``, by default a Mixture-of-Experts LM's
routers), its period ``sync_every`` (``H_g``) and its outer step
(``learning_rate``, ``momentum``: Nesterov SGD, plain SGD at momentum 0);
the other parameters sync every ``outer.sync_every`` steps with the shared
outer optimizer (``outer.learning_rate``, ``momentum``, ``nesterov``).
Each phase (``('group',)``, ``('main',)``, both) is its own compiled
program, so a group sync moves the group's bytes only.
"""

import re
from typing import Any

import ml_collections
import optax

from loc_opt import _checks
from loc_opt import outer as outer_lib
from loc_opt import parallel
from loc_opt.outer.group_diloco import group_diloco
from loc_opt.train import config as cfg_lib
from loc_opt.train.method import Method

SECTION = 'group_diloco'


def _field(config: ml_collections.ConfigDict, name: str) -> Any:
  return cfg_lib.required(config, SECTION, name)


def periods(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """``(H, H_g)``: ``outer.sync_every`` and the group's period."""
  return (cfg_lib.sync_every(config),
          _checks.positive_int(_field(config, 'sync_every'),
                               f'outer.{SECTION}.sync_every'))


def pattern(config: ml_collections.ConfigDict) -> str:
  """The group's leaf-path expression, checked to compile."""
  value = _field(config, 'pattern')
  try:
    re.compile(value)
  except (re.error, TypeError) as e:
    raise ValueError(f'outer.{SECTION}.pattern={value!r} is not a regular '
                     f'expression: {e}') from e
  return value


def group_outer(config: ml_collections.ConfigDict
                ) -> optax.GradientTransformation:
  """The group's outer optimizer."""
  lr = cfg_lib.learning_rate(_field(config, 'learning_rate'),
                             f'outer.{SECTION}.learning_rate')
  mu = cfg_lib.momentum(_field(config, 'momentum'),
                        f'outer.{SECTION}.momentum')
  return outer_lib.nesterov_outer(lr, mu) if mu else optax.sgd(lr)


def library_kwargs(config: ml_collections.ConfigDict
                   ) -> dict[Any, dict[str, Any]]:
  """The section's ``pattern`` as :func:`loc_opt.outer.group_diloco`'s."""
  return {group_diloco: {'pattern': pattern(config)}}


def plan(config: ml_collections.ConfigDict) -> outer_lib.Plan:
  """The run's phases (:func:`loc_opt.outer.group_diloco.group_diloco_plan`)."""
  pattern(config)
  group_outer(config)
  return outer_lib.group_diloco_plan(*periods(config))


def build(config: ml_collections.ConfigDict,
          inner: optax.GradientTransformation, axis_name: str
          ) -> optax.GradientTransformationExtraArgs:
  """The transform of ``outer.method='group_diloco'``."""
  h, h_group = periods(config)
  return cfg_lib.checked(
      f'outer.{SECTION}', group_diloco, inner, sync_every=h,
      group_sync_every=h_group, pattern=pattern(config),
      outer=cfg_lib.outer_optimizer(config), group_outer=group_outer(config),
      axis_name=axis_name, reduce_fn=parallel.worker_mean(axis_name))


def eval_params(opt_state, params):
  """The anchor (each part as of its last sync)."""
  return outer_lib.group_diloco_eval_params(opt_state, params)


# The registry's entry (loc_opt.train.registry.METHODS['group_diloco']).
METHOD = Method(
    per_worker=True, build=build, plan=plan, eval_params=eval_params,
    section=SECTION, library_kwargs=library_kwargs,
    shared_fields=('anchor', 'outer_state', 'count', 'num_syncs'))

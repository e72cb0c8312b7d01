"""Hierarchical DiLoCo in the trainer (``outer.method='hierarchical_diloco'``).

The section ``outer.hierarchical_diloco`` (see ``configs/diloco_lm.py``)
splits the ``mesh.workers`` workers into groups of ``group_size``; groups
sync every ``outer.sync_every`` steps (H1) with the shared outer optimizer
(``outer.learning_rate``, ``momentum``, ``nesterov``), and every
``global_period x H1`` steps (H2) the groups merge with the global outer
optimizer (``global_learning_rate``, ``global_momentum``; Nesterov when the
momentum is positive; the library's defaults, a plain merge, when absent),
through ``outer.codec``, exchanged by every worker (``global_exchange=
'all'``) or by one representative per group (``'representatives'``,
TreeLoCo). The group level may
send its pseudo-gradients through a codec of its own (``group_codec``,
``group_codec_kwargs``, ``group_error_feedback``, ``group_ef_decay``).

:func:`two_level_seconds` is the wall-clock model of such a machine: fast
links inside a group, slow ones between groups.

Reference: Kim et al., *HALoS: Hierarchical Asynchronous Local SGD over Slow
Networks for Geo-Distributed Large Language Model Training*, 2025.
"""

from collections.abc import Mapping
from typing import Any

import ml_collections
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt import outer as outer_lib
from loc_opt import parallel
from loc_opt.train import config as cfg_lib

SECTION = 'hierarchical_diloco'


def _field(config: ml_collections.ConfigDict, name: str) -> Any:
  return cfg_lib.required(config, SECTION, name)


def periods(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """``(H1, H2)``: ``outer.sync_every`` and ``global_period`` x it."""
  h1 = cfg_lib.sync_every(config)
  k = _field(config, 'global_period')
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f'outer.{SECTION}.global_period must be a positive '
                     f'int (global syncs every that many group syncs), '
                     f'got {k!r}')
  return h1, k * h1


def group_size(config: ml_collections.ConfigDict) -> int:
  """``group_size``, checked against ``mesh.workers``."""
  g = _field(config, 'group_size')
  m = config.mesh.workers
  if isinstance(g, bool) or not isinstance(g, int) or g < 1 or m % g:
    raise ValueError(f'outer.{SECTION}.group_size={g!r} must be a positive '
                     f'int dividing mesh.workers={m}')
  return g


def _group_codec(config: ml_collections.ConfigDict) -> Any:
  """``group_codec`` (with ``group_codec_kwargs``) as the library's
  ``group_codec``: ``None`` for ``'none'``, a name, or ``(name, kwargs)``."""
  s = cfg_lib.section(config, SECTION)
  field = f'outer.{SECTION}.group_codec'
  name = s.get('group_codec', 'none')
  kwargs = cfg_lib.plain(s.get('group_codec_kwargs') or {})
  if not isinstance(name, str):
    raise ValueError(f'{field} must be a codec name, got {name!r}')
  if not isinstance(kwargs, Mapping):
    raise ValueError(f"{field}_kwargs must be a dict of the codec's "
                     f'arguments, got {kwargs!r}')
  if name == 'none':
    if kwargs:
      raise ValueError(f'{field}_kwargs={kwargs!r} given, but {field} is '
                       "'none'")
    return None
  return (name, dict(kwargs)) if kwargs else name


def library_kwargs(config: ml_collections.ConfigDict
                   ) -> dict[Any, dict[str, Any]]:
  """The section's group-codec fields as arguments of
  :func:`loc_opt.outer.hierarchical_diloco` (absent fields: its
  defaults)."""
  s = cfg_lib.section(config, SECTION)
  kwargs = {'group_codec': _group_codec(config)}
  for name in ('group_error_feedback', 'group_ef_decay'):
    if name in s:
      kwargs[name] = s[name]
  return {outer_lib.hierarchical_diloco: kwargs}


def group_compressor(config: ml_collections.ConfigDict
                     ) -> compression.Compressor | None:
  """The group level's compressor (``None``: fp32), each bad field named."""
  kwargs = library_kwargs(config)[outer_lib.hierarchical_diloco]
  scheme = kwargs['group_codec']
  mode = _checks.one_of(kwargs.get('group_error_feedback', 'none'),
                        f'outer.{SECTION}.group_error_feedback',
                        compression.FEEDBACK)
  decay = _checks.in_interval(kwargs.get('group_ef_decay', 1.0),
                              f'outer.{SECTION}.group_ef_decay', 0, 1)
  if scheme is None and mode != 'none':
    raise ValueError(f'outer.{SECTION}.group_error_feedback={mode!r} needs '
                     f'a group codec (outer.{SECTION}.group_codec)')
  if decay != 1.0 and mode != 'ef':
    raise ValueError(f'outer.{SECTION}.group_ef_decay={decay} applies to '
                     f"group_error_feedback='ef' only, not {mode!r}")
  name = scheme[0] if isinstance(scheme, tuple) else scheme
  if name is not None and name not in {**compression.CODECS,
                                       **compression.COMPRESSORS}:
    compression.make_compressor(name, field=f'outer.{SECTION}.group_codec')
  if isinstance(scheme, tuple):
    cfg_lib.checked(f'outer.{SECTION}.group_codec_kwargs',
                    lambda: compression.as_compressor(scheme))
  return cfg_lib.checked(
      f'outer.{SECTION}.group_error_feedback',
      outer_lib.hierarchical.group_compressor, scheme, mode, decay)


def plan(config: ml_collections.ConfigDict) -> outer_lib.Plan:
  """The run's phases: ``False``, ``'group'``, ``'global'``."""
  group_size(config)
  group_compressor(config)
  return outer_lib.hierarchical_plan(*periods(config))


def global_outer(config: ml_collections.ConfigDict
                 ) -> optax.GradientTransformation:
  """The global outer optimizer of the section
  (:func:`loc_opt.outer.hierarchical.global_outer`; absent fields take the
  library's defaults, a plain merge)."""
  s = cfg_lib.section(config, SECTION)
  lib = outer_lib.hierarchical
  lr = cfg_lib.learning_rate(
      s.get('global_learning_rate', lib.GLOBAL_LEARNING_RATE),
      f'outer.{SECTION}.global_learning_rate')
  mu = cfg_lib.momentum(s.get('global_momentum', lib.GLOBAL_MOMENTUM),
                        f'outer.{SECTION}.global_momentum')
  return lib.global_outer(lr, mu)


def build(config: ml_collections.ConfigDict,
          inner: optax.GradientTransformation, axis_name: str
          ) -> optax.GradientTransformationExtraArgs:
  """The transform of ``outer.method='hierarchical_diloco'``."""
  h1, h2 = periods(config)
  return cfg_lib.checked(
      f'outer.{SECTION}', outer_lib.hierarchical_diloco, inner,
      sync_every=h1, global_sync_every=h2, group_size=group_size(config),
      group_outer=cfg_lib.outer_optimizer(config),
      outer=global_outer(config), axis_name=axis_name,
      codec=cfg_lib.make_compressor(config),
      group_codec=group_compressor(config),
      global_exchange=cfg_lib.section(config, SECTION).get(
          'global_exchange', 'all'))


def two_level_seconds(report: parallel.CollectiveReport, group_size: int,
                      fast: parallel.Link, slow: parallel.Link) -> float:
  """Seconds a step's unconditional cross-worker collectives take when
  workers of a group (``group_size`` consecutive ones) share ``fast`` links
  and groups are joined by ``slow`` ones.

  Each collective is costed as :func:`loc_opt.parallel.collective_seconds`
  over the workers it joins, on the slow link if it joins two groups, else
  on the fast link; collectives run one after another.
  """
  total = 0.0
  for c in report.collectives:
    if not c.cross_worker or c.branch is not None:
      continue
    members = max(len(g) for g in c.worker_groups)
    link = slow if c.crosses_groups(group_size) else fast
    total += parallel.collective_seconds(
        c.kind, c.total_bytes / report.num_workers, members, link)
  return total

r"""Runs and models made from saved checkpoints: WSD(-S) branches and WSM.

Two ways of getting a decayed model out of a run at a constant (or
WSD-S) learning rate without redoing it:

* **Branch a decay** (WSD, WSD-S): :func:`branch_and_evaluate` starts a new
  run from another run's checkpoint -- parameters, optimizer state with its
  count, step, RNG and input position -- with a different learning-rate
  schedule, and trains it to its own ``num_steps``. The schedule is read in
  the main run's count numbering, so for the budget ``b`` with a decay of
  ``D`` steps the branch config is the main config with ``num_steps = b`` and
  ``optimizer.schedule = 'wsd'`` (``decay_steps = D``) for a plain WSD main
  run, or ``'wsds'`` with ``decay_points`` ending at ``b`` for a WSD-S one,
  branched from the main run's checkpoint at ``b - D``
  (``loc_opt.schedules.wsds_branch`` gives that step).
* **Merge checkpoints** (WSM): :func:`merge_and_evaluate` averages the
  evaluation weights of saved checkpoints with coefficients from
  ``loc_opt.schedules.wsm_coefficients`` and evaluates the result.

Under DiLoCo (and local SGD) the evaluation weights are the anchor, so a WSM
merge averages anchors; data-parallel runs merge their parameters, and a
schedule-free run its averaged iterates ``x``.

References:
  Hägele, Bakouch, Kosson, Ben Allal, Von Werra, Jaggi, *Scaling Laws and
  Compute-Optimal Training Beyond Fixed Training Durations*, 2024.

  Wen, Li, Wang, Hall, Liang, Ma, *Understanding Warmup-Stable-Decay Learning
  Rates: A River Valley Loss Landscape Perspective*, 2024.

  Tian et al., *WSM: Decay-Free Learning Rate Schedule via Checkpoint
  Merging for LLM Pre-training*, 2025.
"""

from collections.abc import Sequence
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from loc_opt import schedules
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import loop


def branch_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    from_workdir: str | os.PathLike,
    from_step: int,
) -> dict[str, Any]:
  """Trains a branch of another run from its checkpoint at ``from_step``.

  ``config`` is the branch's config: the main run's, with a new
  learning-rate schedule (and sync schedule) and its own ``num_steps``. The
  branch resumes the main run's exact state, so a branch whose schedule
  equals the main run's up to ``from_step`` ends bit for bit where a single
  run with the branch's schedule would (on CPU). If ``workdir`` already
  holds a checkpoint (an interrupted branch), the branch resumes from it.

  Args:
    config: the branch config (``init_from`` is set from the arguments).
    workdir: the branch's workdir.
    from_workdir: the main run's workdir.
    from_step: a checkpoint step of the main run, below
      ``config.num_steps``.

  Returns:
    The summary of :func:`loc_opt.train.train_and_evaluate`
    (``final_eval_loss`` is the decayed model's loss).

  Raises:
    ValueError: for a bad config field.
    CheckpointError: if the main run has no checkpoint at ``from_step`` or
      was trained with a different model, mesh, data, method or optimizer.

  Example:
    >>> start, _ = loc_opt.schedules.wsds_branch(3e-3, (), 0.2, 400)
    >>> branch = main_config.copy_and_resolve_references()
    >>> branch.num_steps = 400
    >>> branch.optimizer.schedule = 'wsd'
    >>> branch.optimizer.schedule_kwargs = {'decay_steps': 400 - start}
    >>> branch_and_evaluate(branch, 'wd/b400', from_workdir='wd/main',
    ...                     from_step=start)['final_eval_loss']
  """
  config = ml_collections.ConfigDict(config.to_dict())
  config.init_from = ml_collections.ConfigDict(
      {'workdir': os.fspath(from_workdir), 'step': from_step})
  return loop.train_and_evaluate(config, workdir)


def _check_merge(steps: Sequence[int], coefficients: Any):
  steps = list(steps)
  if not steps:
    raise ValueError('steps must name at least one checkpoint')
  for s in steps:
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
      raise ValueError(f'steps must be checkpoint steps (ints >= 0), got '
                       f'{steps}')
  if len(set(steps)) != len(steps):
    raise ValueError(f'steps has a repeated step: {steps}')
  c = np.asarray(coefficients, np.float64)
  if c.shape != (len(steps),):
    raise ValueError(f'got {len(steps)} steps but coefficients of shape '
                     f'{c.shape}')
  if not np.all(np.isfinite(c)) or np.any(c < 0):
    raise ValueError(f'coefficients must be finite and >= 0, got '
                     f'{c.tolist()}')
  if abs(c.sum() - 1.0) > 1e-6:
    raise ValueError(f'coefficients must sum to 1 (a weighted average), got '
                     f'sum {c.sum()!r}')
  return [int(s) for s in steps], c


def merge_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    steps: Sequence[int],
    coefficients: Any,
) -> dict[str, Any]:
  r"""Merges saved checkpoints into one model and evaluates it (WSM).

  .. math::

    \hat\theta = \sum_j c_j\, \theta^{eval}_{s_j}

  where :math:`\theta^{eval}_s` are the evaluation weights of the
  checkpoint after ``s`` steps (the anchor under DiLoCo, the schedule-free
  average for a schedule-free optimizer, the parameters otherwise), summed
  in fp32 (``loc_opt.schedules.accumulate_params``) and cast back. Nothing
  is written to ``workdir``.

  Args:
    config: the run's config (the checkpoints must have been written with
      it, up to run-control fields).
    workdir: the run's workdir; it must keep every checkpoint in ``steps``
      (set ``keep_checkpoints`` high enough).
    steps: checkpoint steps, oldest first, e.g.
      ``loc_opt.schedules.wsm_checkpoint_steps(end, k, interval)``.
    coefficients: one non-negative weight per step, summing to 1, e.g.
      ``loc_opt.schedules.wsm_coefficients(k, 'linear')``.

  Returns:
    A dict with ``'eval_loss'`` (a float), ``'steps'``, ``'coefficients'``
    and ``'params'``: the merged weights, laid out like the train state's
    params (with the worker axis for local-update methods).

  Raises:
    ValueError: for bad ``steps`` or ``coefficients``.
    CheckpointError: if a step has no checkpoint or the checkpoints were
      written with a different config.

  Example:
    >>> steps = loc_opt.schedules.wsm_checkpoint_steps(300, 4, 25)
    >>> merge_and_evaluate(config, 'wd/main', steps,
    ...                    loc_opt.schedules.wsm_coefficients(4, '1-sqrt'))
  """
  steps, c = _check_merge(steps, coefficients)
  exp = exp_lib.get_experiment(config)
  config_json = cfg_lib.config_to_json(config)
  ckpt = ckpt_lib.Checkpointer(workdir, every=0, read_only=True)
  try:
    missing = [s for s in steps if s not in ckpt.all_steps()]
    if missing:
      raise ckpt_lib.CheckpointError(
          f'no checkpoint at steps {missing} in {ckpt.dir}; saved steps: '
          f'{ckpt.all_steps()} (raise keep_checkpoints to keep a merge '
          'window)')
    acc, last = None, None
    for step, weight in zip(steps, c):
      _, state = ckpt.restore(exp.layout, config_json, step)
      last = exp.eval_params(state)
      acc = schedules.accumulate_params(acc, last, weight)
      del state
  finally:
    ckpt.close()
  merged = jax.device_put(optax.tree.cast_like(acc, last),
                          exp.shardings['params'])
  data = exp_lib.load_data(config)
  loss = exp.evaluate_params(
      merged, exp_lib.eval_batches(exp, data, config.eval_batches))
  return {'eval_loss': loss, 'steps': steps, 'coefficients': c.tolist(),
          'params': merged}

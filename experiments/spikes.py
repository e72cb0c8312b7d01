r"""Injected gradient spikes: AdamW vs SPAM vs Stable-SPAM.

Every run trains the same model on the same data for ``num_steps`` steps;
on ``--num_spikes`` seeded steps (``loc_opt.train.spike_steps``: one per
equal bin of 20%-80% of the run) the gradient is multiplied by
``--spike_scale`` before it reaches the optimizer (no global-norm clipping
in any run, so the spike is not hidden). A run of the first optimizer
without spikes is the reference.

Recovery (fixed before looking at results): for a spike applied by update
``k`` (0-based), the train loss logged at step ``s`` is the loss at the
parameters after ``s - 1`` updates, so step ``k + 2`` is the first one the
spike can affect. The pre-spike value is the mean train loss of the 10 steps
``k - 8 .. k + 1``. The run has recovered at the first step ``s >= k + 2``
whose forward 5-step mean train loss (steps ``s .. s + 4``) is within
``--tolerance`` (2%) of the pre-spike value; steps to recover is
``s - (k + 2)`` (0: the spike never pushed the loss out of that band), and
``> n`` if that did not happen before the next spike or the end of the run.
An Adam-type optimizer often does not jump in loss after a spike but stalls
(its second moment is inflated), which that measure does not see; so the
table also gives the steps until the forward 5-step mean is within the
same tolerance of the no-spike run's forward 5-step mean at the same steps
(same data order, so the curves are directly comparable).

Writes ``spikes.md``, ``spikes.json`` and ``spikes.png`` (train-loss curves
with the spikes marked) to ``--workdir``.

  python -m experiments.spikes --workdir=/tmp/spikes \
    [--config=configs/inner_schedules_lm.py]
"""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

from experiments import _runs
from experiments import _train_tables

_CONFIG = config_flags.DEFINE_config_file(
    'config', 'configs/inner_schedules_lm.py', 'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_OPTIMIZERS = flags.DEFINE_list('optimizers', ['adamw', 'spam', 'stable_spam'],
                                'Names in loc_opt.inner.OPTIMIZERS.')
_NUM_SPIKES = flags.DEFINE_integer('num_spikes', 3, 'Spikes per run.')
_SCALE = flags.DEFINE_float('spike_scale', 1000.0, 'Gradient multiplier.')
_SEED = flags.DEFINE_integer('spike_seed', 0, 'Seed of the spiked steps.')
_TOLERANCE = flags.DEFINE_float('tolerance', _train_tables.SPIKE_TOLERANCE,
                                'Recovery band around the pre-spike loss.')

# Per optimizer: config -> its arguments besides the learning-rate schedule.
# The same betas and decoupled weight decay as the config's AdamW (b1 0.9,
# b2 0.95, weight decay 0.1); everything else at the optimizer's defaults
# (SPAM: threshold 5000, reset interval 500, post-reset warmup 150, clip
# delay 20; Stable-SPAM: gamma 0.7 / 0.9 / 0.999, reset interval 1000),
# except that Stable-SPAM gets total_steps = the run's length, as its spec
# asks.
_ADAM_LIKE = {'b1': 0.9, 'b2': 0.95, 'weight_decay': 0.1}
KWARGS = {
    'adamw': lambda c: dict(_ADAM_LIKE),
    'spam': lambda c: dict(_ADAM_LIKE),
    'stable_spam': lambda c: dict(_ADAM_LIKE, total_steps=c.num_steps),
}


def _kwargs(name, config):
  return KWARGS[name](config) if name in KWARGS else {}


def recovery(train: dict[int, float], spikes: list[int], end: int,
             tolerance: float,
             reference: dict[int, float] | None = None) -> list[str]:
  """Steps to recover after each spike (see the module docstring).

  With ``reference`` (the no-spike run's train losses), the target is that
  run's forward 5-step mean at the same step instead of the pre-spike mean.
  """
  out = []
  for i, k in enumerate(spikes):
    pre = np.mean([train[s] for s in range(k - 8, k + 2)])
    horizon = spikes[i + 1] + 1 if i + 1 < len(spikes) else end
    found = None
    for s in range(k + 2, horizon - 3):
      target = pre if reference is None else np.mean(
          [reference[t] for t in range(s, s + 5)])
      if np.mean([train[t] for t in range(s, s + 5)]) <= (1 + tolerance) * \
          target:
        found = s - (k + 2)
        break
    out.append(str(found) if found is not None else
               f'> {horizon - 4 - (k + 2)}')
  return out


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from loc_opt import train  # pylint: disable=g-import-not-at-top

  _runs.require_optimizers(_OPTIMIZERS.value)
  wd = _WORKDIR.value
  base = _runs.variant(_CONFIG.value, log_every=1,
                       optimizer__grad_clip_norm=0.0)
  total = base.num_steps
  window = tuple(base.optimizer.spike_window)
  spikes = train.spike_steps(total, _NUM_SPIKES.value, seed=_SEED.value,
                             window=window)
  print(f'spiked updates (0-based counts): {spikes}', flush=True)

  runs = {}
  first = _OPTIMIZERS.value[0]
  runs[f'{first} (no spikes)'] = _runs.run(
      _runs.variant(base, optimizer__name=first,
                    optimizer__kwargs=_kwargs(first, base)),
      os.path.join(wd, f'{first}_no_spikes'), f'{first} (no spikes)')
  for name in _OPTIMIZERS.value:
    runs[name] = _runs.run(
        _runs.variant(base, optimizer__name=name,
                      optimizer__kwargs=_kwargs(name, base),
                      optimizer__spike_num=_NUM_SPIKES.value,
                      optimizer__spike_scale=_SCALE.value,
                      optimizer__spike_seed=_SEED.value),
        os.path.join(wd, name), name)

  reference = runs[f'{first} (no spikes)']['curve']['train']
  for name, r in runs.items():
    if 'no spikes' not in name:
      r['recovery'] = recovery(r['curve']['train'], spikes, total,
                               _TOLERANCE.value)
      r['recovery_vs_reference'] = recovery(
          r['curve']['train'], spikes, total, _TOLERANCE.value, reference)
  results = {'spikes': spikes, 'runs': runs,
             'kwargs': {n: _kwargs(n, base) for n in _OPTIMIZERS.value}}
  _runs.write(wd, 'spikes', _train_tables.spikes_main(
      _train_tables.as_written(results, _runs.RUNS, sys.argv)), results)
  _plot(os.path.join(wd, 'spikes.png'), runs, spikes)


def _plot(path, runs, spikes):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(10, 5))
  for name, r in runs.items():
    tr = r['curve']['train']
    steps = sorted(tr)
    # A 5-step running mean, so the curves are readable.
    smooth = np.convolve([tr[s] for s in steps], np.ones(5) / 5, mode='same')
    ax.plot(steps[2:-2], smooth[2:-2], label=name, linewidth=1.2)
  for k in spikes:
    ax.axvline(k + 1, color='grey', linestyle=':', linewidth=1)
  ax.set_xlabel('step')
  ax.set_ylabel('train loss (5-step mean)')
  ax.set_title('injected gradient spikes (dotted lines)')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f'wrote {path}')


if __name__ == '__main__':
  app.run(main)

r"""Decoupled DiLoCo against synchronous training, with stragglers and a
failure, on the reference LM.

Four learners; two run at 0.6x the speed of the others and learner 1 is
down for the middle third of the run (``configs/decoupled_diloco_lm.py``).
Every run takes the config's ``num_steps`` program steps:

* data parallel and synchronous Streaming DiLoCo (P = 2, tau = 1) wait for
  the slowest learner at every step or sync, so a step costs ``1 / 0.6``
  steps of the fastest learner's time; Streaming DiLoCo leaves the failed
  learner out of the syncs while it is down (``faults.drop_syncs``; its
  local steps then are discarded at each sync). Data parallel has no
  failure (a failed worker stops the job; with elasticity it would lose a
  quarter of the batch for a while): an optimistic baseline;
* Decoupled DiLoCo runs one program step per step of the fastest learner:
  the slow learners step on 60% of them, the failed learner on none while
  down, and nobody waits. Variants: quorum K = M (= 4), K = 1 without and
  with the grace window, and with K = 1 + grace: the plain weighted
  average instead of RDA, and uniform weights instead of tokens^2 / steps.

Reports final eval loss, tokens processed, simulated seconds (step time
``wallclock.step_time_s``; communication assumed hidden, as the overlap
allows at the default link), and the eval loss at equal simulated time and
at equal tokens (linear interpolation on each run's eval curve).

  python -m experiments.decoupled --workdir=/tmp/decoupled \
    [--runs=data_parallel,streaming,...] [--config.num_steps=300] \
    [--figure=docs/figures/decoupled.png]

Each run lives in its own directory under --workdir and resumes from its
checkpoints (a finished run is read back). Writes ``decoupled.md`` and
``decoupled.json`` to --workdir.
"""

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

from experiments import _fault_tables
from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file(
    'config', 'configs/decoupled_diloco_lm.py', 'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Parent of the run dirs.')
_RUNS = flags.DEFINE_list('runs', None, 'Subset of the runs (default: all).')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_FIGURE = flags.DEFINE_string(
    'figure', None, 'Also write eval loss against tokens and against '
    'simulated seconds to this PNG (needs matplotlib).')
flags.mark_flag_as_required('workdir')

_D = 'outer__decoupled_diloco__'
# name -> (label, overrides of the config)
RUNS = {
    'data_parallel': ('Data parallel (no failure)', {
        'outer__method': 'data_parallel', 'faults__failures': ()}),
    'streaming': ('Streaming DiLoCo, synchronous (P=2, tau=1)', {
        'outer__method': 'streaming_diloco', 'faults__failures': (),
        'outer__streaming_diloco__num_fragments': 2}),
    'k_all': ('Decoupled, K=M=4', {_D + 'quorum': 4, _D + 'grace': 0.0}),
    'k1': ('Decoupled, K=1, no grace', {_D + 'grace': 0.0}),
    'k1_grace': ('Decoupled, K=1 + grace (0.2)', {}),
    'k1_grace_average': ('Decoupled, K=1 + grace, plain average',
                         {_D + 'merge': 'average'}),
    'k1_grace_uniform': ('Decoupled, K=1 + grace, uniform weights',
                         {_D + 'weighting': 'uniform'}),
}


def _drop_syncs(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The synchronous runs' stand-in for the failure: the failed learner
  misses every sync while it is down."""
  from loc_opt.train import registry  # pylint: disable=g-import-not-at-top
  plan = registry.get_method(config.outer.method).plan(config)
  syncs = [t for t, ph in enumerate(plan.walk(0, config.num_steps))
           if plan.is_sync(ph)]
  drops, workers = [], set()
  for worker, start, steps in config.faults.failures:
    workers.add(int(worker))
    drops += [i for i, t in enumerate(syncs) if start <= t < start + steps]
  if not drops:
    return (), ()
  return tuple(sorted(set(drops))), tuple(sorted(workers))


def _clock(config, method: str):
  """``step -> (tokens, simulated seconds)`` of a run."""
  from loc_opt.train import registry  # pylint: disable=g-import-not-at-top
  from loc_opt.train import simulated_time  # pylint: disable=g-import-not-at-top
  dt = float(config.wallclock.step_time_s)
  tokens_per_row = config.data.seq_len
  if method == 'decoupled_diloco':
    timeline = registry.decoupled_timeline(config)
    rows = config.batch_size // config.mesh.workers
    steps = np.concatenate([[0], np.cumsum(timeline.active.sum(1))])
    return lambda t: (int(steps[t]) * rows * tokens_per_row, t * dt)
  slow = min(simulated_time.worker_speeds(config))
  return lambda t: (t * config.batch_size * tokens_per_row, t * dt / slow)


def _at(curve: dict[int, float], clock, x: float, index: int) -> float:
  """The eval loss where ``clock(step)[index]`` equals ``x``."""
  steps = sorted(curve)
  xs = [clock(s)[index] for s in steps]
  if x > xs[-1]:
    return float('nan')
  return float(np.interp(x, xs, [curve[s] for s in steps]))


def _summarize(summary, config, clock) -> dict:
  from loc_opt.train import registry  # pylint: disable=g-import-not-at-top
  out = {k: summary[k] for k in ('final_eval_loss', 'syncs', 'left_out',
                                 'cross_worker_bytes', 'curve')}
  tokens, seconds = clock(config.num_steps)
  out.update(tokens=tokens, seconds=seconds, merges=summary['syncs'],
             per_merge='')
  if config.outer.method == 'decoupled_diloco':
    timeline = registry.decoupled_timeline(config)
    out['per_merge'] = f'{timeline.summary()["mean_admitted"]:.2f}'
    out['timeline'] = timeline.summary()
  elif config.outer.method != 'data_parallel':
    out['per_merge'] = f'{config.mesh.workers - 1}-{config.mesh.workers}'
  return out


def _points(summary, clock) -> list[tuple[int, int, float, float]]:
  """``(step, tokens, simulated seconds, eval loss)`` of each evaluation."""
  curve = summary['curve']['eval']
  return [(int(t), *clock(int(t)), float(curve[t])) for t in sorted(curve)]


def _merge_bytes(config) -> dict[str, int]:
  """Bytes one learner sends per merge of each fragment, read from the
  compiled merge programs (``phase -> bytes`` of the run's experiment)."""
  from loc_opt.train import experiment as exp_lib  # pylint: disable=g-import-not-at-top
  exp = exp_lib.get_experiment(config)
  out = {}
  for p in range(config.outer.decoupled_diloco.num_fragments):
    total = exp.programs.bytes_per_step[(p, None)]
    out[f'fragment {p}'] = int(total / config.mesh.workers)
  out['inner step'] = int(exp.programs.bytes_per_step[False])
  out['data parallel step'] = int(
      exp_lib.data_parallel_bytes_per_step(config) / config.mesh.workers)
  return out


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  names = _runs.chosen(_RUNS.value, RUNS)
  config = _CONFIG.value
  results, clocks = {}, {}
  for name in names:
    label, overrides = RUNS[name]
    run_config = _runs.variant(config, **overrides)
    if run_config.outer.method == 'streaming_diloco':
      drops, workers = _drop_syncs(_runs.variant(
          run_config, faults__failures=config.faults.failures))
      run_config = _runs.variant(run_config, faults__drop_syncs=drops,
                                 faults__drop_workers=workers)
    summary = _runs.run(run_config, f'{_WORKDIR.value}/{name}', label)
    clocks[name] = _clock(run_config, run_config.outer.method)
    results[name] = _summarize(summary, run_config, clocks[name])
    results[name]['points'] = _points(summary, clocks[name])
  if 'k1_grace' in results:
    ref = results['k1_grace']
    for name, r in results.items():
      curve = {int(s): v for s, v in r['curve']['eval'].items()}
      r['loss_at_time'] = _at(curve, clocks[name], ref['seconds'], 1)
      r['loss_at_tokens'] = _at(curve, clocks[name], ref['tokens'], 0)
  merge_bytes = {}
  if config.outer.method == 'decoupled_diloco':
    merge_bytes = _merge_bytes(config)
  numbers = {'config': config.to_dict(), 'runs': results,
             'bytes_per_learner': merge_bytes}
  # What the results file will hold, as experiments.tables renders it.
  data = {'runs': _runs.RUNS, 'results': numbers}
  _runs.write(_WORKDIR.value, 'decoupled', _fault_tables.decoupled_main(data),
              numbers)
  if _FIGURE.value:
    _fault_tables.decoupled_figure(data, _FIGURE.value)
    print(f'wrote {_FIGURE.value}')


if __name__ == '__main__':
  app.run(main)

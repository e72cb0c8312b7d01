r"""Per-step time of a DiLoCo inner step vs a plain data-parallel step.

Both programs are compiled from the same config (model, optimizer, mesh,
batch); only ``outer.method`` differs. Steps are timed one at a time
(``block_until_ready``), alternating blocks of the two programs so that
machine noise hits both alike, and the medians are compared.

  python -m experiments.benchmark_step_time --config=configs/diloco_lm.py \
    [--steps=60] [--workdir=/tmp/step_time]
"""

import json
import statistics
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_STEPS = flags.DEFINE_integer('steps', 60, 'Timed steps per program.')
_BLOCK = flags.DEFINE_integer('block', 5, 'Steps per alternating block.')
_WORKDIR = flags.DEFINE_string(
    'workdir', '', 'Write the results file benchmark_step_time.json here.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8,
                                    'Virtual CPU devices.')


def time_steps(step_fn, state, batch, n):
  times = []
  for _ in range(n):
    t = time.perf_counter()
    state, loss = step_fn(state, batch)
    loss.block_until_ready()
    times.append(time.perf_counter() - t)
  return state, times


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from loc_opt import train  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  configs = {}
  for method in ('diloco', 'data_parallel'):
    c = ml_collections.ConfigDict(config.to_dict())
    c.outer.method = method
    configs[method] = c
  exps = {m: train.build_experiment(c) for m, c in configs.items()}
  rng = np.random.default_rng(0)
  m, b, t = config.mesh.workers, config.batch_size, config.data.seq_len
  tokens = rng.integers(0, 256, (m, b // m, t + 1), dtype=np.int32)
  batches = {'diloco': tokens, 'data_parallel': tokens.reshape(b, t + 1)}
  states = {k: e.init_state() for k, e in exps.items()}
  steps = {k: e.programs.steps[False] for k, e in exps.items()}
  for k in exps:  # warm up
    states[k], _ = time_steps(steps[k], states[k], batches[k], 3)
  times = {k: [] for k in exps}
  for _ in range(max(1, _STEPS.value // _BLOCK.value)):
    for k in exps:
      states[k], ts = time_steps(steps[k], states[k], batches[k],
                                 _BLOCK.value)
      times[k] += ts
  med = {k: statistics.median(v) for k, v in times.items()}
  result = {
      'median_step_s': med,
      'ratio_diloco_inner_over_dp': med['diloco'] / med['data_parallel'],
      'cross_worker_bytes_per_step': {
          k: e.programs.bytes_per_step[False] for k, e in exps.items()},
      'diloco_sync_step_bytes': exps['diloco'].programs.bytes_per_step[True],
      'steps_timed': len(times['diloco']),
      'devices': str(jax.devices()[0].platform) + f' x{jax.device_count()}',
      'num_params': exps['diloco'].model.num_params,
  }
  print(f'median step: DiLoCo inner {med["diloco"] * 1e3:.2f} ms, '
        f'data-parallel {med["data_parallel"] * 1e3:.2f} ms, ratio '
        f'{result["ratio_diloco_inner_over_dp"]:.3f} '
        f'({result["steps_timed"]} steps each)')
  print('cross-worker bytes per step: DiLoCo inner '
        f'{result["cross_worker_bytes_per_step"]["diloco"]}, data-parallel '
        f'{result["cross_worker_bytes_per_step"]["data_parallel"]}; DiLoCo '
        f'sync step {result["diloco_sync_step_bytes"]}')
  if _WORKDIR.value:
    _runs.write(_WORKDIR.value, 'benchmark_step_time',
                json.dumps(result, indent=2) + '\n', result)


if __name__ == '__main__':
  app.run(main)

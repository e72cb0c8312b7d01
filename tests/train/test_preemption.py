"""SIGTERM (a preemption notice) saves a checkpoint and exits cleanly."""

import json
import os
import pathlib
import signal
import sys
import time

import numpy as np

from loc_opt import train
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import preemption
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config
from tests.train._helpers import preempt_after_steps

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_STEPS = 200


def _cli(workdir, data_dir):
  overrides = {
      'num_steps': _STEPS, 'model.hidden': 64, 'data.seq_len': 32, 'batch_size': 16, 'data.eval_batch_size': 16,
      'eval_batches': 1, 'data.max_bytes': 300_000, 'outer.sync_every': 4,
      'checkpoint_every': 1000, 'log_every': 1, 'progress': False,
      'data.data_dir': data_dir}
  return ([sys.executable, '-m', 'experiments.train',
           '--config=configs/diloco_lm.py:mlp', f'--workdir={workdir}',
           '--cpu_devices=8']
          + [f'--config.{k}={v}' for k, v in overrides.items()])


def _config(data_dir):
  """The CLI's config (run-control fields may differ on resume)."""
  return tiny_config(data_dir, config_schedule=True, num_steps=_STEPS,
                     checkpoint_every=1000, log_every=50)


def test_sigterm_saves_exits_zero_and_resumes_bit_exactly(data_dir,
                                                          tmp_path):
  config = _config(data_dir)
  full = train.train_and_evaluate(config, tmp_path / 'full')  # builds data
  workdir = tmp_path / 'run'
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS='cpu')
  returncode, out, err = preempt_after_steps(_cli(workdir, data_dir), _ROOT,
                                             env, workdir, 3, 240)
  assert returncode == 0, err
  step = ckpt_lib.latest_step(workdir)
  assert step is not None and 3 <= step < _STEPS, (step, out)
  assert f'preempted: saved a checkpoint at step {step} ' in out, out
  assert 'Traceback' not in err, err
  records = [json.loads(l) for l in
             (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert records[-1]['step'] == step

  resumed = train.train_and_evaluate(config, workdir)
  assert resumed['finished'] and resumed['step'] == _STEPS
  # One config, one mesh: the CLI process and this one compile the same
  # programs on this machine, and the resume replays them: bit for bit.
  for a, b in zip(leaves(full['state']), leaves(resumed['state'])):
    np.testing.assert_array_equal(a, b)
  assert resumed['cross_worker_bytes'] == full['cross_worker_bytes']


def test_watch_without_distributed_uses_a_signal_flag():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.PreemptionWatch() as watch:
    assert not watch.reached(3) and not watch.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs between bytecodes
    assert watch.reached(4) and watch.reached(5)
    assert watch.step == 4
  assert signal.getsignal(signal.SIGTERM) is before

"""Multi-process runs: 2 processes x 4 CPU devices equal 1 process x 8.

Each run is ``python -m experiments.train`` in its own processes, joined by
``jax.distributed.initialize`` on localhost with gloo collectives. The
reference joins one process (8 devices) the same way, so that both runs use
the same collective implementation: with JAX's in-process CPU collectives
(no ``jax.distributed``) the all-reduces sum in another order and the
parameters agree only to about 1e-7. The two runs are still programs
compiled and run by different processes (per-process thread pools, which
may split a reduction differently), so they are compared to float32
rounding; on this project's CPUs they have agreed bit for bit.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from tests.train._helpers import assert_leaves_close
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
# 2 workers, one per process: each worker's devices lie in one process.
MESH = {'mesh.workers': 2, 'mesh.data': 4}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _flags(overrides: dict) -> list[str]:
  """``--config.<field>=<value>`` for each of the tiny config's fields
  that differ from ``configs/diloco_lm.py:mlp``, and ``overrides``."""
  fields = {
      'num_steps': 12, 'batch_size': 16, 'data.eval_batch_size': 16,
      'eval_batches': 1, 'eval_every': 6, 'log_every': 2,
      'checkpoint_every': 4, 'progress': False, 'model.hidden': 64,
      'data.seq_len': 32, 'data.max_bytes': 300_000,
      'outer.sync_every': 4}
  fields.update(overrides)
  return [f'--config.{k}={v}' for k, v in fields.items()]


def _launch(workdir, num_processes: int, overrides: dict):
  """Starts ``num_processes`` processes of one run; returns them."""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT))
  procs = []
  for i in range(num_processes):
    cmd = [sys.executable, '-m', 'experiments.train',
           f'--config={ROOT / "configs" / "diloco_lm.py"}:mlp',
           f'--workdir={workdir}', f'--cpu_devices={8 // num_processes}',
           f'--coordinator_address=localhost:{port}',
           f'--num_processes={num_processes}', f'--process_id={i}',
           *_flags(overrides)]
    procs.append(subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True))
  return procs


def _wait(procs) -> list[str]:
  """Waits for every process; kills them all if one fails or hangs."""
  outputs = []
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for p in procs:
      out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
      outputs.append(out)
      assert p.returncode == 0, f'process exited {p.returncode}:\n{out[-3000:]}'
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  return outputs


def _final_state(workdir, config):
  exp = exp_lib.get_experiment(config)
  ckpt = ckpt_lib.Checkpointer(workdir, every=0, read_only=True)
  try:
    _, restored = ckpt.restore(exp.layout, cfg_lib.config_to_json(config),
                               config.num_steps,
                               compare=lambda saved, current: [])
  finally:
    ckpt.close()
  return leaves(restored)


def _records(workdir):
  lines = (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()
  return [{k: v for k, v in json.loads(l).items() if k != 'perf/tokens_per_s'}
          for l in lines]


_SUMMARY_KEYS = ('step', 'finished', 'final_eval_loss', 'final_train_loss',
                 'cross_worker_bytes', 'syncs', 'bytes_per_phase',
                 'data_parallel_cross_worker_bytes')


def _assert_close(a, b, where):
  """JSON values equal, floats to float32 rounding (ints, strings exactly)."""
  if isinstance(a, dict):
    assert isinstance(b, dict) and sorted(a) == sorted(b), where
    for k in a:
      _assert_close(a[k], b[k], f'{where}.{k}')
  elif isinstance(a, list):
    assert isinstance(b, list) and len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b)):
      _assert_close(x, y, f'{where}[{i}]')
  elif isinstance(a, float) or isinstance(b, float):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=where)
  else:
    assert a == b, (where, a, b)


@pytest.mark.slow
def test_two_processes_streaming_int8_interrupted_and_resumed(data_dir,
                                                              tmp_path):
  """Streaming DiLoCo with int8 pseudo-gradients (every kind of phase:
  inner steps, fragment syncs, apply-only steps), the 2-process run halted
  after step 6 (last checkpoint at 4) and resumed by 2 new processes,
  equals an uninterrupted 1-process run bit for bit: the state, every
  metrics record and the summary. (One test covers both the plain
  2-vs-1-process equality and the resume: each launch compiles every
  program in every process, so it is the suite's costliest kind of run.)"""
  method = {'outer.method': 'streaming_diloco', 'outer.codec': 'int8',
            'outer.streaming_diloco.num_fragments': 2}
  config = tiny_config(data_dir, **MESH, **method)
  exp_lib.load_data(config)
  overrides = dict(MESH, **method, **{'data.data_dir': data_dir})
  one = _launch(tmp_path / 'one', 1, overrides)
  part = _launch(tmp_path / 'two', 2, dict(overrides, halt_after_steps=6))
  outputs = _wait(one + part)
  assert 'stopped at step 6' in outputs[1]
  assert ckpt_lib.latest_step(tmp_path / 'two') == 4
  outputs = _wait(_launch(tmp_path / 'two', 2, overrides))
  # Process 0 alone reports; the other process prints no summary.
  assert 'final eval loss' in outputs[0]
  assert 'final eval loss' not in outputs[1]

  # Two processes' programs against one's (see the module docstring):
  # float leaves to float32 rounding, integer leaves exactly.
  one_state = _final_state(tmp_path / 'one', config)
  assert_leaves_close(one_state, _final_state(tmp_path / 'two', config))
  _assert_close(_records(tmp_path / 'one'), _records(tmp_path / 'two'),
                'records')
  summaries = [json.loads((tmp_path / r / 'summary.json').read_text())
               for r in ('one', 'two')]
  for key in _SUMMARY_KEYS:
    _assert_close(summaries[0][key], summaries[1][key], key)
  # The training moved the state far more than the tolerance: the check
  # bites.
  init = leaves(exp_lib.get_experiment(config).init_state())
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(
      init, one_state, strict=True) if a.dtype.kind == 'f') > 1e-3
  plan = exp_lib.get_experiment(config).plan
  assert summaries[1]['syncs'] == plan.num_syncs(0, config.num_steps) > 2
  assert summaries[1]['finished']


@pytest.mark.parametrize('env,detected', [
    ({}, False),
    ({'SLURM_NTASKS': '1'}, False),
    ({'SLURM_NTASKS': '8'}, True),
    ({'OMPI_COMM_WORLD_SIZE': '4'}, True),
    ({'TPU_WORKER_HOSTNAMES': 'localhost'}, False),
    ({'TPU_WORKER_HOSTNAMES': 'h0,h1'}, True),
    ({'MEGASCALE_COORDINATOR_ADDRESS': 'h0:8080'}, True),
])
def test_cluster_detection(env, detected):
  from experiments import train  # pylint: disable=g-import-not-at-top
  assert train.cluster_detected(env) is detected

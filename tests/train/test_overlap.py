"""The trainer's overlapped programs (``outer.overlap='compiled'``)."""

import json

import jax
import numpy as np
import pytest

from loc_opt import parallel
from loc_opt import train
from loc_opt.parallel import overlap
from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from tests.train._helpers import leaves
from tests.train._helpers import tiny_config

STREAMING = {'outer.method': 'streaming_diloco',
             'outer.streaming_diloco.num_fragments': 2,
             'outer.streaming_diloco.overlap': 1, 'outer.overlap': 'compiled',
             'num_steps': 4, 'eval_every': 4, 'checkpoint_every': 4}
# The gradient computation's matmuls (forward and backward).
MATMULS = ('dot', 'convolution')


@pytest.mark.slow
def test_streaming_overlapped_run_equals_step_by_step(data_dir, tmp_path):
  # H = 4, P = 2, tau = 1: fragment 1 is sent at count 1 and merged at
  # count 2, one [send, merge] program; the send at count 3 runs alone
  # (its merge would pass the run's end). A log on every step makes every
  # step run alone: the step-by-step reference, with the same experiment
  # (log_every is not part of what is compiled).
  want = train.train_and_evaluate(
      tiny_config(data_dir, **STREAMING, log_every=1), tmp_path / 'steps')
  config = tiny_config(data_dir, **STREAMING, log_every=4)
  exp = exp_lib.get_experiment(config)
  windows = exp.programs.windows
  assert len(windows) == 0
  got = train.train_and_evaluate(config, tmp_path / 'window')
  assert list(windows.reports) == [((1, None), (None, 1))]
  for a, b in zip(leaves(got['state']), leaves(want['state'])):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  for key in ('cross_worker_bytes', 'syncs', 'bytes_per_phase'):
    assert got[key] == want[key], key
  assert got['final_eval_loss'] == pytest.approx(want['final_eval_loss'],
                                                 rel=1e-6)
  (phases, report), = windows.reports.items()
  # The window moves the bytes of its steps ...
  nbytes = exp.programs.bytes_per_step
  assert report.cross_worker_bytes == sum(nbytes[p] for p in phases) > 0
  # ... and the merge step's matmuls neither feed the fragment's
  # all-reduce nor read its result (those of the send step feed it).
  flows = parallel.collective_dataflow(windows[phases], exp.mesh)
  assert flows
  for flow in flows:
    name = flow.node.name
    assert {k for n in flow.users_where(opcodes=MATMULS)
            for k in overlap.steps_of(n.op_name) or ()} == set(), name
    assert {k for n in flow.operands_where(opcodes=MATMULS)
            for k in overlap.steps_of(n.op_name) or ()} == {0}, name


@pytest.mark.parametrize('overrides,match', [
    ({'outer.overlap': 'async'}, "'none' or 'compiled'"),
    ({'outer.overlap': 'compiled'}, "method='diloco' reads every sync"),
    ({'outer.overlap': 'compiled', 'outer.method': 'streaming_diloco',
      'outer.streaming_diloco.num_fragments': 2,
      'outer.streaming_diloco.overlap': 0},
     "method='streaming_diloco' reads every sync"),
    ({'outer.overlap': 'compiled', 'outer.method': 'data_parallel'},
     "method='data_parallel' reads every sync"),
    ({'outer.overlap': 'compiled', 'outer.method': 'decoupled_diloco'},
     'simulated timeline'),
])
def test_overlap_refused_where_nothing_can_overlap(data_dir, overrides,
                                                    match):
  with pytest.raises(ValueError, match=match):
    train.validate_config(tiny_config(data_dir, **overrides),
                          jax.device_count())


@pytest.mark.parametrize('method', ['eager_diloco', 'co2'])
def test_overlap_accepted_for_round_overlap_methods(data_dir, method):
  config = tiny_config(data_dir, **{'outer.overlap': 'compiled',
                                    'outer.method': method})
  train.validate_config(config, jax.device_count())


def test_overlap_may_change_on_resume(data_dir):
  # A run saved before the field existed, or with the other value,
  # resumes: the windows give the numbers of one program per step.
  saved = json.loads(cfg_lib.config_to_json(tiny_config(data_dir)))
  del saved['outer']['overlap']
  for mode in ('none', 'compiled'):
    current = json.loads(cfg_lib.config_to_json(
        tiny_config(data_dir, **{'outer.overlap': mode})))
    assert ckpt_lib.resume_diffs(saved, current) == []
  current['outer']['sync_every'] = 8
  assert ckpt_lib.resume_diffs(saved, current)

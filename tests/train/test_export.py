"""``loc-opt-export`` / ``export_model``: a run's global model as a plain
Orbax pytree checkpoint that Orbax and the model alone restore and
evaluate to the run's final eval loss; and the startup lines of that run."""

import json
import re
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from loc_opt import models
from loc_opt import train
from loc_opt.train import experiment as exp_lib
from loc_opt.train import export
from loc_opt.train import startup
from tests.train._helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def run(data_dir, tmp_path_factory):
  config = tiny_config(data_dir)  # DiLoCo, H = 4, 12 steps, :mlp
  workdir = tmp_path_factory.mktemp('run')
  exp_lib._EXPERIMENT_CACHE.clear()  # pylint: disable=protected-access
  lines = []
  with startup.report_to(lines.append):  # the launcher's startup lines
    summary = train.train_and_evaluate(config, workdir)
  return config, workdir, dict(summary, startup=lines)


def test_startup_lines_name_each_compile(run):
  lines = run[2]['startup']
  assert lines[0] == 'compiling train step 1 of 2 (inner steps) ...', lines
  assert re.fullmatch(r'compiled train step 1 of 2 \(inner steps\) in '
                      r'\d+\.\d s', lines[1]), lines
  assert lines[2:4] == ['compiling train step 2 of 2 (sync) ...', lines[3]]
  assert lines[3].startswith('compiled train step 2 of 2 (sync) in ')
  # The summary's data-parallel reference: one line pair, its own
  # compiles silent.
  assert lines[4:] == [
      'compiling the data-parallel step (the summary compares its bytes) ...',
      lines[5]] and lines[5].endswith(' s'), lines


def test_the_export_restores_with_orbax_alone_to_the_final_loss(
    run, tmp_path):
  config, workdir, summary = run
  info = export.export_model(workdir, tmp_path / 'out')
  assert info['step'] == config.num_steps and info['source'] == 'anchor'
  # The documented three lines: Orbax, the model config, the model.
  params = ocp.StandardCheckpointer().restore(tmp_path / 'out' / 'params')
  model = models.build_model(
      json.loads((tmp_path / 'out' / 'model.json').read_text()))
  assert not any(x.shape[:1] == (config.mesh.workers,) and x.ndim > 2
                 for x in jax.tree.leaves(params))  # no worker axis
  data = exp_lib.load_data(config)
  losses = []
  for batch in data.eval_batches(config.eval_batches):
    batch = np.asarray(batch)
    logits = model.apply(params, batch[:, :-1])
    losses.append(float(models.lm_loss(logits, batch[:, 1:])))
  np.testing.assert_allclose(np.mean(losses), summary['final_eval_loss'],
                             rtol=1e-5)
  assert json.loads((tmp_path / 'out' / 'export.json').read_text())[
      'method'] == 'diloco'


def test_the_export_command(run, tmp_path):
  _, workdir, _ = run
  out = tmp_path / 'cli'
  result = subprocess.run(
      [sys.executable, '-c', 'from loc_opt import launch; '
       'launch.export_main()', f'--workdir={workdir}', f'--out={out}'],
      capture_output=True, text=True, check=False, timeout=240)
  assert result.returncode == 0, result.stderr[-2000:]
  assert f'to {out}/params' in result.stdout
  assert (out / 'params').is_dir() and (out / 'model.json').is_file()
  # Again: refused in one line, nothing overwritten.
  result = subprocess.run(
      [sys.executable, '-c', 'from loc_opt import launch; '
       'launch.export_main()', f'--workdir={workdir}', f'--out={out}'],
      capture_output=True, text=True, check=False, timeout=240)
  assert result.returncode == 2
  assert result.stderr.strip() == f'error: {out}/params exists; export to ' \
      'a new --out'

"""The Colab notebooks run top to bottom (with fewer steps)."""

import json
import pathlib

import matplotlib
import pytest

matplotlib.use('Agg')

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'colabs')
                   .glob('*.ipynb'))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, capsys):
  monkeypatch.setenv('LOC_OPT_COLAB_STEPS', '40')
  cells = json.loads(path.read_text())['cells']
  source = '\n'.join(''.join(c['source']) for c in cells
                     if c['cell_type'] == 'code')
  namespace = {}
  exec(compile(source, str(path), 'exec'), namespace)  # pylint: disable=exec-used
  out = capsys.readouterr().out
  assert 'final eval loss' in out
  assert 'inner step 0 cross-worker bytes' in out
  # Both methods learn from the ln(256) = 5.55 of a uniform byte model.
  assert namespace['diloco_curve'][-1][1] < 5.0
  assert namespace['dp_curve'][-1][1] < 5.0
  # The last program compiled is the sync step: fp32 delta on all 8 devices.
  nparams = namespace['model'].num_params
  assert namespace['report'].cross_worker_bytes == 4 * nparams * 8

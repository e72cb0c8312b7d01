"""The Colab notebooks run top to bottom (with their fast settings) and show
what their prose says.

Each notebook's code cells are concatenated, IPython magics and shell lines
(``%pip ...``, ``!ls``) dropped, and executed in one namespace with the
environment of its entry in ``CHECKS``; the entry's check then reads that
namespace. A notebook without an entry fails, so every new notebook comes
with its checks.
"""

import json
import math
import pathlib

import jax
import matplotlib
import numpy as np
import pytest

matplotlib.use('Agg')
import matplotlib.pyplot as plt

COLABS = pathlib.Path(__file__).parent.parent / 'colabs'
NOTEBOOKS = sorted(COLABS.glob('*.ipynb'))
BADGE = ('https://colab.research.google.com/github/loc-opt/loc_opt/blob/main/'
         'colabs/')
LN256 = math.log(256)  # a uniform guess over bytes


def code_of(path: pathlib.Path) -> str:
  """The notebook's code cells as one program, without IPython-only lines."""
  cells = json.loads(path.read_text())['cells']
  lines = []
  for cell in cells:
    if cell['cell_type'] != 'code':
      continue
    for line in ''.join(cell['source']).splitlines():
      if not line.lstrip().startswith(('%', '!')):
        lines.append(line)
    lines.append('')
  return '\n'.join(lines)


def _check_quickstart(ns, out):
  assert 'final eval loss' in out
  assert 'inner step 0 cross-worker bytes' in out
  # Both methods learn from the ln(256) = 5.55 of a uniform byte model.
  assert ns['diloco_curve'][-1][1] < 5.0
  assert ns['dp_curve'][-1][1] < 5.0
  # The last program compiled is the sync step: fp32 delta on all 8 devices.
  nparams = ns['model'].num_params
  assert ns['report'].cross_worker_bytes == 4 * nparams * 8


def _check_byo_flax_model(ns, out):
  assert 'NNX   final eval loss' in out and 'Linen final eval loss' in out
  for name in ('nnx_diloco', 'nnx_plain', 'linen_diloco', 'linen_plain'):
    curve = ns[name]
    assert len(curve) == ns['STEPS'] // ns['H'], name
    assert curve[-1][1] < 5.0, (name, curve)  # learned from ln 256
    assert curve[-1][1] < curve[0][1], (name, curve)
  # DiLoCo with syncs every H steps keeps up with the plain optimizer fed
  # the same tokens (at this scale and length it is ahead).
  assert ns['nnx_diloco'][-1][1] < ns['nnx_plain'][-1][1] + 0.1
  assert ns['linen_diloco'][-1][1] < ns['linen_plain'][-1][1] + 0.1


def _check_compression(ns, out):
  assert 'sync bytes/worker' in out
  results, nparams = ns['results'], ns['model'].num_params
  # fp32: each element crosses workers once per worker (worker_mean).
  assert results['fp32']['bytes'] == 4 * nparams
  # The compiled programs move what each codec's formula says, up to the
  # padding to whole blocks on each of a worker's 2 devices.
  for name, r in results.items():
    assert r['theory'] <= r['bytes'] <= r['theory'] * 1.02, (name, r)
  ratio = {name: 4 * nparams / r['bytes'] for name, r in results.items()}
  assert 3.8 < ratio['int8'] < 4.0, ratio  # 1 B + a 4 B scale per 256
  assert 7.5 < ratio['int4'] < 8.0, ratio  # half a byte + the scales
  assert 9.5 < ratio['top-5% + EF'] < 10.0, ratio  # 5 % x (value + index)
  # int8's payloads are all-gathered (the fp32 mean is an all-reduce).
  assert set(results['int8']['report'].by_kind(cross_worker=True)) == {
      'all-gather'}
  # Loss at equal steps: int8 costs nothing measurable, nothing diverges.
  assert results['fp32']['loss'] < 5.0
  assert abs(results['int8']['loss'] - results['fp32']['loss']) < 0.01
  for name, r in results.items():
    assert np.isfinite(r['loss']) and r['loss'] < LN256 + 0.1, (name, r)


def _check_inner_optimizers_spikes(ns, out):
  final = ns['final_eval']
  assert len(ns['SPIKES']) == 2
  assert all(np.isfinite(v) for v in final.values()), final
  assert final['AdamW, no spikes'] < 4.0, final
  # The spikes stall AdamW well above the no-spike run; SPAM's clip keeps
  # most of the progress.
  assert final['AdamW'] > final['AdamW, no spikes'] + 0.3, final
  assert final['SPAM'] < final['AdamW'] - 0.2, final
  assert final['Stable-SPAM'] < LN256, final


def _check_schedules(ns, out):
  final, steps = ns['final'], ns['STEPS']
  assert set(final) == {'cosine', 'WSD', 'WSD-S', 'schedule-free'}
  for name, loss in final.items():
    assert loss < 4.0, (name, final)
  # WSD's cooldown lands near cosine's end, and WSD-S near WSD; decaying
  # beats staying at the peak.
  assert abs(final['WSD'] - final['cosine']) < 0.05, final
  assert abs(final['WSD-S'] - final['WSD']) < 0.1, final
  assert final['WSD'] < ns['main_curve'][-1][1] - 0.02, final
  # The schedules are what the prose says: WSD at the peak until its decay.
  lrs = ns['lr_values']
  assert lrs['WSD'][steps // 2] == pytest.approx(ns['LR'])
  assert lrs['WSD'][-1] < 0.1 * ns['LR'] and lrs['cosine'][-1] < 0.01 * ns['LR']
  # The branch restored from the checkpoint at 0.8 T reproduces the WSD run.
  start, _ = ns['branches'][steps]
  assert start == steps - int(0.2 * steps)
  assert ns['branch_curves'][steps][-1][1] == pytest.approx(final['WSD'],
                                                            abs=1e-4)
  # The cooldown branch for T/2 beats the constant-rate run at T/2.
  half = dict(ns['main_curve'])[steps // 2]
  assert ns['branch_curves'][steps // 2][-1][1] < half


def _check_diloco_family(ns, out):
  results, nparams = ns['results'], ns['model'].num_params
  steps, h = ns['STEPS'], ns['H']
  fp32 = 4 * nparams
  by_name = {name.split(' (')[0]: r for name, r in results.items()}
  dp, diloco = by_name['data parallel'], by_name['DiLoCo']
  fp4, stream = by_name['DiLoCo + fp4'], by_name['Streaming DiLoCo']
  sparse = by_name['SparseLoCo']
  # Bytes read from the compiled programs.
  assert dp['phase_bytes'] == {False: fp32}
  assert diloco['phase_bytes'] == {False: 0, True: fp32}
  for r in (fp4, stream, sparse):
    assert r['phase_bytes'][False] == 0  # inner steps stay local
  assert 7.5 < fp32 / fp4['phase_bytes'][True] < 8.0
  phases = stream['phase_bytes'].items()
  sends = [b for ph, b in phases if ph and ph[0] is not None]
  applies = [b for ph, b in phases if ph and ph[0] is None]
  assert len(sends) == ns['P'] and sum(sends) == fp32  # fragments partition
  assert max(sends) < fp32 and set(applies) == {0}
  assert sparse['phase_bytes'][True] < fp4['phase_bytes'][True] / 4
  # Totals: data parallel sends H times DiLoCo's bytes.
  total = {name: r['rows'][-1]['bytes'] for name, r in by_name.items()}
  assert total['data parallel'] == steps * fp32
  assert total['data parallel'] == h * total['DiLoCo']
  assert total['Streaming DiLoCo'] == total['DiLoCo']
  # Wall-clock: the slow link orders the methods by what they wait for;
  # on the fast link every method is about compute bound.
  slow = {name: r['rows'][-1]['slow_s'] for name, r in by_name.items()}
  fast = {name: r['rows'][-1]['fast_s'] for name, r in by_name.items()}
  compute = steps * ns['STEP_TIME_S']
  assert slow['data parallel'] > 5 * slow['DiLoCo'], slow
  assert slow['Streaming DiLoCo'] < slow['DiLoCo'], slow  # overlap
  assert slow['DiLoCo + fp4'] < slow['DiLoCo'], slow
  assert slow['SparseLoCo'] < slow['DiLoCo + fp4'], slow
  for name, seconds in fast.items():
    assert compute <= seconds < 1.1 * compute, (name, fast)
  # Loss: everything learns from ln 256 without diverging.
  for name, r in by_name.items():
    assert all(np.isfinite(row['loss']) for row in r['rows']), name
    assert r['rows'][-1]['loss'] < LN256, (name, r['rows'])
  assert diloco['rows'][-1]['loss'] < 4.0


# notebook stem -> (environment, check(namespace, captured stdout))
CHECKS = {
    'diloco_quickstart': ({'LOC_OPT_COLAB_STEPS': '40'}, _check_quickstart),
    'byo_flax_model': ({'LOC_OPT_COLAB_STEPS': '40'}, _check_byo_flax_model),
    'compression': ({'LOC_OPT_COLAB_STEPS': '40'}, _check_compression),
    # Spikes on updates 39 and 66: after SPAM's 20-step clip delay.
    'inner_optimizers_spikes': ({'LOC_OPT_COLAB_STEPS': '100'},
                                _check_inner_optimizers_spikes),
    # The default length: long enough for the decays to matter.
    'schedules': ({'LOC_OPT_COLAB_STEPS': '200'}, _check_schedules),
    'diloco_family': ({'LOC_OPT_COLAB_STEPS': '40'}, _check_diloco_family),
}


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, capsys):
  assert path.stem in CHECKS, f'{path.name} has no entry in CHECKS'
  env, check = CHECKS[path.stem]
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  namespace = {}
  # The notebooks' programs are tiny and run a few dozen steps: compiling
  # them without LLVM's optimizations saves a quarter of the test's time
  # (the HLO passes, hence the collectives read from the programs, are the
  # same).
  previous = jax.config.read('jax_disable_most_optimizations')
  jax.config.update('jax_disable_most_optimizations', True)
  try:
    program = compile(code_of(path), str(path), 'exec')
    exec(program, namespace)  # noqa: S102
  finally:
    jax.config.update('jax_disable_most_optimizations', previous)
    plt.close('all')
  check(namespace, capsys.readouterr().out)


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_format(path):
  """Valid nbformat 4, stored without outputs, opening with the Colab badge
  and an install cell."""
  nb = json.loads(path.read_text())
  assert nb['nbformat'] == 4
  try:
    import nbformat  # pylint: disable=g-import-not-at-top
  except ImportError:  # not a test dependency; the checks below still run
    nbformat = None
  if nbformat is not None:
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))
  cells = nb['cells']
  assert cells[0]['cell_type'] == 'markdown'
  assert BADGE + path.name in ''.join(cells[0]['source'])
  code = [c for c in cells if c['cell_type'] == 'code']
  assert ''.join(code[0]['source']) == install_cell()  # the same everywhere
  for cell in code:
    assert cell['outputs'] == [] and cell['execution_count'] is None


def install_cell() -> str:
  """The first code cell of every notebook: installs loc_opt where missing."""
  code = [c for c in json.loads(NOTEBOOKS[0].read_text())['cells']
          if c['cell_type'] == 'code']
  return ''.join(code[0]['source'])


@pytest.mark.parametrize('where, source', [
    ('colabs', 'clone'), ('.', 'clone'), ('elsewhere', 'repo')])
def test_the_install_cell_installs_from_one_place(where, source, tmp_path,
                                                  monkeypatch):
  # In a runtime without loc_opt, the cell pip-installs
  # loc_opt[train,plot] from LOC_OPT_SOURCE: the clone it runs from (the
  # notebooks' folder or the clone's root), else the repository URL.
  import importlib.util  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  root = COLABS.parent
  monkeypatch.chdir({'colabs': COLABS, '.': root,
                     'elsewhere': tmp_path}[where])
  calls = []
  monkeypatch.setattr(subprocess, 'run',
                      lambda cmd, check: calls.append(cmd))
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'loc_opt'
                      else find_spec(name, *a))
  namespace = {}
  exec(compile(install_cell(), 'install', 'exec'), namespace)  # noqa: S102
  want = root.as_uri() if source == 'clone' else namespace['LOC_OPT_REPO']
  assert namespace['LOC_OPT_SOURCE'] == want
  assert calls == [[namespace['sys'].executable, '-m', 'pip', 'install',
                    '-q', f'loc_opt[train,plot] @ {want}']]


def test_magics_are_dropped(tmp_path):
  """`code_of` keeps Python and drops only IPython-only lines."""
  nb = {'cells': [
      {'cell_type': 'markdown', 'source': ['% not code']},
      {'cell_type': 'code', 'source': ['%pip install x\n', 'a = 1\n',
                                       '  !ls\n', 'b = a % 2\n']}]}
  path = tmp_path / 'n.ipynb'
  path.write_text(json.dumps(nb))
  assert code_of(path).split() == ['a', '=', '1', 'b', '=', 'a', '%', '2']

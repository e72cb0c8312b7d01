"""The installable product: a slim core, the trainer as an extra, the
configs shipped in the package.

The core (``loc_opt`` and its transforms, schedules, codecs and worker
meshes) needs jax, optax and numpy only; ``loc_opt[train]`` adds what the
trainer and its launcher import. An import-graph check (every ``import``
statement, deferred ones too) fails when a core module reaches a trainer
dependency through any chain of ``loc_opt`` imports, and a subprocess in
which those dependencies cannot be imported runs a transform.
"""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import pytest

from tests import test_architecture as arch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())

# Import names of the trainer extra (and what only they bring in).
TRAINER_MODULES = ('flax', 'orbax', 'tensorflow_datasets', 'tensorflow',
                   'ml_collections', 'absl', 'tensorboardX', 'array_record',
                   'etils', 'tensorstore')
# The core: what `pip install loc_opt` must run.
CORE = ('loc_opt', 'loc_opt._checks', 'loc_opt.outer', 'loc_opt.inner',
        'loc_opt.schedules', 'loc_opt.compression', 'loc_opt.parallel')


def _external_imports(path: pathlib.Path) -> set[str]:
  """Top-level names of the non-``loc_opt`` modules ``path`` imports."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name.split('.')[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module.split('.')[0])
  return out - {'loc_opt'}


def _core_modules(modules) -> list[str]:
  return sorted(m for m in modules
                if m in CORE or any(m.startswith(c + '.') for c in CORE[1:]))


def trainer_imports_of_core() -> list[str]:
  """``core module -> ... -> trainer dependency`` chains (none: slim)."""
  modules = arch._modules()  # pylint: disable=protected-access
  graph = arch._graph()  # pylint: disable=protected-access
  chains = []
  for start in _core_modules(modules):
    seen, stack = {start}, [(start, [start])]
    while stack:
      module, path = stack.pop()
      for dep in sorted(_external_imports(modules[module])
                        & set(TRAINER_MODULES)):
        chains.append(' -> '.join(path + [dep]))
      for nxt in sorted(graph[module] - seen):
        seen.add(nxt)
        stack.append((nxt, path + [nxt]))
  return sorted(set(chains))


def test_no_core_module_imports_a_trainer_dependency():
  assert _core_modules(arch._modules())  # pylint: disable=protected-access
  chains = trainer_imports_of_core()
  assert not chains, chains


def test_the_import_graph_check_finds_a_trainer_import(tmp_path, monkeypatch):
  # The check can fail: a core module that imports the trainer is caught.
  fake = tmp_path / 'loc_opt'
  for sub in ('outer', 'train'):
    (fake / sub).mkdir(parents=True)
  (fake / '__init__.py').write_text('from loc_opt import outer\n')
  (fake / 'outer' / '__init__.py').write_text(
      'def f():\n  from loc_opt.train import loop\n')
  (fake / 'train' / '__init__.py').write_text('')
  (fake / 'train' / 'loop.py').write_text('import orbax.checkpoint as ocp\n')
  monkeypatch.setattr(arch, 'ROOT', tmp_path)
  monkeypatch.setattr(arch, 'PACKAGE', fake)
  assert trainer_imports_of_core() == [
      'loc_opt -> loc_opt.outer -> loc_opt.train.loop -> orbax',
      'loc_opt.outer -> loc_opt.train.loop -> orbax']


def test_core_dependencies_and_extras():
  project = PYPROJECT['project']
  names = lambda reqs: {r.split('>')[0].split('=')[0].split('[')[0].strip()
                        for r in reqs}
  assert names(project['dependencies']) == {'jax', 'optax', 'numpy'}
  extras = project['optional-dependencies']
  assert {'flax', 'orbax-checkpoint', 'tensorflow-datasets', 'array-record',
          'ml-collections', 'absl-py', 'tensorboardX'} <= names(extras['train'])
  for extra in ('test', 'docs', 'dev'):  # they run or render the trainer
    assert 'loc_opt[train]' in extras[extra], extra
  scripts = project['scripts']
  assert scripts['loc-opt-train'] == 'loc_opt.launch:train_main'
  assert scripts['loc-opt-export'] == 'loc_opt.launch:export_main'


def test_every_subpackage_and_the_configs_are_packaged():
  setup = PYPROJECT['tool']['setuptools']
  found = {'loc_opt'} | {
      'loc_opt.' + p.name for p in (ROOT / 'loc_opt').iterdir()
      if (p / '__init__.py').exists()}
  assert set(setup['packages']) == found | {'loc_opt.configs'}
  # One copy of the configs: the top-level directory, shipped as
  # loc_opt.configs.
  assert setup['package-dir'] == {'loc_opt.configs': 'configs'}
  assert not (ROOT / 'loc_opt' / 'configs').exists()


_BLOCK_TRAINER = textwrap.dedent(f"""
    import importlib.abc, sys
    BLOCKED = {TRAINER_MODULES[:-2]!r} + ('etils', 'tensorstore')
    class Block(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED and name.split('.')[0] != 'absl':
          raise ImportError(f'{{name}} is not installed (blocked)')
    sys.meta_path.insert(0, Block())
""")


def _run(code: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  return subprocess.run([sys.executable, '-c', _BLOCK_TRAINER + code],
                        capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=240, check=False)


@pytest.mark.slow
def test_the_core_runs_without_the_trainer_extra():
  # absl comes with optax itself; everything else of the extra is blocked.
  result = _run(textwrap.dedent("""
      import jax, jax.numpy as jnp, optax
      import loc_opt
      tx = loc_opt.diloco(optax.sgd(0.1), sync_every=2,
                          outer=optax.sgd(1.0), axis_name='w')
      params = jnp.ones((2, 3))  # two workers
      def step(p, s):
        u, s = tx.update(jnp.ones_like(p), s, p)
        return optax.apply_updates(p, u), s
      s = jax.vmap(tx.init, axis_name='w')(params)
      for _ in range(2):
        params, s = jax.vmap(step, axis_name='w')(params, s)
      blocked = [m for m in sys.modules if m.split('.')[0] in
                 ('flax', 'orbax', 'tensorflow_datasets', 'ml_collections')]
      print('ok', params.shape, params[0, 0].item(), blocked)
      from loc_opt import launch
      launch.train_main(['loc-opt-train', '--config=diloco_lm'])
      """))
  lines = result.stdout.splitlines()
  assert lines and lines[0].startswith('ok (2, 3)'), result.stderr[-3000:]
  assert lines[0].endswith('[]'), lines
  # The launcher without its extra: one line naming the pip install.
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [
      "error: loc-opt-train needs the trainer extra (flax, orbax, "
      "tensorflow_datasets, array_record, ml_collections, tensorboardX not "
      "installed): pip install 'loc_opt[train]'"], result.stderr

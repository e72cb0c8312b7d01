"""The package's shape: no import cycles, imports only go down the layers,
and no module or function outgrows what one reader holds in mind.

Imports are read from the source (every ``import`` statement, deferred ones
inside functions too), so a cycle hidden behind a function-level import
fails here as well.
"""

import ast
import pathlib

import pytest

from tools import sizes

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'loc_opt'

# Data flows down: a module may import its own layer (without cycles) and
# the layers below it, never one above.
LAYERS = {
    '_checks': 0,
    'compression': 1, 'models': 1, 'data': 1,
    'parallel': 2,
    'schedules': 3, 'inner': 3, 'outer': 3,
    'train': 4,
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix('').parts
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob('*.py')}


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]
             ) -> set[str]:
  """The ``loc_opt`` modules a module imports (``from pkg import sub`` is the
  submodule when ``sub`` is one, else the package)."""
  name = _module_name(path)
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      for alias in node.names:
        full = f'{base}.{alias.name}'
        out.add(full if full in modules else base)
  return {m for m in out if m == 'loc_opt' or m.startswith('loc_opt.')}


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(path, modules) - {name}
          for name, path in modules.items()}


def _layer(module: str) -> int | None:
  parts = module.split('.')
  return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of ``graph`` (as a closed path), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_every_subpackage_has_a_layer():
  subpackages = {p.name for p in PACKAGE.iterdir()
                 if p.is_dir() and (p / '__init__.py').exists()}
  subpackages |= {p.stem for p in PACKAGE.glob('_*.py')
                  if p.name != '__init__.py'}
  assert subpackages == set(LAYERS)


def test_no_import_cycles():
  assert _find_cycle(_graph()) is None, ' -> '.join(_find_cycle(_graph()))


def test_imports_only_go_down_the_layers():
  upward = []
  for module, imported in _graph().items():
    here = _layer(module)
    if here is None:  # the top-level facade may import anything
      continue
    for other in imported:
      there = _layer(other)
      if other == 'loc_opt' or (there is not None and there > here):
        upward.append(f'{module} imports {other}')
  assert not upward, upward


def test_the_package_imports_no_experiments_configs_or_tests():
  outside = ('experiments', 'configs', 'tests')
  for name, path in _modules().items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or '']
      else:
        continue
      for imported in names:
        assert imported.split('.')[0] not in outside, (name, imported)


def test_the_checker_finds_a_cycle_and_an_upward_import():
  # The checks above can fail: a made-up graph with a cycle is caught.
  graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': set()}
  assert _find_cycle(graph) == ['a', 'b', 'c', 'a']
  assert _find_cycle({'a': {'b'}, 'b': set()}) is None
  assert _layer('loc_opt.train.loop') > _layer('loc_opt.outer.diloco')


def test_no_module_or_function_is_oversized():
  modules, functions = sizes.oversized(PACKAGE)
  assert not modules, modules
  assert not functions, functions


@pytest.mark.parametrize('source, expected', [
    ('def f():\n  """Doc."""\n' + '  x = 1\n' * 81, 82),
    ('def f():\n' + '  x = 1\n' * 3, 4),
])
def test_function_length_ignores_the_docstring(tmp_path, source, expected):
  path = tmp_path / 'm.py'
  path.write_text(source)
  assert sizes.function_lengths(path) == [('f', expected, 1)]


def test_tests_import_no_program_with_flags():
  # absl flags are process-global: two programs that define --config or
  # --workdir cannot be imported into one pytest process (a
  # DuplicateFlagError at collection). Tests import helper modules, and run
  # programs as subprocesses.
  root = pathlib.Path(__file__).resolve().parent
  programs = set()
  for path in (root.parent / 'experiments').glob('*.py'):
    if 'flags.DEFINE_' in path.read_text():
      programs.add(f'experiments.{path.stem}')
  assert 'experiments.frontier' in programs  # the check can bite
  found = []
  for path in root.rglob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == 'experiments':
        names = [f'experiments.{a.name}' for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or '']
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      found += [f'{path.name}: {n}' for n in names if n in programs]
  assert not found, found

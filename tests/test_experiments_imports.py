"""No module under ``experiments/`` is in an import cycle.

The imports are read with :mod:`ast` (those inside functions too, which a
cycle hides behind), not by importing: the renderer modules register
their tables in ``experiments/_registry.py`` and never import
``experiments/tables.py`` back.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def module_names(package: pathlib.Path) -> dict[str, pathlib.Path]:
  """``{'experiments.tables': path, ...}`` for every ``.py`` under it."""
  names = {}
  for path in sorted(package.rglob('*.py')):
    parts = path.relative_to(package.parent).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    names['.'.join(parts)] = path
  return names


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The modules of ``known`` that module ``name`` imports anywhere in it
  (``import a.b``, ``from a import b`` where ``a.b`` is a module, ``from
  a.b import c``, relative imports), less itself and its packages."""
  is_package = path.name == '__init__.py'
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        package = name.split('.')
        package = package if is_package else package[:-1]
        package = package[:len(package) - node.level + 1]
        base = '.'.join(package + ([base] if base else []))
      found.add(base)
      found.update(f'{base}.{a.name}' for a in node.names)
  parts = name.split('.')
  parents = {'.'.join(parts[:i]) for i in range(1, len(parts))}
  return (found & known) - {name} - parents


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def graph_of(package: pathlib.Path) -> dict[str, set[str]]:
  names = module_names(package)
  return {n: imports(n, p, set(names)) for n, p in names.items()}


def test_no_import_cycle_in_experiments():
  graph = graph_of(REPO / 'experiments')
  # The graph is the real one: tables imports its renderers.
  assert 'experiments._claims' in graph['experiments.tables']
  assert 'experiments._registry' in graph['experiments._claims']
  assert cycles(graph) == [], (
      'modules under experiments/ that import each other (a renderer '
      'registers in experiments/_registry.py instead of importing '
      f'experiments/tables.py): {cycles(graph)}')


def test_cycle_finder_sees_a_cycle_behind_a_function_import(tmp_path):
  pkg = tmp_path / 'pkg'
  pkg.mkdir()
  (pkg / '__init__.py').write_text('')
  (pkg / 'a.py').write_text('from pkg import b\n')
  (pkg / 'b.py').write_text('def f():\n  from . import a\n  return a\n')
  (pkg / 'c.py').write_text('import pkg.a\n')
  graph = graph_of(pkg)
  assert graph['pkg.b'] == {'pkg.a'}
  assert cycles(graph) == [['pkg.a', 'pkg.b']]

"""Reports loc_opt modules over 600 lines and functions over 80 lines.

A function's length is its source lines without its docstring. Run from the
repository root: ``python tools/sizes.py [package_dir]``; exits 1 if anything
is over.
"""

import ast
import pathlib
import sys

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def function_lengths(path: pathlib.Path):
  """``(qualified name, lines without docstring, first line)`` per function."""
  tree = ast.parse(path.read_text())
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = child.end_lineno - child.lineno + 1
        doc = ast.get_docstring(child, clean=False)
        if doc is not None:
          first = child.body[0]
          length -= first.end_lineno - first.lineno + 1
        out.append((prefix + child.name, length, child.lineno))
        visit(child, prefix + child.name + '.')
      elif isinstance(child, ast.ClassDef):
        visit(child, prefix + child.name + '.')
  visit(tree, '')
  return out


def oversized(root: pathlib.Path):
  """``(module problems, function problems)`` below ``root``."""
  modules, functions = [], []
  for path in sorted(root.rglob('*.py')):
    lines = len(path.read_text().splitlines())
    if lines > MAX_MODULE_LINES:
      modules.append((str(path), lines))
    for name, length, lineno in function_lengths(path):
      if length > MAX_FUNCTION_LINES:
        functions.append((f'{path}:{lineno} {name}', length))
  return modules, functions


def main(argv):
  root = pathlib.Path(argv[1] if len(argv) > 1 else 'loc_opt')
  modules, functions = oversized(root)
  for where, n in modules:
    print(f'module {where}: {n} lines (max {MAX_MODULE_LINES})')
  for where, n in functions:
    print(f'function {where}: {n} lines (max {MAX_FUNCTION_LINES})')
  return 1 if modules or functions else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))

"""Fixtures for the data tests: a small tree of source files."""

import pathlib

import pytest


def write_tree(root: pathlib.Path, num_files: int = 40) -> dict[str, bytes]:
  """Writes source files under ``root``; returns the selected ones by path.

  Besides ``num_files`` Python files in nested directories (one with bytes
  that are not UTF-8), it writes files that the default selection skips: a
  ``.txt`` file and Python files under ``__pycache__`` and ``tests``.
  """
  selected = {}
  for i in range(num_files):
    rel = f'pkg{i % 3}/sub{i % 2}/mod_{i:03d}.py' if i % 4 else f'top_{i}.py'
    text = f'# file {i}\n' + ''.join(f'x_{i}_{j} = {j * i}\n' for j in range(i))
    data = text.encode()
    if i == 7:
      data += bytes([0xFF, 0xFE, 0x80, 0x01])  # Not UTF-8: bytes, not text.
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    selected[rel] = data
  (root / 'notes.txt').write_text('not python\n')
  for skipped in ('__pycache__/cached.py', 'pkg0/tests/test_thing.py'):
    (root / skipped).parent.mkdir(parents=True, exist_ok=True)
    (root / skipped).write_text('skipped = True\n')
  return selected


@pytest.fixture(scope='session')
def tree_writer():
  """The function that writes a source tree, for tests that need a fresh one."""
  return write_tree


@pytest.fixture(scope='session')
def source_tree(tmp_path_factory) -> tuple[pathlib.Path, dict[str, bytes]]:
  """A source directory (never modified) and its selected files."""
  root = tmp_path_factory.mktemp('source')
  return root, write_tree(root)

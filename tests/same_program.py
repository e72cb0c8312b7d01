"""Whether two functions compile to the same XLA program.

A test that asserts two computations bit-identical must compare the same
operations in the same order: two different programs that agree on one CPU
may round differently on another. :func:`assert_same_program` checks that
two jitted functions compile to the same optimized HLO (up to instruction
names and source metadata), which makes their results equal on any machine.
"""

import difflib
import re

import jax


def program_text(fn, *args) -> str:
  """``fn``'s optimized HLO for ``args``: its computations' instructions,
  without metadata, and with names numbered in order of appearance."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  text = re.sub(r', metadata=\{[^}]*\}', '', text)
  lines = [line for line in text.splitlines()
           if re.match(r'^\s*(ROOT |ENTRY )?%', line) or line.strip() == '}']
  # A computation's header names its parameters: drop the names.
  lines = [re.sub(r'(\(|, )[\w.\-]+: ', r'\1', line)
           if line.endswith('{') else line for line in lines]
  names = {}
  return re.sub(r'%([\w.\-]+)',
                lambda m: '%' + names.setdefault(m.group(1), f'v{len(names)}'),
                '\n'.join(lines))


def assert_same_program(fn, other, *args) -> None:
  """``fn`` and ``other`` compile to the same program for ``args``."""
  a, b = program_text(fn, *args), program_text(other, *args)
  assert a, 'no HLO instructions found'
  if a != b:
    diff = '\n'.join(list(difflib.unified_diff(
        a.splitlines(), b.splitlines(), lineterm=''))[:40])
    raise AssertionError(f'not the same program:\n{diff}')

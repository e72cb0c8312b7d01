"""Every Python block of the README and of ``docs/*.md`` runs as printed.

Each ```` ```python ```` block is executed on its own, in a fresh namespace,
exactly as it appears in the Markdown (the recipes in
``docs/quickstart.md`` end with an ``assert`` on the trained weights).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
BLOCK = re.compile(r'^```python[ \t]*\n(.*?)^```[ \t]*$', re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
  """``(first line number, source)`` of each ```` ```python ```` block."""
  return [(text.count('\n', 0, m.start()) + 2, m.group(1))
          for m in BLOCK.finditer(text)]


def _cases():
  for page in PAGES:
    for line, source in python_blocks(page.read_text()):
      yield pytest.param(page, line, source,
                         id=f'{page.relative_to(ROOT)}:{line}')


def test_the_pages_have_the_promised_blocks():
  # The quick start's four recipes and the README's loop are found (a
  # parsing slip would otherwise leave nothing to run).
  blocks = {p.name: len(python_blocks(p.read_text())) for p in PAGES}
  assert blocks['quickstart.md'] == 4, blocks
  assert blocks['README.md'] >= 2, blocks


def test_a_block_is_extracted_verbatim():
  text = 'a\n```python\nx = 1\n  y = 2\n```\n```bash\nls\n```\n'
  assert python_blocks(text) == [(3, 'x = 1\n  y = 2\n')]


@pytest.mark.parametrize('page, line, source', list(_cases()))
def test_block_runs_as_printed(page, line, source):
  code = compile('\n' * (line - 1) + source, str(page), 'exec')
  exec(code, {'__name__': '__docs__'})  # pylint: disable=exec-used

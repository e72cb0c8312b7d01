"""Sphinx directives of the loc_opt docs.

``registry-table``: a method table from a registry. In a MyST page::

  ```{registry-table} outer
  ```

inserts the table ``families.TABLES['outer']``: one row per name of the
registry (``loc_opt.train.registry.METHODS`` there), so a method registered
without a row in ``families.py``, or a row without a method, is an error
that fails the build (``make docs`` runs with ``-W``).

``api-summary``: an ``autosummary`` table (name and one-line summary) of
every documented public function and class of a package, as its
``automodule`` below lists them, so the table follows the package's
exports::

  ```{api-summary} loc_opt.outer
  ```
"""

import importlib
import inspect

from docutils import nodes
from docutils import utils
from docutils.parsers import rst
from sphinx.util.docutils import SphinxDirective

import families


def _parse_rst(directive: SphinxDirective, text: str) -> list[nodes.Node]:
  """``text`` parsed as reStructuredText whatever the page's own markup
  (MyST pages parse nested content as Markdown), in a document that shares
  the page's settings, so roles and Sphinx directives work."""
  document = directive.state.document
  doc = utils.new_document(document['source'], document.settings)
  doc.reporter = document.reporter
  rst.Parser().parse(text, doc)
  return doc.children


class RegistryTable(SphinxDirective):
  """Renders ``families.rst_table(name)`` in place."""

  required_arguments = 1
  has_content = False

  def run(self) -> list[nodes.Node]:
    try:
      text = families.rst_table(self.arguments[0])
    except (KeyError, ValueError) as e:
      raise self.error(e.args[0]) from e
    return _parse_rst(self, text)


def public_members(module_name: str) -> list[str]:
  """The public functions and classes of ``module_name`` that have a
  docstring (what ``automodule`` with ``members`` documents), sorted."""
  module = importlib.import_module(module_name)
  names = getattr(module, '__all__', None) or [
      n for n in vars(module) if not n.startswith('_')]
  out = []
  for name in names:
    obj = getattr(module, name)
    if inspect.ismodule(obj) or not callable(obj):
      continue
    if inspect.getdoc(obj):
      out.append(name)
  return sorted(out, key=str.lower)


class ApiSummary(SphinxDirective):
  """An ``autosummary`` of ``public_members(module)``."""

  required_arguments = 1
  has_content = False

  def run(self) -> list[nodes.Node]:
    module = self.arguments[0]
    try:
      names = public_members(module)
    except ImportError as e:
      raise self.error(f'api-summary: cannot import {module}: {e}') from e
    if not names:
      raise self.error(f'api-summary: {module} has no documented members')
    lines = [f'.. currentmodule:: {module}', '', '.. autosummary::',
             '   :nosignatures:', '']
    lines += [f'   {name}' for name in names]
    return _parse_rst(self, '\n'.join(lines) + '\n')


def setup(app):
  app.add_directive('registry-table', RegistryTable)
  app.add_directive('api-summary', ApiSummary)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}

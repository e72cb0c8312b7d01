"""Sphinx directive ``registry-table``: a method table from a registry.

In a MyST page::

  ```{registry-table} outer
  ```

inserts the table ``families.TABLES['outer']``: one row per name of the
registry (``loc_opt.train.registry.METHODS`` there), so a method registered
without a row in ``families.py``, or a row without a method, is an error
that fails the build (``make docs`` runs with ``-W``).
"""

from docutils import nodes
from docutils import utils
from docutils.parsers import rst
from sphinx.util.docutils import SphinxDirective

import families


class RegistryTable(SphinxDirective):
  """Renders ``families.rst_table(name)`` in place."""

  required_arguments = 1
  has_content = False

  def run(self) -> list[nodes.Node]:
    name = self.arguments[0]
    try:
      text = families.rst_table(name)
    except (KeyError, ValueError) as e:
      raise self.error(e.args[0]) from e
    # Parsed as reStructuredText whatever the page's own markup (MyST
    # pages parse nested content as Markdown), in a document that shares
    # the page's settings, so roles such as :func: resolve.
    document = self.state.document
    doc = utils.new_document(document['source'], document.settings)
    doc.reporter = document.reporter
    rst.Parser().parse(text, doc)
    return doc.children


def setup(app):
  app.add_directive('registry-table', RegistryTable)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}

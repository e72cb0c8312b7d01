"""Sphinx configuration of the loc_opt documentation.

Build with ``make docs`` (warnings are errors). The API reference is
generated from the docstrings (autodoc, Google style through napoleon); the
Markdown pages are read by MyST; the notebooks in ``colabs/`` (linked here as
``docs/colabs``) are rendered with their stored outputs, never executed.
"""

import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
# The repository root first, so the checkout's loc_opt is documented even
# where another copy is installed; then the local extensions.
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(_HERE, '_ext'))

project = 'loc_opt'
author = 'loc_opt authors'
copyright = '2026, loc_opt authors'  # pylint: disable=redefined-builtin

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.autosummary',  # The tables of each API page (api-summary).
    'sphinx.ext.napoleon',
    'sphinx.ext.mathjax',
    'myst_nb',  # Markdown pages (MyST) and notebooks.
    'registry_tables',  # The method tables, generated from the registries.
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'myst-nb',
                 '.ipynb': 'myst-nb'}
exclude_patterns = ['_build', 'results', 'figures', '.ipynb_checkpoints',
                    'Thumbs.db', '.DS_Store']

# nbformat asks for cell ids that notebooks written by hand may lack; they
# are optional in the notebook format the Colabs use.
warnings.filterwarnings('ignore', message='Cell is missing an id field')

# Notebooks are shown as stored: the test suite runs them.
nb_execution_mode = 'off'
# Markdown: `#section` links to headings of the pages, $math$.
myst_heading_anchors = 3
myst_enable_extensions = ['dollarmath', 'colon_fence']

# Docstrings are Google style.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of the class, so NamedTuple fields are not described
# twice (once by napoleon, once by autodoc).
napoleon_use_ivar = True
autodoc_typehints = 'description'
autodoc_typehints_format = 'short'
autodoc_member_order = 'bysource'
autodoc_preserve_defaults = True
autosummary_generate = False  # The entries are on the page, by automodule.
autodoc_default_options = {'members': True, 'imported-members': True}
add_module_names = False

html_theme = 'sphinx_book_theme'
html_title = 'loc_opt'
html_theme_options = {'show_toc_level': 2}

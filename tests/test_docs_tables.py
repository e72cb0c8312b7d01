"""The method tables of the API docs have one row per registry entry.

The tables (``docs/_ext/families.py``) are rendered by ``make docs``; this
test checks them without Sphinx, so that a method registered without a row
fails the suite as well as the docs build.
"""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def _families():
  spec = importlib.util.spec_from_file_location(
      'families', ROOT / 'docs' / '_ext' / 'families.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


families = _families()

# Every registry a config names things in: each must have a table.
REGISTRIES = {
    'loc_opt.train.registry:METHODS',
    'loc_opt.outer.robust:AGGREGATES',
    'loc_opt.inner.registry:OPTIMIZERS',
    'loc_opt.schedules.base:SCHEDULES',
    'loc_opt.schedules.sync:SYNC_SCHEDULES',
    'loc_opt.compression.registry:CODECS',
    'loc_opt.compression.registry:COMPRESSORS',
    'loc_opt.compression.feedback:FEEDBACK',
}


def test_every_config_registry_has_a_table():
  assert {t.registry for t in families.TABLES.values()} == REGISTRIES


@pytest.mark.parametrize('name', sorted(families.TABLES))
def test_every_registry_entry_has_one_row_and_no_row_is_stale(name):
  table = families.check(name)
  names = families.registry_names(table)
  assert names and sorted(names) == sorted(table.rows)
  body = families.rows(name)
  # One row per registered name, in the registry's order, each naming its
  # config key; every cell filled.
  assert len(body) == len(names) + 1
  for key, row in zip(names, body[1:]):
    assert f"``{table.key}='{key}'``" in row[1]
    assert len(row) == len(body[0]) and all(cell.strip() for cell in row)


def _documented():
  """The modules the API pages document all members of, and the objects
  they document one by one."""
  pages = ''.join(p.read_text() for p in (ROOT / 'docs' / 'api').glob('*.md'))
  return (set(re.findall(r'\.\. automodule:: (\S+)', pages)),
          set(re.findall(r'\.\. auto(?:function|class):: (\S+)', pages)))


@pytest.mark.parametrize('name', sorted(families.TABLES))
def test_every_row_links_a_function_the_api_pages_document(name):
  modules, objects = _documented()
  for key, row in families.TABLES[name].rows.items():
    if not row.api:
      continue
    assert callable(families.load(row.api)), (name, key, row.api)
    if row.measure:
      assert callable(families.load(row.measure)), (name, key, row.measure)
    if row.api.startswith('loc_opt.'):
      module, _, attr = row.api.rpartition('.')
      assert row.api in objects or (
          module in modules and not attr.startswith('_')), (name, key)


def test_rows_with_arguments_name_their_config_field():
  for table in families.TABLES.values():
    if any(row.kwargs for row in table.rows.values()):
      assert table.kwargs_key.startswith(table.key.split('.')[0] + '.')


def test_a_missing_or_stale_row_is_an_error_naming_it(monkeypatch):
  rows = dict(families.OUTER.rows)
  rows['not_a_method'] = rows.pop('diloco')
  monkeypatch.setitem(families.TABLES, 'outer',
                      families.OUTER._replace(rows=rows))
  with pytest.raises(ValueError, match=r"\['diloco'\].*\['not_a_method'\]"):
    families.rows('outer')
  with pytest.raises(KeyError, match='unknown registry table'):
    families.check('no_such_table')


def test_computed_columns_are_the_codes_own_numbers():
  codecs = {r[1].split("'")[1]: r[4] for r in families.rows('codecs')[1:]}
  assert codecs['none'] == '4'  # fp32
  assert codecs['int8'] == '1.02'  # 1 + 4/256: a scale per 256 values
  assert codecs['int4'] == '0.516'  # 1/2 + 4/256
  state = {r[1].split("'")[1]: r[4] for r in families.rows('inner')[1:]}
  assert (state['sgd'], state['momentum'], state['adamw']) == ('0', '4', '8')
  sent = {r[1].split("'")[1]: r[4] for r in families.rows('outer')[1:]}
  assert (sent['diloco'], sent['noloco']) == ('4', '8')  # fp32; phi + Delta
  assert sent['demo'] == '0.043'  # 32 of 64 x 64: (4 + 1.5) * 32 / 4096


def test_every_table_is_on_a_page_of_the_api_docs():
  pages = ''.join(p.read_text() for p in (ROOT / 'docs' / 'api').glob('*.md'))
  shown = re.findall(r'```\{registry-table\} (\w+)', pages)
  assert sorted(shown) == sorted(families.TABLES)

"""Fixtures of the trainer tests."""

import pytest


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """A TFDS data_dir per test module (the byte-level dataset is built once
  per module and reused by its runs)."""
  return str(tmp_path_factory.mktemp('tfds'))

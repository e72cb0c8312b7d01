"""Tests of reading named TFDS text datasets from a data_dir."""

import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core import registered

from loc_opt.data import tfds_text

_TEXTS = [f'document {i}: ' + 'words ' * i for i in range(30)] + ['caf\u00e9']

with registered.skip_registration():

  class LocOptTinyDocs(tfds.core.GeneratorBasedBuilder):
    """A tiny text dataset, unregistered like a builder whose code needs TF."""

    VERSION = tfds.core.Version('1.0.0')
    code_path = pathlib.Path(__file__)  # See loc_opt.data.local_text.

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {
            'text': tfds.features.Text(),
            'id': np.int64,
          }
        ),
        disable_shuffling=True,
      )

    def _split_generators(self, dl_manager):
      return {
        'train': self._generate_examples(range(25)),
        'test': self._generate_examples(range(25, len(_TEXTS))),
      }

    def _generate_examples(self, ids):
      for i in ids:
        yield i, {'text': _TEXTS[i], 'id': i}


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory) -> pathlib.Path:
  data_dir = tmp_path_factory.mktemp('tfds')
  LocOptTinyDocs(
    data_dir=data_dir, file_format='array_record'
  ).download_and_prepare(
    download_config=tfds.download.DownloadConfig(try_download_gcs=False)
  )
  return data_dir


def test_reads_a_prepared_dataset_from_files_alone(data_dir):
  # Unregistered: TFDS finds it from the files (tfds.list_builders() would
  # query the community GCS index, which needs TensorFlow).
  assert 'loc_opt_tiny_docs' not in registered.list_imported_builders()
  docs = tfds_text.load_documents(
    'loc_opt_tiny_docs', split='train', data_dir=data_dir
  )
  assert [d.tobytes().decode() for d in docs] == _TEXTS[:25]
  assert all(d.dtype == np.uint8 and d.ndim == 1 for d in docs)
  test = tfds_text.load_documents(
    'loc_opt_tiny_docs:1.0.0', split='test', data_dir=data_dir
  )
  assert test[-1].tobytes() == 'caf\u00e9'.encode()


def test_max_bytes_and_split_slicing(data_dir):
  docs = tfds_text.load_documents(
    'loc_opt_tiny_docs', split='train', data_dir=data_dir, max_bytes=100
  )
  sizes = [len(t.encode()) for t in _TEXTS]
  expected = max(n for n in range(26) if sum(sizes[:n]) <= 100)
  assert len(docs) == expected and sum(d.size for d in docs) <= 100
  head = tfds_text.load_documents(
    'loc_opt_tiny_docs', split='train[:5]', data_dir=data_dir
  )
  assert [d.tobytes().decode() for d in head] == _TEXTS[:5]


def test_missing_dataset_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError) as info:
    tfds_text.load_documents('lm1b', split='train', data_dir=tmp_path)
  message = str(info.value)
  assert "'lm1b'" in message and str(tmp_path) in message
  command = f'tfds build lm1b --data_dir={tmp_path} --file_format=array_record'
  assert command in message


def test_unknown_dataset_is_missing(tmp_path):
  # c4's TFDS code imports TensorFlow, so here it is only readable from files.
  for name in ('c4/en', 'loc_opt_no_such_dataset'):
    with pytest.raises(FileNotFoundError, match=name):
      tfds_text.load_documents(name, split='train', data_dir=tmp_path)


def test_tfrecord_only_dataset_asks_for_array_record(data_dir, tmp_path):
  # Writing tfrecord needs TensorFlow: relabel an array_record build instead.
  copy = tmp_path / 'loc_opt_tiny_docs' / '1.0.0'
  copy.mkdir(parents=True)
  source = data_dir / 'loc_opt_tiny_docs' / '1.0.0'
  for path in source.iterdir():
    (copy / path.name).write_bytes(path.read_bytes())
  info = json.loads((copy / 'dataset_info.json').read_text())
  assert info['fileFormat'] == 'array_record'
  info['fileFormat'] = 'tfrecord'
  (copy / 'dataset_info.json').write_text(json.dumps(info))
  with pytest.raises(ValueError, match='stored as tfrecord') as error:
    tfds_text.load_documents(
      'loc_opt_tiny_docs', split='train', data_dir=tmp_path
    )
  assert '--file_format=array_record' in str(error.value)


def test_bad_split_and_text_key(data_dir):
  with pytest.raises(
    ValueError, match=r"split 'validation'.*\['test', 'train'\]"
  ):
    tfds_text.load_documents(
      'loc_opt_tiny_docs', split='validation', data_dir=data_dir
    )
  with pytest.raises(ValueError, match=r"text_key 'content'.*\['id', 'text'\]"):
    tfds_text.load_documents(
      'loc_opt_tiny_docs', split='train', data_dir=data_dir, text_key='content'
    )
  with pytest.raises(TypeError, match="text_key 'id'"):
    tfds_text.load_documents(
      'loc_opt_tiny_docs', split='train', data_dir=data_dir, text_key='id'
    )


def test_resolve_data_dir(monkeypatch, tmp_path):
  assert tfds_text.resolve_data_dir(tmp_path) == str(tmp_path)
  assert tfds_text.resolve_data_dir('~/x') == str(pathlib.Path.home() / 'x')
  assert tfds_text.resolve_data_dir(None) == str(
    pathlib.Path(tfds.core.constants.DATA_DIR).expanduser().absolute()
  )

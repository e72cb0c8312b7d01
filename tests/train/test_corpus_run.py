"""The trainer records the corpus of a run and refuses to resume on other
text (loc_opt.data.corpus)."""

import json

import pytest

from loc_opt import data as data_lib
from loc_opt import train
from loc_opt.data import corpus
from tests.train._helpers import tiny_config


def test_summary_names_the_corpus_and_resume_checks_it(data_dir, tmp_path):
  config = tiny_config(data_dir, num_steps=4)
  summary = train.train_and_evaluate(config, tmp_path)
  written = json.loads((tmp_path / 'summary.json').read_text())
  expected = data_lib.corpus_fingerprint(config.data)
  assert written['corpus'] == summary['corpus'] == {**expected,
                                                    'from_step': 0}
  # The finished run read back keeps its record ...
  assert train.train_and_evaluate(config, tmp_path)['corpus'] == \
      written['corpus']
  # ... and refuses text it was not trained on, before compiling.
  record = json.loads((tmp_path / corpus.FILE).read_text())
  record['sha256'] = '0' * 64
  (tmp_path / corpus.FILE).write_text(json.dumps(record))
  with pytest.raises(ValueError, match='cannot resume on other text'):
    train.train_and_evaluate(config, tmp_path)

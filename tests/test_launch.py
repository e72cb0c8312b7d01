"""The launcher (``loc-opt-train``, ``loc_opt.launch``): configs by name,
paths checked before anything is built, errors in one line with exit 2."""

import os
import pathlib
import subprocess
import sys
import time

import pytest

from loc_opt import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_shipped_configs_are_the_top_level_files():
  assert launch.shipped_configs_dir().resolve() == (ROOT / 'configs')
  names = launch.shipped_configs()
  assert 'diloco_lm' in names and '__init__' not in names
  assert names == sorted(p.stem for p in (ROOT / 'configs').glob('[!_]*.py'))


def test_configs_resolve_by_name_or_path(tmp_path):
  configs = ROOT / 'configs'
  assert launch.resolve_config('diloco_lm') == f'{configs}/diloco_lm.py'
  assert launch.resolve_config('diloco_lm:mlp') == (
      f'{configs}/diloco_lm.py:mlp')
  own = tmp_path / 'mine.py'
  own.write_text('')
  assert launch.resolve_config(f'{own}:x') == f'{own}:x'
  with pytest.raises(launch.UsageError, match=r"no such config file.*"
                     r"diloco_lm, dp_lm"):
    launch.resolve_config('nope:mlp')
  with pytest.raises(launch.UsageError, match='is a directory'):
    launch.resolve_config(str(tmp_path))


def test_workdir_checks_create_nothing(tmp_path):
  launch.check_workdir(str(tmp_path / 'new' / 'run'))  # can be created
  assert not (tmp_path / 'new').exists()
  afile = tmp_path / 'afile'
  afile.write_text('x')
  with pytest.raises(launch.UsageError, match='is a file, not a directory'):
    launch.check_workdir(str(afile))
  with pytest.raises(launch.UsageError, match='afile is a file'):
    launch.check_workdir(str(afile / 'run'))
  with pytest.raises(launch.UsageError, match='must be given'):
    launch.check_workdir('')


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes anywhere')
def test_an_unwritable_workdir_is_refused(tmp_path):
  locked = tmp_path / 'locked'
  locked.mkdir(mode=0o555)
  with pytest.raises(launch.UsageError, match='not writable'):
    launch.check_workdir(str(locked / 'run'))


def test_a_missing_data_dir_is_refused_outside_the_workdir_and_cache(
    tmp_path, monkeypatch):
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'cache'))
  workdir = str(tmp_path / 'run')
  launch.check_data_dir('', workdir)  # the TFDS cache
  launch.check_data_dir(str(tmp_path), workdir)  # exists
  launch.check_data_dir(str(tmp_path / 'run' / 'data'), workdir)
  launch.check_data_dir(str(tmp_path / 'cache' / 'sub'), workdir)
  with pytest.raises(launch.UsageError, match=r'does not exist; create it, '
                     r'leave it empty for the TFDS cache \(.*cache\)'):
    launch.check_data_dir(str(tmp_path / 'elsewhere'), workdir)
  (tmp_path / 'f').write_text('x')
  with pytest.raises(launch.UsageError, match='is a file'):
    launch.check_data_dir(str(tmp_path / 'f'), workdir)


def _train(*args, env=None):
  t0 = time.perf_counter()
  result = subprocess.run(
      [sys.executable, '-m', 'loc_opt.launch', *args],
      capture_output=True, text=True, cwd='/', timeout=240, check=False,
      env=dict(os.environ, JAX_PLATFORMS='cpu', **(env or {})))
  return result, time.perf_counter() - t0


@pytest.mark.parametrize('args, message', [
    (['--config=diloco_lm:mlp', '--config.optimizer.learning_rate=nan'],
     'error: optimizer.learning_rate must be finite, got nan'),
    (['--config=nope'], 'error: --config=nope: no such config file'),
    (['--config=diloco_lm:mlp', '--config.outer.nofield=1'],
     "error: the config has no field 'nofield'"),
])
def test_a_config_error_is_one_line_with_exit_code_2(tmp_path, args,
                                                     message):
  workdir = tmp_path / 'run'
  result, seconds = _train(*args, f'--workdir={workdir}')
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(message), lines
  assert not result.stdout
  assert not workdir.exists()
  assert seconds < 60, seconds  # no dataset, no compile


def test_a_workdir_that_is_a_file_and_the_traceback_switch(tmp_path):
  afile = tmp_path / 'afile'
  afile.write_text('x')
  result, _ = _train('--config=diloco_lm:mlp', f'--workdir={afile}',
                     env={launch.TRACEBACK_ENV: '1'})
  assert result.returncode != 0
  assert 'Traceback' in result.stderr
  assert result.stderr.strip().splitlines()[-1].endswith(
      f'UsageError: --workdir={afile} is a file, not a directory')

"""Where a published number came from: code, packages, machine, time.

Every benchmark in ``experiments/`` records, through :mod:`experiments._runs`,
the :func:`collect` record of the process that trained each run (in the run
directory, ``provenance.json``) and of the process that wrote the results
file. A record names the git commit of the code and whether the working tree
differed from it, the versions of the packages that decide the numerics, the
JAX devices and the host, and the UTC time.
"""

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
from typing import Any

# Packages whose versions are recorded; the numerics depend on them.
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'numpy', 'ml_collections',
            'orbax-checkpoint')

# The repository the experiments live in.
REPO = pathlib.Path(__file__).resolve().parent.parent

FILE = 'provenance.json'


def _git(*args: str) -> str | None:
  """``git -C REPO *args``'s output (not stripped), or None on failure."""
  try:
    out = subprocess.run(['git', '-C', str(REPO), *args], check=True,
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout


def git_state() -> dict[str, Any]:
  """``{'commit', 'dirty', 'dirty_files'}`` of the repository. ``dirty``
  counts tracked files that differ from the commit and untracked files under
  ``loc_opt/``, ``experiments/`` and ``configs/`` (the code a run executes).

  Outside a git checkout (a copy of the tree sent to an accelerator machine,
  say) ``commit`` is ``$LOC_OPT_COMMIT`` when set, else None, and ``dirty``
  is None: nothing can tell whether the copy matches that commit.
  """
  commit = (_git('rev-parse', 'HEAD') or '').strip() or None
  if commit is None:
    return {'commit': os.environ.get('LOC_OPT_COMMIT') or None,
            'dirty': None, 'dirty_files': []}
  status = _git('status', '--porcelain', '--', 'loc_opt', 'experiments',
                'configs', 'pyproject.toml') or ''
  files = sorted(line[3:] for line in status.splitlines() if line.strip())
  return {'commit': commit, 'dirty': bool(files), 'dirty_files': files}


def package_versions() -> dict[str, str | None]:
  """The installed version of each of :data:`PACKAGES` (None if absent) and
  of Python."""
  out: dict[str, str | None] = {'python': platform.python_version()}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def device_description() -> dict[str, Any]:
  """The JAX backend and devices this process computes on, and the host."""
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  kinds = sorted({d.device_kind for d in devices})
  return {'platform': devices[0].platform, 'device_kind': ', '.join(kinds),
          'device_count': len(devices), 'process_count': jax.process_count(),
          'host_cpus': os.cpu_count(), 'host_machine': platform.machine(),
          'host_processor': platform.processor() or None,
          'host_system': platform.platform()}


def collect() -> dict[str, Any]:
  """The provenance of this process now: git state, package versions,
  devices and the UTC time."""
  now = datetime.datetime.now(datetime.timezone.utc)
  return {**git_state(), 'packages': package_versions(),
          'device': device_description(),
          'time_utc': now.isoformat(timespec='seconds')}


def read(directory: str | os.PathLike) -> dict[str, Any] | None:
  """The provenance record in ``directory``, or None."""
  path = pathlib.Path(directory) / FILE
  if not path.exists():
    return None
  return json.loads(path.read_text())


def record(directory: str | os.PathLike, **extra: Any) -> dict[str, Any]:
  """Writes :func:`collect` plus ``extra`` to ``directory/provenance.json``
  and returns it."""
  value = {**collect(), **extra}
  path = pathlib.Path(directory)
  path.mkdir(parents=True, exist_ok=True)
  tmp = path / (FILE + '.tmp')
  tmp.write_text(json.dumps(value, indent=2, default=str))
  os.replace(tmp, path / FILE)
  return value

r"""The command-line launcher: ``loc-opt-train`` and ``loc-opt-export``.

Installed with the trainer extra (``pip install 'loc_opt[train]'``)::

  loc-opt-train --config=diloco_lm:mlp --workdir=DIR \
    [--config.outer.method=streaming_diloco] [--cpu_devices=8]
  loc-opt-export --workdir=DIR --out=DIR/export

``python -m loc_opt.launch`` is ``loc-opt-train``; in a clone
``python -m experiments.train`` is too. ``--config`` takes a config shipped
with the package by name (``diloco_lm``, ``diloco_lm:mlp``; the files of
the repository's ``configs/`` directory, installed as ``loc_opt.configs``)
or a config file by path (``my_config.py[:arg]``). A run resumes from the
latest checkpoint in its workdir.

Usage and config errors (a bad field, a workdir that is a file, a data_dir
that does not exist) are one line, ``error: ...``, on standard error with
exit code 2, before any dataset is built or program compiled;
``LOC_OPT_TRACEBACK=1`` shows the traceback instead.

Several processes (one per host) join one run through
``jax.distributed.initialize`` (see ``docs/multihost.md``):

* ``--distributed=auto`` (default): join when the process layout flags
  (``--coordinator_address``, ``--num_processes``, ``--process_id``) are
  given, or when a multi-process cluster launch is detected from its
  environment (SLURM with more than one task, Open MPI with more than one
  rank, a multi-host Cloud TPU VM or a multislice TPU job); then
  ``jax.distributed.initialize`` takes the flags given and detects the rest.
  A single-process run initialises nothing.
* ``--distributed=on``: always call ``jax.distributed.initialize`` (with
  the flags given, auto-detecting the rest).
* ``--distributed=off``: never (the flags must then be absent).

On the CPU, cross-process collectives use gloo; each process creates
``--cpu_devices`` virtual devices. ``--local_processes=N`` starts N
processes itself on this machine, each pinned to its share of the CPU cores
(``loc_opt.train.local_launch``).

On a machine without a GPU/TPU plugin, ``--reuse_host_memory=auto``
(default) keeps freed host memory for reuse (``loc_opt.parallel.host_memory``),
so that XLA:CPU does not map and zero-fill each step's temporary buffer
afresh. ``off`` restores glibc's defaults.
"""

import contextlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence

from absl import app
from absl import flags
from absl import logging

# What the launcher needs beyond the core (the ``train`` extra).
TRAIN_EXTRA_MODULES = ('flax', 'orbax.checkpoint', 'tensorflow_datasets',
                       'array_record', 'ml_collections', 'tensorboardX')
TRAIN_EXTRA_INSTALL = "pip install 'loc_opt[train]'"
# Set to 1 to see the traceback of a usage or config error.
TRACEBACK_ENV = 'LOC_OPT_TRACEBACK'


class UsageError(Exception):
  """A bad command line or config: reported in one line, exit code 2."""


def missing_train_extra() -> list[str]:
  """The trainer's modules that do not import here (none: all present)."""
  missing = []
  for name in TRAIN_EXTRA_MODULES:
    try:
      found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
      found = False
    if not found:
      missing.append(name.split('.')[0])
  return missing


def fail(message: str, code: int = 2):
  """Prints ``error: message`` on standard error and exits with ``code``."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


@contextlib.contextmanager
def usage_errors(kinds: tuple[type[BaseException], ...] = (Exception,)
                 ) -> Iterator[None]:
  """Inside the block, an error of ``kinds`` ends the program in one line
  with exit code 2 (with ``LOC_OPT_TRACEBACK=1``: it propagates)."""
  try:
    yield
  except kinds as e:  # pylint: disable=broad-except
    if os.environ.get(TRACEBACK_ENV, '') not in ('', '0'):
      raise
    text = str(e) or type(e).__name__
    if isinstance(e, KeyError) and e.args:
      text = str(e.args[0])
    fail(' '.join(text.split()))


# The errors of a bad config, path or command line (raised by the checks,
# never by a computation).
def _config_errors() -> tuple[type[BaseException], ...]:
  from loc_opt.train import checkpoint  # pylint: disable=g-import-not-at-top
  return (UsageError, ValueError, TypeError, KeyError, OSError,
          checkpoint.CheckpointError)


# --- Configs: shipped ones by name, others by path --------------------------


def shipped_configs_dir() -> pathlib.Path | None:
  """The directory of the configs shipped as ``loc_opt.configs`` (the
  repository's ``configs/``), or None if there is none."""
  try:
    spec = importlib.util.find_spec('loc_opt.configs')
  except (ImportError, ValueError):
    spec = None
  if spec is not None and spec.submodule_search_locations:
    return pathlib.Path(list(spec.submodule_search_locations)[0])
  clone = pathlib.Path(__file__).resolve().parent.parent / 'configs'
  return clone if (clone / 'diloco_lm.py').is_file() else None


def shipped_configs() -> list[str]:
  """Names of the shipped configs (``diloco_lm``, ...)."""
  where = shipped_configs_dir()
  if where is None:
    return []
  return sorted(p.stem for p in where.glob('*.py') if not p.name.startswith('_'))


def resolve_config(value: str) -> str:
  """``NAME[:arg]`` or ``PATH[:arg]`` to ``PATH[:arg]`` of an existing file.

  Raises:
    UsageError: if it is neither a file nor a shipped config.
  """
  path, sep, arg = value.partition(':')
  if os.path.isfile(path):
    return value
  if os.path.isdir(path):
    raise UsageError(f'--config={value}: {path} is a directory, not a config '
                     'file')
  name = path[:-3] if path.endswith('.py') else path
  names = shipped_configs()
  if name in names and os.sep not in name:
    return f'{shipped_configs_dir() / (name + ".py")}{sep}{arg}'
  raise UsageError(f'--config={value}: no such config file, and not a config '
                   f'shipped with loc_opt ({", ".join(names) or "none found"})')


def _resolve_config_argv(argv: Sequence[str]) -> list[str]:
  """``argv`` with its ``--config`` value resolved to a file path."""
  out = list(argv)
  for i, a in enumerate(out):
    if a.startswith('--config='):
      out[i] = '--config=' + resolve_config(a[len('--config='):])
    elif a == '--config' and i + 1 < len(out):
      out[i + 1] = resolve_config(out[i + 1])
  return out


# --- Paths: checked before anything is built --------------------------------


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def check_workdir(workdir: str) -> None:
  """Raises UsageError unless ``workdir`` is (or can be made) a writable
  directory; creates nothing."""
  if not workdir:
    raise UsageError('--workdir must be given (checkpoints and metrics go '
                     'there)')
  path = pathlib.Path(workdir).expanduser().absolute()
  if path.exists():
    if not path.is_dir():
      raise UsageError(f'--workdir={workdir} is a file, not a directory')
    if not os.access(path, os.W_OK | os.X_OK):
      raise UsageError(f'--workdir={workdir} is not writable')
    return
  parent = _nearest_existing(path.parent)
  if not parent.is_dir():
    raise UsageError(f'--workdir={workdir} cannot be created: {parent} is a '
                     'file')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UsageError(f'--workdir={workdir} cannot be created: {parent} is '
                     'not writable')


def default_data_dir() -> pathlib.Path:
  """TFDS's data directory, the documented cache: ``$TFDS_DATA_DIR``, else
  ``~/tensorflow_datasets``."""
  return pathlib.Path(os.environ.get('TFDS_DATA_DIR')
                      or '~/tensorflow_datasets').expanduser().absolute()


def check_data_dir(data_dir: str, workdir: str) -> None:
  """Raises UsageError for a ``data.data_dir`` that does not exist, unless
  it lies under the workdir or the TFDS cache (where it is created)."""
  if not data_dir:
    return  # the TFDS cache
  path = pathlib.Path(data_dir).expanduser().absolute()
  if path.exists():
    if not path.is_dir():
      raise UsageError(f'data.data_dir={data_dir} is a file, not a directory')
    return
  roots = (pathlib.Path(workdir).expanduser().absolute(), default_data_dir())
  if any(path.is_relative_to(r) for r in roots):
    return
  raise UsageError(
      f'data.data_dir={data_dir} does not exist; create it, leave it empty '
      f'for the TFDS cache ({roots[1]}), or put it under the workdir')


# --- loc-opt-train ------------------------------------------------------------

try:
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
except ImportError:  # the core install: train_main says what to install
  config_flags = None

if config_flags is not None:
  _CONFIG = config_flags.DEFINE_config_file(
      'config', None, 'A shipped config by name (diloco_lm, diloco_lm:mlp, '
      '...) or a config file by path (PATH.py[:arg]).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints and metrics.')
_CPU_DEVICES = flags.DEFINE_integer(
    'cpu_devices', 8,
    'Virtual devices to create when JAX runs on the CPU (ignored on GPU/TPU); '
    'per process.')
_HOST_MEMORY = flags.DEFINE_enum(
    'reuse_host_memory', 'auto', ['auto', 'heap', 'one_arena', 'off'],
    'Keep freed host memory for reuse (glibc malloc: no mmap, no trim; '
    'one_arena: every thread in the main arena; '
    'loc_opt.parallel.host_memory), so that XLA:CPU stops mapping and '
    'zero-filling each step\'s temporary buffer afresh. auto: off where a '
    'GPU/TPU plugin is installed, else one_arena up to 4 CPU devices and '
    'heap above.')
_DISTRIBUTED = flags.DEFINE_enum(
    'distributed', 'auto', ['auto', 'on', 'off'],
    'Join a multi-process run with jax.distributed.initialize: auto = when '
    'the flags below are given or a cluster launch is detected.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None,
    'host:port of process 0 (jax.distributed.initialize).')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, 'Processes in the run.')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', None, 'This process: 0 .. num_processes - 1.')
_LOCAL_PROCESSES = flags.DEFINE_integer(
    'local_processes', 1,
    'Run as this many processes on this machine, joined by '
    'jax.distributed on a free localhost port, each pinned to its share of '
    'the CPU cores (loc_opt.train.local_launch); the CPU only. Each creates '
    '--cpu_devices devices.')
_OUT = flags.DEFINE_string(
    'out', None, 'loc-opt-export: the directory to write the model to.')
_STEP = flags.DEFINE_integer(
    'step', None, 'loc-opt-export: the checkpoint step (default: the latest).')


def cluster_detected(environ=None) -> bool:
  """Whether the environment is a multi-process cluster launch that
  ``jax.distributed.initialize()`` can configure by itself."""
  env = os.environ if environ is None else environ
  get = lambda k: env.get(k, '')
  def count(name):
    try:
      return int(get(name) or 0)
    except ValueError:
      return 0
  return (count('SLURM_NTASKS') > 1 or count('SLURM_STEP_NUM_TASKS') > 1
          or count('OMPI_COMM_WORLD_SIZE') > 1
          or ',' in get('TPU_WORKER_HOSTNAMES')
          or bool(get('MEGASCALE_COORDINATOR_ADDRESS')))


def _layout_kwargs() -> dict[str, object]:
  return {k: v for k, v in (('coordinator_address', _COORDINATOR.value),
                            ('num_processes', _NUM_PROCESSES.value),
                            ('process_id', _PROCESS_ID.value))
          if v is not None}


def check_process_flags() -> None:
  """Raises UsageError for layout flags that contradict each other."""
  kwargs = _layout_kwargs()
  if _DISTRIBUTED.value == 'off' and kwargs:
    raise UsageError(f'--distributed=off but {sorted(kwargs)} given')
  if _CPU_DEVICES.value < 1:
    raise UsageError(f'--cpu_devices={_CPU_DEVICES.value} must be >= 1')
  n = _LOCAL_PROCESSES.value
  if n < 1:
    raise UsageError(f'--local_processes={n} must be >= 1')
  if n == 1:
    return
  given = [f'--{f.name}' for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)
           if f.present]
  if given:
    raise UsageError(f'--local_processes starts the processes and sets '
                     f'their layout itself; drop {", ".join(given)}')
  if _DISTRIBUTED.value == 'off':
    raise UsageError('--local_processes joins its processes with '
                     'jax.distributed, which --distributed=off forbids')
  from loc_opt.parallel import host_memory  # pylint: disable=g-import-not-at-top
  if (host_memory.accelerator_installed()
      and os.environ.get('JAX_PLATFORMS') != 'cpu'):
    raise UsageError(
        '--local_processes runs every process on the CPU, but a GPU/TPU '
        'plugin is installed: set JAX_PLATFORMS=cpu, or start one process '
        'per accelerator host (docs/multihost.md)')


def initialize_processes(jax) -> None:
  """Joins the run's processes per ``--distributed`` and the layout flags."""
  kwargs = _layout_kwargs()
  mode = _DISTRIBUTED.value
  if mode == 'off':
    return
  if mode == 'auto' and not kwargs and not cluster_detected():
    return
  from loc_opt.train import local_launch  # pylint: disable=g-import-not-at-top
  local_launch.join(jax, **kwargs)


def preflight(config, workdir: str, num_devices: int) -> None:
  """Every check of the config, the workdir and the data directory that
  needs no dataset and no compile (``num_devices``: the run's devices).

  Raises:
    UsageError, ValueError, CheckpointError: the first thing that is wrong.
  """
  # pylint: disable=g-import-not-at-top
  from loc_opt.train import checkpoint as ckpt_lib
  from loc_opt.train import config as cfg_lib
  from loc_opt.train import experiment as exp_lib
  from loc_opt.train import metrics as metrics_lib
  # pylint: enable=g-import-not-at-top
  check_workdir(workdir)
  data = config.get('data')
  check_data_dir((data.get('data_dir') if data is not None else '') or '',
                 workdir)
  exp_lib.validate_config(config, num_devices)
  metrics_lib.check_logging(config)
  config_json = cfg_lib.config_to_json(config)
  init_from = config.get('init_from')
  if (init_from is not None and init_from.get('workdir')
      and ckpt_lib.latest_step(workdir) is None):
    ckpt_lib.check_branch(init_from.workdir, init_from.step, config_json)
  elif os.path.isdir(workdir):
    ckpt_lib.check_resume(workdir, config_json)


def _stderr(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def _load_data(config) -> None:
  """Reads (building it first if needed) the run's dataset, with a line."""
  # pylint: disable=g-import-not-at-top
  from loc_opt.train import experiment as exp_lib
  from loc_opt.train import startup
  # pylint: enable=g-import-not-at-top
  name = config.data.get('dataset', 'local_text')
  where = config.data.get('data_dir') or str(default_data_dir())
  with startup.phase(f'dataset {name} (building it in {where} unless it is '
                     'there)'):
    exp_lib.load_data(config)  # kept for train_and_evaluate


def launch_locally(num_processes: int) -> int:
  """Runs this command as ``num_processes`` local processes; their exit
  code (``loc_opt.train.local_launch.run``)."""
  from loc_opt.train import local_launch  # pylint: disable=g-import-not-at-top
  return local_launch.run(
      [sys.executable, '-m', 'loc_opt.launch', *sys.argv[1:],
       '--local_processes=1'], num_processes)


def _train(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    fail(f'unexpected arguments: {" ".join(argv[1:])}')
  config, workdir = _CONFIG.value, _WORKDIR.value
  with usage_errors(_config_errors()):
    if config is None:
      raise UsageError('--config must be given: a shipped config by name '
                       f'({", ".join(shipped_configs())}) or a file')
    check_process_flags()
    if _LOCAL_PROCESSES.value != 1:
      preflight(config, workdir,
                _LOCAL_PROCESSES.value * _CPU_DEVICES.value)
  if _LOCAL_PROCESSES.value != 1:
    sys.exit(launch_locally(_LOCAL_PROCESSES.value))
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # Quiet JAX's backend probing.
  from loc_opt.parallel import host_memory  # pylint: disable=g-import-not-at-top
  # Before the backend's threads start.
  host_memory.setup(_HOST_MEMORY.value, _CPU_DEVICES.value)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_num_cpu_devices', _CPU_DEVICES.value)
  initialize_processes(jax)
  # pylint: disable=g-import-not-at-top
  from loc_opt import train
  from loc_opt.train import preemption
  from loc_opt.train import run_errors
  from loc_opt.train import startup
  # pylint: enable=g-import-not-at-top
  with usage_errors(_config_errors()):
    preflight(config, workdir, jax.device_count())
  writer = jax.process_index() == 0
  # A fault ends in one line and a documented code (run_errors); a signal
  # before the first step too (preemption.startup_signals), after it the
  # run saves and returns its exit code.
  with run_errors.one_line(workdir), preemption.startup_signals(), \
      startup.report_to(_stderr if writer else None):
    # A dataset that is missing or cannot be built is an error of the
    # config too; it is read before anything compiles.
    with usage_errors((FileNotFoundError, NotADirectoryError,
                       PermissionError)):
      _load_data(config)
    summary = train.train_and_evaluate(config, workdir)
  if writer:
    print(train.format_summary(summary))
    print(f'metrics: {os.path.join(workdir, "metrics.jsonl")}')
  if summary.get('exit_code'):
    sys.exit(summary['exit_code'])  # 130: saved and stopped on SIGINT


def _flags_parser(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or config reported in one line."""
  with usage_errors():
    argv = [argv[0], *_resolve_config_argv(argv[1:])]
    try:
      return flags.FLAGS(argv)
    except (KeyError, AttributeError) as e:  # --config.FIELD of no field
      field = str(e.args[0] if e.args else e).strip('\'"')
      raise UsageError(f'the config has no field {field!r} (a --config.* '
                       'flag names one that is not in the config file)'
                       ) from e
    except flags.Error as e:
      text = str(e)
      if 'Traceback' in text:  # a config file that raised: its last line
        flag = text.split(': Error whilst', 1)[0]
        text = f'{flag}: {text.strip().splitlines()[-1].strip()}'
      raise UsageError(text) from e


def _require_train_extra(program: str) -> None:
  missing = missing_train_extra()
  if missing:
    fail(f'{program} needs the trainer extra ({", ".join(missing)} not '
         f'installed): {TRAIN_EXTRA_INSTALL}')


def train_main(argv: Sequence[str] | None = None) -> None:
  """``loc-opt-train``: trains from a config (see the module docstring)."""
  _require_train_extra('loc-opt-train')
  app.run(_train, argv=list(sys.argv if argv is None else argv),
          flags_parser=_flags_parser)


# --- loc-opt-export -----------------------------------------------------------


def _export(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_num_cpu_devices', _CPU_DEVICES.value)
  from loc_opt.train import export  # pylint: disable=g-import-not-at-top
  with usage_errors(_config_errors()):
    if not _WORKDIR.value or not _OUT.value:
      raise UsageError('--workdir (a run) and --out (where the model goes) '
                       'must be given')
    if not os.path.isdir(_WORKDIR.value):
      raise UsageError(f'--workdir={_WORKDIR.value} is not a directory')
    info = export.export_model(_WORKDIR.value, _OUT.value, step=_STEP.value)
  print(f'exported the {info["source"]} at step {info["step"]} to '
        f'{info["params_dir"]} (model config: {info["model_config"]})')


def export_main(argv: Sequence[str] | None = None) -> None:
  """``loc-opt-export``: writes a run's global model
  (``loc_opt.train.export.export_model``)."""
  _require_train_extra('loc-opt-export')
  app.run(_export, argv=list(sys.argv if argv is None else argv),
          flags_parser=_flags_parser)


if __name__ == '__main__':
  train_main()

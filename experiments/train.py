r"""Trains a model from an ml_collections config.

  python -m experiments.train --config=configs/diloco_lm.py --workdir=DIR \
    [--config.outer.sync_every=50] [--cpu_devices=8]

Resumes from the latest checkpoint in DIR if there is one.

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
``--cpu_devices`` virtual devices, e.g. two local processes::

  python -m experiments.train --config=... --workdir=DIR --cpu_devices=4 \
    --coordinator_address=localhost:12345 --num_processes=2 --process_id=0
  (the same with --process_id=1)

``--local_processes=N`` starts those N processes itself on this machine,
each pinned to its share of the CPU cores (``loc_opt.train.local_launch``);
with the workers stacked in one group of devices per process it is the
fastest way to simulate DiLoCo on a CPU box (``docs/benchmarks.md``)::

  python -m experiments.train --config=configs/diloco_lm.py --workdir=DIR \
    --config.mesh.simulate_workers=True --config.mesh.data=1 \
    --cpu_devices=1 --local_processes=2

On a machine without a GPU/TPU plugin, ``--reuse_host_memory=auto``
(default) keeps freed host memory for reuse (``loc_opt.parallel.host_memory``),
so that XLA:CPU does not map and zero-fill each step's temporary buffer
afresh: 1.46x the tokens/s of the 853k reference LM on 2 cores
(``docs/benchmarks.md``). ``off`` restores glibc's defaults.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.')
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
flags.mark_flags_as_required(['config', 'workdir'])


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


def initialize_processes(jax) -> None:
  """Joins the run's processes per ``--distributed`` and the layout flags."""
  kwargs = {k: v for k, v in (('coordinator_address', _COORDINATOR.value),
                              ('num_processes', _NUM_PROCESSES.value),
                              ('process_id', _PROCESS_ID.value))
            if v is not None}
  mode = _DISTRIBUTED.value
  if mode == 'off':
    if kwargs:
      raise app.UsageError(f'--distributed=off but {sorted(kwargs)} given')
    return
  if mode == 'auto' and not kwargs and not cluster_detected():
    return
  # Harmless off the CPU; on the CPU, cross-process collectives need it.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(**kwargs)


def launch_locally(num_processes: int) -> int:
  """Runs this command as ``num_processes`` local processes; their exit
  code (``loc_opt.train.local_launch.run``)."""
  if num_processes < 1:
    raise app.UsageError(f'--local_processes={num_processes} must be >= 1')
  given = [f'--{f.name}' for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)
           if f.present]
  if given:
    raise app.UsageError(f'--local_processes starts the processes and sets '
                         f'their layout itself; drop {", ".join(given)}')
  if _DISTRIBUTED.value == 'off':
    raise app.UsageError('--local_processes joins its processes with '
                         'jax.distributed, which --distributed=off forbids')
  from loc_opt.parallel import host_memory  # pylint: disable=g-import-not-at-top
  if (host_memory.accelerator_installed()
      and os.environ.get('JAX_PLATFORMS') != 'cpu'):
    raise app.UsageError(
        '--local_processes runs every process on the CPU, but a GPU/TPU '
        'plugin is installed: set JAX_PLATFORMS=cpu, or start one process '
        'per accelerator host (docs/multihost.md)')
  from loc_opt.train import local_launch  # pylint: disable=g-import-not-at-top
  return local_launch.run(
      [sys.executable, '-m', 'experiments.train', *sys.argv[1:],
       '--local_processes=1'], num_processes)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
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
  from loc_opt import train  # pylint: disable=g-import-not-at-top
  summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  if jax.process_index() == 0:
    print(train.format_summary(summary))
    print(f'metrics: {os.path.join(_WORKDIR.value, "metrics.jsonl")}')


if __name__ == '__main__':
  app.run(main)

"""One run as several processes on one machine, each on its own CPU cores.

``python -m experiments.train ... --local_processes=N`` starts N copies of
itself, joined by ``jax.distributed`` over a free localhost port (gloo
collectives on the CPU), the multi-process path a TPU VM pod or a GPU
cluster takes, on a laptop or a CPU box. Each copy is pinned to its own
share of the cores, so XLA:CPU sizes its thread pool to that share.

Why on the CPU: one process runs every op of a step across all its cores,
handing work between threads at each of the step's thousands of small ops;
N processes of one core each run their share of the step without those
hand-offs. With the workers stacked (``mesh.simulate_workers``) and one
group of devices per process, each process trains ``mesh.workers / N`` of
the workers and only the syncs cross processes (``docs/benchmarks.md``
has the tokens/s).

The parent only waits. A SIGTERM or SIGINT it receives goes on to every
child as a SIGTERM, which is a preemption notice: the children reach one
sync point, save a checkpoint at the same step and exit (run the same
command to resume); the parent then exits 0 after a SIGTERM and 130 after a
SIGINT; a second SIGINT kills them. Before their first step the children
have nothing to save: each stops at once with 143 (128 + SIGTERM), process
0 with one line saying so (the others keep quiet, :data:`CHILD_ENV`), and
the parent exits 128 + the signal it got (143, 130), killing any child
still running :data:`STOP_GRACE_S` seconds after the first stopped. When
one child fails, the
others would wait for it in their next collective forever: the parent
kills them and exits with the failed child's code, naming it (128 + the
signal's number when a signal killed it: 137 for SIGKILL).

No orphans: on Linux each child asks the kernel for a SIGKILL when its
parent dies (``prctl(PR_SET_PDEATHSIG)``, set by a small Python prelude
that then ``exec``s the child's command, so nothing runs between fork and
exec), and checks that its parent is still the launcher; so however the
launcher dies, ``kill -9`` included, its children die with it. (The
signal follows the launcher thread that started them: :func:`run` must be
called from a thread that lives as long as the run, e.g. the main one.)
Elsewhere the prelude only ``exec``s.
"""

from collections.abc import Sequence
import os
import signal
import socket
import subprocess
import sys
import time

from loc_opt import _checks

# Set in each child's environment (to the launcher's pid): a child other
# than process 0 then leaves the line of a stop before its first step to
# process 0 (``loc_opt.train.run_errors``).
CHILD_ENV = 'LOC_OPT_LOCAL_LAUNCH'
# Once a child stopped on the launcher's signal before its first step
# (code 143), how long the others may take to stop too.
STOP_GRACE_S = 5.0


def core_shares(cores: Sequence[int], num_processes: int) -> list[set[int]]:
  """The CPU cores each of ``num_processes`` processes is pinned to.

  Contiguous shares as even as they go when there are at least as many
  cores as processes (5 cores, 2 processes: ``{0, 1, 2}``, ``{3, 4}``);
  otherwise one core each, in turn (2 cores, 4 processes: ``{0}``, ``{1}``,
  ``{0}``, ``{1}``).

  Example:
    >>> core_shares([0, 1, 2, 3], 2)
    [{0, 1}, {2, 3}]
  """
  num_processes = _checks.positive_int(num_processes, 'num_processes')
  cores = sorted(cores)
  if not cores:
    raise ValueError('no CPU cores to share')
  if num_processes > len(cores):
    return [{cores[i % len(cores)]} for i in range(num_processes)]
  base, extra = divmod(len(cores), num_processes)
  shares, start = [], 0
  for i in range(num_processes):
    size = base + (i < extra)
    shares.append(set(cores[start:start + size]))
    start += size
  return shares


def free_port() -> int:
  """A TCP port on localhost that was free a moment ago."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def process_flags(num_processes: int, process_id: int,
                  port: int) -> list[str]:
  """The flags that make a copy of the launcher process ``process_id`` of
  ``num_processes`` (``experiments.train``'s layout flags)."""
  return [f'--coordinator_address=localhost:{port}',
          f'--num_processes={num_processes}', f'--process_id={process_id}']


def join(jax, **layout) -> None:
  """Joins this process to its run: gloo for cross-process collectives on
  the CPU (harmless elsewhere), then ``jax.distributed.initialize(**layout)``
  (``coordinator_address``, ``num_processes``, ``process_id``; those absent
  JAX detects)."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(**layout)


# Run in each child before its command: SIGKILL when the parent dies
# (PR_SET_PDEATHSIG = 1), unless the parent is already gone; then exec.
_PRELUDE = """
import ctypes, os, signal, sys
parent, argv = int(sys.argv[1]), sys.argv[2:]
if sys.platform.startswith('linux'):
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:
    sys.exit('local_launch: prctl(PR_SET_PDEATHSIG) failed: '
             + os.strerror(ctypes.get_errno()))
  if os.getppid() != parent:
    os._exit(128 + signal.SIGKILL)
os.execv(argv[0], argv)
"""


def exit_code(code: int) -> int:
  """A child's return code as a shell reports it: ``128 + n`` for one
  killed by signal ``n`` (``subprocess`` says ``-n``)."""
  return 128 - code if code < 0 else code


def _start(command, i, num_processes, port, cores):
  # The child inherits this thread's cores: pin it for the spawn and back
  # (a preexec_fn would make subprocess fork, unsafe once JAX's threads run).
  own = os.sched_getaffinity(0)
  if cores is not None:
    os.sched_setaffinity(0, cores)
  try:
    return subprocess.Popen(
        [sys.executable, '-c', _PRELUDE, str(os.getpid()), *command,
         *process_flags(num_processes, i, port)],
        start_new_session=True,
        env=dict(os.environ, **{CHILD_ENV: str(os.getpid())}))
  finally:
    os.sched_setaffinity(0, own)


def _signal_all(procs, sig) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, sig)
      except ProcessLookupError:
        pass


def _stopped_before_training(procs, signum: int, over: bool) -> int:
  """The launcher's code once its children stopped on its signal before
  their first step: ``128 + signum`` (143, 130). Kills those still running
  when ``over`` (they wait for one that left); says so in one line when
  process 0 could not (a signal's default action ended it)."""
  if over:
    _signal_all(procs, signal.SIGKILL)
  codes = [p.wait() for p in procs]
  if over or codes[0] < 0:
    print(f'local_launch: stopped on {signal.Signals(signum).name} before '
          'the first step; nothing was saved (run the same command to '
          'start or resume)', file=sys.stderr)
  return 128 + signum


def run(command: Sequence[str], num_processes: int, *, pin: bool = True,
        poll_s: float = 0.1) -> int:
  """Runs ``command`` as ``num_processes`` processes of one run.

  Each copy gets :func:`process_flags` appended (one free port for all) and,
  with ``pin``, its share of this process's cores (:func:`core_shares`).
  Returns 0 when every copy exits 0 (130 when they saved and stopped on a
  SIGINT to this process); otherwise kills the copies still running,
  prints which one failed, and returns its exit code (128 + the signal's
  number when one killed it). Call it from a thread that lives as long as
  the run (the children die with that thread, see the module doc).
  """
  num_processes = _checks.positive_int(num_processes, 'num_processes')
  shares = (core_shares(os.sched_getaffinity(0), num_processes) if pin
            else [None] * num_processes)
  port = free_port()
  procs = []
  interrupts = []

  def forward(signum, frame):  # pylint: disable=unused-argument
    interrupts.append(signum)
    if signum == signal.SIGINT and interrupts.count(signal.SIGINT) > 1:
      _signal_all(procs, signal.SIGKILL)
    else:
      _signal_all(procs, signal.SIGTERM)

  def stopped(code):  # a child stopped on the forwarded notice, unsaved
    return (bool(interrupts) and code is not None
            and exit_code(code) == 128 + signal.SIGTERM)

  previous = {s: signal.signal(s, forward)
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for i in range(num_processes):
      procs.append(_start(command, i, num_processes, port, shares[i]))
    first_stop = None
    while True:
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes)
                if c not in (None, 0) and not stopped(c)]
      if any(c is not None and stopped(c) for c in codes):
        first_stop = first_stop or time.monotonic()
        over = time.monotonic() - first_stop > STOP_GRACE_S
        if over or (all(c is not None for c in codes) and not failed):
          return _stopped_before_training(procs, interrupts[0], over)
      if failed:
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
          p.wait()
        i = failed[0]
        code = exit_code(codes[i])
        how = f'exited with code {code}'
        if codes[i] < 0:
          try:
            name = signal.Signals(-codes[i]).name
          except ValueError:
            name = f'signal {-codes[i]}'
          how = f'was killed by {name} (exit code {code})'
        print(f'local_launch: process {i} of {num_processes} {how}; '
              'stopped the others', file=sys.stderr)
        return code
      if all(c == 0 for c in codes):
        return 128 + signal.SIGINT if signal.SIGINT in interrupts else 0
      time.sleep(poll_s)
  finally:
    _signal_all(procs, signal.SIGKILL)
    for s, handler in previous.items():
      signal.signal(s, handler)

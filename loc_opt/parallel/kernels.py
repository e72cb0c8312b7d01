"""Device time spent while a collective is in flight, from a JAX profile.

:func:`loc_opt.parallel.collective_schedule` says which instructions a
scheduled program runs between a collective's start and its done; a
profile (``jax.profiler.trace(dir, create_perfetto_trace=True)``) says how
long each instruction's kernels took on the device. Together they give the
device time a transfer can hide behind: a cross-worker all-reduce is hidden
in full when it takes no longer than the kernels scheduled while it is in
flight.

The Perfetto trace names, for each device kernel, the HLO instruction that
launched it (``args.hlo_op``) and its module (``args.hlo_module``). On GPU,
XLA groups runs of kernels into command buffers (CUDA graphs) whose kernels
name the buffer (``command_buffer_12``), not an instruction: profile with
``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to attribute every kernel.
:func:`unattributed` lists the kernels of a call that name no instruction
of the module.

Example::

  trace = load_trace(trace_path)
  kernels = read_kernels(trace)
  for start, end in host_spans(trace, 'my_step'):
    call = between(kernels, start, end)
    for span in collective_schedule(compiled, mesh):
      print(span.start.name, in_flight(span, call).seconds)
"""

from collections.abc import Iterable
from collections.abc import Sequence
import dataclasses
import gzip
import json
import os
import re
from typing import Any

from loc_opt.parallel import schedule


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One device kernel of a profile.

  Attributes:
    name: the kernel's name.
    hlo_op: the HLO instruction that launched it (or a command buffer).
    hlo_module: the HLO module of that instruction.
    start_us: when it started, microseconds on the trace's clock.
    duration_us: how long it ran, microseconds.
  """

  name: str
  hlo_op: str
  hlo_module: str
  start_us: float
  duration_us: float


@dataclasses.dataclass(frozen=True)
class InFlight:
  """The kernels of one call that ran while a collective was in flight.

  Attributes:
    kernels: how many there were.
    seconds: their device time, summed. Kernels of one stream run one
      after another, so on one stream this is the time they kept the device
      busy; kernels of other streams (a collective's, say) may overlap
      them, and a sum over several streams can exceed the wall time.
  """

  kernels: int
  seconds: float


def load_trace(path: 'str | os.PathLike') -> dict | list:
  """A Chrome / Perfetto JSON trace (``.json`` or ``.json.gz``), loaded once
  to hand to the functions here."""
  path = os.fspath(path)
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rt') as f:
    return json.load(f)


def _events(trace: 'str | os.PathLike | dict | list') -> list[dict[str, Any]]:
  if isinstance(trace, (str, os.PathLike)):
    trace = load_trace(trace)
  events = trace.get('traceEvents', []) if isinstance(trace, dict) else trace
  if not isinstance(events, list):
    raise ValueError('not a Chrome/Perfetto trace: no list of traceEvents')
  return events


def read_kernels(trace: 'str | os.PathLike | dict | list') -> list[Kernel]:
  """The device kernels of a trace (a ``perfetto_trace.json.gz`` path or its
  loaded JSON) that name an HLO instruction, in start order.

  Device processes are those the trace's metadata names ``/device:...``.

  Raises:
    ValueError: the trace has no device process (a CPU-only profile has
      none: there the host threads run the kernels).
  """
  events = _events(trace)
  devices = {e.get('pid') for e in events
             if e.get('ph') == 'M' and e.get('name') == 'process_name'
             and str(e.get('args', {}).get('name', '')).startswith('/device:')}
  if not devices:
    raise ValueError('the trace has no device process (/device:...)')
  out = [Kernel(e.get('name', ''), e['args']['hlo_op'],
                e['args'].get('hlo_module', ''), float(e['ts']),
                float(e.get('dur', 0.0)))
         for e in events
         if e.get('ph') == 'X' and e.get('pid') in devices
         and 'hlo_op' in e.get('args', {})]
  return sorted(out, key=lambda k: k.start_us)


def host_spans(trace: 'str | os.PathLike | dict | list',
               name: str) -> list[tuple[float, float]]:
  """``(start_us, end_us)`` of every complete event called ``name`` (a
  ``jax.profiler.TraceAnnotation``, say), in start order."""
  return sorted((float(e['ts']), float(e['ts']) + float(e.get('dur', 0.0)))
                for e in _events(trace)
                if e.get('ph') == 'X' and e.get('name') == name)


def between(kernels: Iterable[Kernel], start_us: float, end_us: float,
            hlo_module: str | None = None) -> list[Kernel]:
  """The kernels that started in ``[start_us, end_us]`` (of ``hlo_module``
  when given): those of one call, when its annotation waited for it."""
  return [k for k in kernels if start_us <= k.start_us <= end_us
          and (hlo_module is None or k.hlo_module == hlo_module)]


def in_flight(span: schedule.CollectiveSpan,
              kernels: Sequence[Kernel]) -> InFlight:
  """The kernels among ``kernels`` (one call of the span's program) that
  instructions scheduled between the span's start and done launched."""
  names = {n.name for n in span.between}
  hits = [k for k in kernels if k.hlo_op in names]
  return InFlight(len(hits), sum(k.duration_us for k in hits) * 1e-6)


_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=', re.M)


def unattributed(kernels: Iterable[Kernel], hlo_text: str) -> list[Kernel]:
  """The kernels whose ``hlo_op`` is no instruction of the module printed
  in ``hlo_text`` (command buffers, or another module's kernels)."""
  names = set(_INSTR.findall(hlo_text))
  return [k for k in kernels if k.hlo_op not in names]

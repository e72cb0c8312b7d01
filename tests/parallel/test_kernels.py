"""loc_opt.parallel.kernels: device time in flight, from a profile."""

import gzip
import json
import pathlib

import jax
import pytest

from loc_opt import parallel
from loc_opt.parallel import kernels
from loc_opt.parallel import schedule
from tests.parallel import test_schedule


def event(name, hlo_op, ts, dur, pid=1, module='jit_w'):
  return {'ph': 'X', 'pid': pid, 'tid': 7, 'ts': ts, 'dur': dur,
          'name': name, 'args': {'hlo_op': hlo_op, 'hlo_module': module}}


# A profile of one call of test_schedule.GPU_LIKE on the device (pid 1):
# the cuBLAS GEMM and the fusion run while %ars is in flight; a kernel
# before it, one in a command buffer, and one of another module; a host
# thread's event that names an instruction too.
TRACE = {'traceEvents': [
    {'ph': 'M', 'pid': 1, 'name': 'process_name',
     'args': {'name': '/device:GPU:0'}},
    {'ph': 'M', 'pid': 9, 'name': 'process_name',
     'args': {'name': '/host:CPU'}},
    {'ph': 'X', 'pid': 9, 'tid': 1, 'ts': 5.0, 'dur': 100.0, 'name': 'w'},
    event('fusion_f', 'f', 40.0, 8.0),  # out of start order
    event('sm90_gemm', 'gemm', 30.0, 6.0),
    event('cast', 'g', 10.0, 2.0),
    event('sm90_gemm', 'command_buffer_3', 50.0, 4.0),
    event('other', 'f', 60.0, 3.0, module='jit_other'),
    event('host_side', 'gemm', 30.0, 1.0, pid=9),
    event('late', 'ard', 200.0, 1.0),
]}


def test_in_flight_sums_the_kernels_launched_between_start_and_done():
  ars = schedule.collective_schedule(test_schedule.GPU_LIKE,
                                     test_schedule.mesh())[0]
  found = kernels.read_kernels(TRACE)
  assert [k.start_us for k in found] == sorted(k.start_us for k in found)
  assert all(k.hlo_op != 'gemm' or k.duration_us == 6.0 for k in found)
  (span,) = kernels.host_spans(TRACE, 'w')
  assert span == (5.0, 105.0)
  call = kernels.between(found, *span, hlo_module='jit_w')
  assert [k.name for k in call] == ['cast', 'sm90_gemm', 'fusion_f',
                                    'sm90_gemm']
  hidden = kernels.in_flight(ars, call)
  assert hidden.kernels == 2
  assert hidden.seconds == pytest.approx(14e-6)
  # The command buffer's kernel names no instruction of the module.
  assert [k.hlo_op for k in kernels.unattributed(
      call, test_schedule.GPU_LIKE)] == ['command_buffer_3']


def test_a_trace_without_a_device_is_refused(tmp_path):
  path = tmp_path / 't.json'
  path.write_text(json.dumps({'traceEvents': TRACE['traceEvents'][1:]}))
  with pytest.raises(ValueError, match='no device process'):
    kernels.read_kernels(path)
  with pytest.raises(ValueError, match='traceEvents'):
    kernels.read_kernels({'traceEvents': {}})


# One call of the Streaming DiLoCo window (tau = 2, 12.85M-parameter LM,
# bf16, AdamW) on an H100 under JAX's mock client (4 workers, collectives
# mocked), profiled with GPU command buffers off, and its optimized HLO:
# experiments/reference/overlap_h100.sh (run on 2026-11-27), the trace
# trimmed to that call's kernels.
GPU_HLO = pathlib.Path(__file__).parent / 'gpu_hlo'


def test_h100_profile_of_the_streaming_window():
  text = gzip.decompress(
      (GPU_HLO / 'h100_streaming_window.hlo.gz').read_bytes()).decode()
  trace = kernels.load_trace(GPU_HLO / 'h100_streaming_window.trace.json.gz')
  found = kernels.read_kernels(trace)
  (span,) = kernels.host_spans(trace, 'streaming_diloco/window')
  call = kernels.between(found, *span)
  # Every kernel names an instruction of the module (no command buffers).
  assert len(call) == 914 and not kernels.unattributed(call, text)
  mesh4 = parallel.make_worker_mesh(4, devices=jax.devices()[:4])
  (fragment,) = [s for s in schedule.collective_schedule(text, mesh4)
                 if s.is_async]
  hidden = kernels.in_flight(fragment, call)
  busy = sum(k.duration_us for k in call) * 1e-6
  # The fragment's all-reduce is in flight over about a ninth of the
  # window's device time (0.81 of 7.2 ms): the merge step's tail.
  assert hidden.kernels == 103
  assert hidden.seconds == pytest.approx(0.81e-3, rel=0.02)
  assert busy == pytest.approx(7.19e-3, rel=0.02)

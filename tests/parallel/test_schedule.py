"""loc_opt.parallel.schedule: what a scheduled program runs while each
collective is in flight."""

import gzip
import pathlib

import jax
import pytest

from loc_opt import parallel
from loc_opt.parallel import overlap
from loc_opt.parallel import schedule
from tests.outer import test_overlap

# A scheduled module as a GPU compiler prints it, on 4 workers x 2 devices
# (device d is worker d // 2): a cross-worker all-reduce started before a
# cuBLAS GEMM of step 1 and a fusion holding a dot of step 2 and waited for
# after them; a within-worker all-reduce; a cross-worker reduce-scatter in
# an async-start / async-done pair with nothing between; a synchronous
# cross-worker all-reduce.
GPU_LIKE = r'''
HloModule window, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%fused_dot (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(f32[8,8]{1,0} %p0, f32[8,8]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(w)/overlap_step2/dot_general"}
}

%wrapped_rs (x: f32[8]) -> f32[2] {
  %x = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(f32[8]{0} %x), channel_id=3, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (g: f32[8,8], w: f32[8,8], v: f32[8]) -> (f32[8,8], f32[8,8], f32[2], f32[8,8]) {
  %g = f32[8,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %v = f32[8]{0} parameter(2)
  %ars = f32[8,8]{1,0} all-reduce-start(f32[8,8]{1,0} %g), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(w)/overlap_step0/pmean"}
  %gemm = f32[8,8]{1,0} custom-call(f32[8,8]{1,0} %w, f32[8,8]{1,0} %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(w)/overlap_step1/dot_general"}
  %f = f32[8,8]{1,0} fusion(f32[8,8]{1,0} %gemm, f32[8,8]{1,0} %w), kind=kLoop, calls=%fused_dot
  %ard = f32[8,8]{1,0} all-reduce-done(f32[8,8]{1,0} %ars)
  %within = f32[8,8]{1,0} all-reduce(f32[8,8]{1,0} %f), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
  %as = ((f32[8]{0}), f32[2]{0}) async-start(f32[8]{0} %v), calls=%wrapped_rs
  %ad = f32[2]{0} async-done(((f32[8]{0}), f32[2]{0}) %as)
  %sync = f32[8,8]{1,0} all-reduce(f32[8,8]{1,0} %ard), channel_id=4, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (f32[8,8]{1,0}, f32[8,8]{1,0}, f32[2]{0}, f32[8,8]{1,0}) tuple(%ard, %within, %ad, %sync)
}
'''


def mesh():
  return parallel.make_worker_mesh(4, data=2)


def test_spans_of_async_and_synchronous_collectives():
  ars, rs, sync = schedule.collective_schedule(GPU_LIKE, mesh())
  # The all-reduce is in flight over the GEMM and the fusion (whose dot
  # counts: called computations count whole).
  assert (ars.start.name, ars.done.name) == ('ars', 'ard')
  assert ars.is_async and ars.collective.kind == 'all-reduce'
  assert [n.name for n in ars.between] == ['gemm', 'f', 'p0', 'p1', 'd']
  assert [n.name for n in ars.matmuls] == ['gemm', 'd']
  assert schedule.steps_in_flight(ars, overlap.steps_of) == {1, 2}
  assert [n.name for n in ars.matmuls_where(overlap.step_scope(2))] == ['d']
  # The reduce-scatter starts with its async-start; nothing runs meanwhile.
  assert (rs.start.name, rs.done.name, rs.collective.name) == ('as', 'ad',
                                                               'rs')
  assert rs.is_async and rs.between == () and rs.matmuls == ()
  # A synchronous collective has no span.
  assert sync.start.name == 'sync' and not sync.is_async
  assert sync.done is None and sync.between == ()


def test_within_worker_collectives_on_request():
  spans = schedule.collective_schedule(GPU_LIKE, mesh(),
                                       cross_worker_only=False)
  assert [s.start.name for s in spans] == ['ars', 'within', 'as', 'sync']
  assert not spans[1].collective.cross_worker


def test_unscheduled_and_unmatched_modules_are_refused():
  with pytest.raises(ValueError, match='not scheduled'):
    schedule.collective_schedule(
        GPU_LIKE.replace(', is_scheduled=true', ''), mesh())
  no_done = '\n'.join(ln for ln in GPU_LIKE.splitlines() if '%ard =' not in ln)
  no_done = no_done.replace('tuple(%ard,', 'tuple(%g,').replace(
      'all-reduce(f32[8,8]{1,0} %ard)', 'all-reduce(f32[8,8]{1,0} %g)')
  with pytest.raises(ValueError, match='ars has no matching -done'):
    schedule.collective_schedule(no_done, mesh())


def test_cpu_collectives_run_synchronously():
  # A compiled CPU program is scheduled, and its collectives run whole: the
  # reader finds each and reports no span (the GPU and TPU schedulers
  # split them; docs/overlap.md).
  m = mesh()
  f = jax.jit(parallel.shard_map_workers(
      lambda x: jax.lax.pmean(x, parallel.WORKER) * 2.0, m))
  compiled = f.lower(jax.ShapeDtypeStruct((4, 16), 'float32')).compile()
  spans = schedule.collective_schedule(compiled, m)
  assert spans and all(not s.is_async and s.between == () for s in spans)
  assert {s.collective.kind for s in spans} == {'all-reduce'}
  assert schedule.is_scheduled(compiled.as_text())


# Programs XLA's GPU compiler scheduled for 4 H100s, one worker each
# (compiled without a GPU: experiments/overlap_gpu.py --target_config=
# experiments/reference/h100_target_config.pbtxt --num_layers=2
# --d_model=256 --seq_len=128 --batch=8 --hlo_dir=...; the LM with AdamW).
# The Eager window was compiled with XLA_FLAGS=
# --xla_gpu_all_reduce_combine_threshold_bytes=4000000, so that its average
# goes in two buckets, as a larger model's does at the default 30 MiB.
GPU_HLO = pathlib.Path(__file__).parent / 'gpu_hlo'


def gpu_spans(name):
  text = gzip.decompress((GPU_HLO / f'{name}.hlo.gz').read_bytes()).decode()
  mesh4 = parallel.make_worker_mesh(4, devices=jax.devices()[:4])
  spans = schedule.collective_schedule(text, mesh4)
  # The guarded mean's second round (in a branch) runs only when the plain
  # mean is not finite.
  return [s for s in spans if s.collective.branch is None]


def test_gpu_streaming_window_sends_behind_the_later_steps():
  # Streaming DiLoCo, tau = 2: [send, inner, merge]. The fragment's mean is
  # one asynchronous all-reduce, in flight while matmuls of the steps after
  # the send run, and none of the send step's.
  (span,) = gpu_spans('streaming_diloco.window')
  assert span.is_async and span.collective.cross_worker
  steps = schedule.steps_in_flight(span, overlap.steps_of)
  assert steps and 0 not in steps and steps <= {1, 2}, steps
  # What it sends is the send step's alone (no fusion ties it to step 1).
  text = gzip.decompress(
      (GPU_HLO / 'streaming_diloco.window.hlo.gz').read_bytes()).decode()
  mesh4 = parallel.make_worker_mesh(4, devices=jax.devices()[:4])
  for _, _, operands in test_overlap.user_steps(text, mesh4):
    assert operands == {0}


def test_gpu_eager_round_runs_behind_the_average():
  # Eager updates, H = 8: the round's average is in flight over the 7 inner
  # steps (one lax.scan, counted whole), read at the next sync.
  # The average goes in buckets (XLA's GPU all-reduce combiner); with two
  # collectives in flight (overlap.COMPILER_OPTIONS) every bucket is.
  spans = gpu_spans('eager_diloco.window')
  assert len(spans) >= 2 and all(s.is_async for s in spans)
  for s in spans:
    steps = schedule.steps_in_flight(s, overlap.steps_of)
    assert set(range(1, 8)) <= steps, (s.start.name, steps)


def test_gpu_diloco_sync_has_no_later_step_to_hide_behind():
  # Plain DiLoCo's sync step reads its average at once: what runs while it
  # is in flight is the step's own work (the backward of layers whose
  # gradients are not in the bucket yet), never a window step.
  spans = gpu_spans('diloco.stepTrue')
  assert spans and all(s.is_async for s in spans)
  assert all(not schedule.steps_in_flight(s, overlap.steps_of)
             for s in spans)


# Windows on 4 workers x 2 data-parallel H100s (the 4 -> 3 model of
# tests/outer/test_overlap.py, compiled without a GPU with
# overlap.COMPILER_OPTIONS: gpu_hlo/make_dp_windows.py; the batch split
# over the data axis).
def dp_flows(name):
  text = gzip.decompress(
      (GPU_HLO / f'dp_{name}.window.hlo.gz').read_bytes()).decode()
  return [(flow.node.name, users, operands)
          for flow, users, operands in test_overlap.user_steps(text)]


@pytest.mark.parametrize('name,last', [('streaming', 2), ('eager', 3)])
def test_gpu_data_parallel_windows_stay_independent(name, last):
  # Without multi_output_fusion off, the Streaming send was fused with step
  # 1's update and read its backward pass.
  flows = dp_flows(name)
  assert flows
  for node, users, operands in flows:
    assert not users & set(range(1, last)), (node, users)
    assert operands == {0}, (node, operands)


def test_gpu_data_parallel_co2_send_waits_for_the_round():
  # The limitation docs/overlap.md states: XLA's GPU all-reduce combiner
  # (left on, see overlap.COMPILER_OPTIONS) merges the data-axis gradient
  # sum CO2 sends with those of steps 1 and 2.
  (node, _, operands), = dp_flows('co2')
  assert operands >= {1, 2}, (node, operands)

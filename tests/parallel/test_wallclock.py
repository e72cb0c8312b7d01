"""The wall-clock model: collective costs, overlap, stragglers."""

import jax
import jax.numpy as jnp
import pytest

from loc_opt import parallel
from loc_opt.parallel import wallclock

GBIT = 1e9 / 8  # bytes per Gbit


def test_collective_costs_follow_the_ring_formulas():
  link = wallclock.Link(bandwidth_gbps=1.0, latency_s=0.01)
  n = GBIT  # one second of link time per payload
  assert wallclock.collective_seconds('all-reduce', n, 4, link) == \
      pytest.approx(1.5 + 6 * 0.01)
  assert wallclock.collective_seconds('all-gather', n, 4, link) == \
      pytest.approx(3.0 + 3 * 0.01)
  assert wallclock.collective_seconds('collective-permute', n, 4, link) == \
      pytest.approx(1.0 + 0.01)
  assert wallclock.collective_seconds('reduce-scatter', n, 4, link) == \
      pytest.approx(0.75 + 3 * 0.01)
  # One worker, or nothing to send: free.
  assert wallclock.collective_seconds('all-reduce', n, 1, link) == 0.0
  assert wallclock.collective_seconds('all-reduce', 0, 4, link) == 0.0
  with pytest.raises(ValueError, match='kind'):
    wallclock.collective_seconds('broadcast-ish', n, 4, link)


@pytest.mark.parametrize('kwargs, match', [
    ({'bandwidth_gbps': 0.0}, 'bandwidth_gbps'),
    ({'bandwidth_gbps': 1.0, 'latency_s': -1.0}, 'latency_s'),
])
def test_link_validates(kwargs, match):
  with pytest.raises(ValueError, match=match):
    wallclock.Link(**kwargs)


def test_blocking_communication_adds_up():
  # 10 steps of 1 s, a 2 s collective on steps 4 and 9, no overlap.
  comm = [0.0] * 10
  comm[4] = comm[9] = 2.0
  clock = wallclock.simulate(comm, step_time_s=1.0)
  assert clock.total_s == pytest.approx(14.0)
  assert clock.ideal_s == pytest.approx(10.0)
  assert clock.exposed_comm_s == pytest.approx(4.0)
  assert clock.comm_s == pytest.approx(4.0)
  assert clock.utilization == pytest.approx(10 / 14)


def test_overlap_hides_communication_up_to_its_window():
  comm = [0.0] * 10
  comm[4] = 2.0
  # Two steps of overlap hide a 2 s collective entirely.
  assert wallclock.simulate(comm, step_time_s=1.0,
                            overlap_steps=2).total_s == pytest.approx(10.0)
  # One step hides half of it.
  clock = wallclock.simulate(comm, step_time_s=1.0, overlap_steps=1)
  assert clock.total_s == pytest.approx(11.0)
  assert clock.exposed_comm_s == pytest.approx(1.0)
  # In flight at the end of the run: the run waits for it.
  late = [0.0] * 5
  late[4] = 3.0
  assert wallclock.simulate(late, step_time_s=1.0,
                            overlap_steps=4).total_s == pytest.approx(8.0)


def test_one_link_queues_collectives():
  # Collectives every step, each 1.5 s, overlap 3: the link is the
  # bottleneck, so the run takes about 1.5 s per step, not 1 s.
  comm = [1.5] * 20
  clock = wallclock.simulate(comm, step_time_s=1.0, overlap_steps=3)
  assert clock.total_s == pytest.approx(1.0 + 20 * 1.5)
  assert clock.comm_s == pytest.approx(30.0)


def test_stragglers_slow_a_synchronous_run():
  comm = [0.0] * 10
  clock = wallclock.simulate(comm, step_time_s=1.0, slowdown=2.0)
  assert clock.total_s == pytest.approx(20.0)
  assert clock.utilization == pytest.approx(0.5)
  with pytest.raises(ValueError, match='slowdown'):
    wallclock.simulate(comm, step_time_s=1.0, slowdown=0.5)
  with pytest.raises(ValueError, match='overlap_steps'):
    wallclock.simulate(comm, step_time_s=1.0, overlap_steps=-1)


def test_transfers_are_read_from_the_compiled_program():
  mesh = parallel.make_worker_mesh(4, data=2)

  def step(x):
    return jax.lax.pmean(x, 'worker')

  x = jnp.ones((4, 1000), jnp.float32)
  compiled = jax.jit(parallel.shard_map_workers(step, mesh)).lower(x).compile()
  report = parallel.collective_bytes(compiled, mesh)
  transfers = wallclock.cross_worker_transfers(report)
  assert [kind for kind, _ in transfers] == ['all-reduce']
  per_worker = sum(n for _, n in transfers)
  # Each worker's two devices each hold the 4000-byte row.
  assert 4000 <= per_worker <= 8000
  link = wallclock.Link(bandwidth_gbps=1.0)
  assert wallclock.transfers_seconds(transfers, 4, link) == pytest.approx(
      1.5 * per_worker * 8 / 1e9)

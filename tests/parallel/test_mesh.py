"""Worker meshes: axes, sizes, devices and slices."""

import dataclasses

import pytest

from loc_opt import parallel


def test_worker_mesh_axes_and_sizes():
  mesh = parallel.make_worker_mesh(4, data=2)
  assert mesh.axis_names == ('worker', 'data', 'fsdp', 'tensor')
  assert dict(mesh.shape) == {'worker': 4, 'data': 2, 'fsdp': 1, 'tensor': 1}
  assert parallel.num_workers(mesh) == 4
  assert parallel.devices_per_worker(mesh) == 2


@pytest.mark.parametrize('shape,match', [
    ((3, 2, 1, 1), 'needs 6 devices, but 8'),
    ((4, 4, 1, 1), 'needs 16 devices'),
])
def test_mesh_that_does_not_match_devices(shape, match):
  with pytest.raises(ValueError, match=match):
    parallel.make_worker_mesh(*shape)


def test_mesh_axis_sizes_must_be_positive():
  with pytest.raises(ValueError, match="'data' must be a positive int"):
    parallel.make_worker_mesh(8, data=0)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  slice_index: int


def test_multi_slice_workers_lie_inside_slices():
  # 2 slices of 4 devices, listed interleaved.
  devices = [FakeDevice(i, i % 2) for i in range(8)]
  array = parallel.arrange_devices(devices, (4, 2, 1, 1))
  for w in range(4):
    slices = {d.slice_index for d in array[w].reshape(-1)}
    assert len(slices) == 1, (w, slices)
  assert [array[w, 0, 0, 0].slice_index for w in range(4)] == [0, 0, 1, 1]
  with pytest.raises(ValueError, match='multiple of the 2 slices'):
    parallel.arrange_devices(devices, (1, 8, 1, 1))


@dataclasses.dataclass(frozen=True)
class FakeHostDevice:
  id: int
  process_index: int


def _hosts(processes, per_process):
  # Listed interleaved: the mesh groups them by process.
  return [FakeHostDevice(i, i % processes)
          for i in range(processes * per_process)]


@pytest.mark.parametrize('shape', [(2, 4, 1, 1), (4, 2, 1, 1), (8, 1, 1, 1),
                                   (1, 8, 1, 1), (1, 2, 2, 2)])
def test_workers_inside_one_process_or_spanning_whole_ones(shape):
  array = parallel.arrange_devices(_hosts(2, 4), shape)
  for w in range(shape[0]):
    held = {d.process_index for d in array[w].reshape(-1)}
    assert len(held) == 1 or held == {0, 1}
  assert [d.process_index for d in array.reshape(-1)] == [0] * 4 + [1] * 4


def test_worker_holding_part_of_a_process_is_named():
  # 3 processes x 2 devices, 2 workers of 3: worker 0 holds half of process 1.
  with pytest.raises(ValueError, match=r'worker 0 spans processes \[0, 1\] '
                     'but holds only 1 of the 2 devices of process 1'):
    parallel.arrange_devices(_hosts(3, 2), (2, 3, 1, 1))
  parallel.arrange_devices(_hosts(3, 2), (3, 2, 1, 1))
  parallel.arrange_devices(_hosts(3, 2), (1, 6, 1, 1))

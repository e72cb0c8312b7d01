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

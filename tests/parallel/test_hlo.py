"""Tests of loc_opt.parallel.hlo: collective bytes read from compiled HLO."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from loc_opt.parallel.hlo import collective_bytes

P = jax.P
N = 16  # elements per worker


def _mesh(shape=(4, 2), names=('worker', 'data'), devices=None):
  types = (jax.sharding.AxisType.Auto,) * len(shape)
  if devices is None:
    return jax.make_mesh(shape, names, axis_types=types)
  devices = np.asarray(devices).reshape(shape)
  return jax.sharding.Mesh(devices, names, axis_types=types)


@pytest.fixture(scope='module')
def mesh():
  return _mesh()


def _over_worker(mesh, f, in_specs=P('worker'), out_specs=P('worker')):
  """`f` manual over the worker axis only: replicated over `data`."""
  return jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                  axis_names={'worker'})
  )


def _manual(mesh, f, in_specs, out_specs):
  return jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )


def _one(report):
  (c,) = report.collectives
  return c


# ---------------------------------------------------------------- programs


def test_pmean_over_worker_is_cross_worker(mesh):
  f = _over_worker(mesh, lambda a: lax.pmean(a, 'worker'), out_specs=P())
  report = collective_bytes(f.lower(jnp.zeros(4 * N)).compile(), mesh)
  c = _one(report)
  # Each of the 8 devices (4 workers x 2 data replicas) sends f32[N].
  assert (c.kind, c.shape, c.bytes_per_device, c.devices) == (
    'all-reduce', f'f32[{N}]', 4 * N, 8)
  assert c.cross_worker and c.branch is None and not c.in_loop
  assert report.cross_worker_bytes == 4 * N * 8
  assert report.within_worker_bytes == 0
  assert report.num_workers == 4 and report.num_devices == 8
  assert report.cross_worker_bytes_per_worker == 4 * N * 2
  assert report.cross_worker_bytes_range == (4 * N * 8, 4 * N * 8)
  assert report.by_kind() == {'all-reduce': 4 * N * 8}


def test_lowered_and_text_inputs_agree(mesh):
  f = _over_worker(mesh, lambda a: lax.pmean(a, 'worker'), out_specs=P())
  lowered = f.lower(jnp.zeros(4 * N))
  a = collective_bytes(lowered, mesh)
  b = collective_bytes(lowered.compile().as_text(), mesh)
  assert a == b
  # Without a mesh everything is one worker.
  c = collective_bytes(lowered)
  assert (c.cross_worker_bytes, c.within_worker_bytes) == (0, 4 * N * 8)
  assert c.num_workers == 1


def test_pmean_over_data_is_within_worker(mesh):
  f = _manual(mesh, lambda a: lax.pmean(a, 'data'), P(('worker', 'data')),
              P('worker'))
  report = collective_bytes(f.lower(jnp.zeros(8 * N)).compile(), mesh)
  assert _one(report).bytes_per_device == 4 * N
  assert report.cross_worker_bytes == 0
  assert report.within_worker_bytes == 4 * N * 8


def test_all_gather(mesh):
  f = _over_worker(mesh, lambda a: lax.all_gather(a, 'worker', tiled=True))
  report = collective_bytes(f.lower(jnp.zeros(4 * N)).compile(), mesh)
  c = _one(report)
  # Operand f32[N] per device; the result is f32[4N].
  assert (c.kind, c.bytes_per_device, c.devices) == ('all-gather', 4 * N, 8)
  assert report.cross_worker_bytes == 4 * N * 8


def test_psum_scatter(mesh):
  f = _over_worker(
    mesh, lambda a: lax.psum_scatter(a, 'worker', tiled=True), in_specs=P()
  )
  report = collective_bytes(f.lower(jnp.zeros(4 * N)).compile(), mesh)
  c = _one(report)
  # Operand f32[4N] per device; the result is f32[N].
  assert (c.kind, c.shape, c.bytes_per_device) == (
    'reduce-scatter', f'f32[{4 * N}]', 16 * N)
  assert report.cross_worker_bytes == 16 * N * 8


def test_ppermute_ring_and_within_worker_swap(mesh):
  def f(a):
    ring = [(i, (i + 1) % 4) for i in range(4)]
    b = lax.ppermute(a, 'worker', ring)
    return lax.ppermute(b[: N // 2], 'data', [(0, 1), (1, 0)])

  f = _manual(mesh, f, P('worker'), P(('worker', 'data')))
  report = collective_bytes(f.lower(jnp.zeros(4 * N)).compile(), mesh)
  ring, swap = report.collectives
  assert (ring.kind, ring.devices, ring.cross_worker) == (
    'collective-permute', 8, True)
  assert (swap.devices, swap.cross_worker) == (8, False)
  assert report.cross_worker_bytes == 4 * N * 8
  assert report.within_worker_bytes == 4 * (N // 2) * 8


def test_all_to_all_sums_tuple_operands(mesh):
  f = _over_worker(mesh, lambda a: lax.all_to_all(a, 'worker', 0, 0,
                                                  tiled=True))
  report = collective_bytes(f.lower(jnp.zeros(4 * N)).compile(), mesh)
  c = _one(report)
  # XLA:CPU splits the operand into 4 chunks f32[N/4]: their sum is f32[N].
  assert (c.kind, c.bytes_per_device) == ('all-to-all', 4 * N)
  assert report.cross_worker_bytes == 4 * N * 8


def test_int8_all_reduce(mesh):
  f = _over_worker(mesh, lambda a: lax.psum(a, 'worker'), out_specs=P())
  report = collective_bytes(f.lower(jnp.zeros(4 * N, jnp.int8)), mesh)
  assert _one(report).shape == f's8[{N}]'
  assert report.cross_worker_bytes == N * 8


def test_f16_all_reduce(mesh):
  f = _over_worker(mesh, lambda a: lax.psum(a, 'worker'), out_specs=P())
  report = collective_bytes(f.lower(jnp.zeros(4 * N, jnp.float16)), mesh)
  assert _one(report).shape == f'f16[{N}]'
  assert report.cross_worker_bytes == 2 * N * 8


def test_bf16_permute(mesh):
  f = _over_worker(mesh, lambda a: lax.ppermute(a, 'worker', [(0, 3)]))
  report = collective_bytes(f.lower(jnp.zeros(4 * N, jnp.bfloat16)), mesh)
  c = _one(report)
  # XLA:CPU converts bf16 to f32 around collectives; other backends need not.
  assert c.shape in (f'bf16[{N}]', f'f32[{N}]')
  itemsize = 2 if c.shape.startswith('bf16') else 4
  # One pair of workers, once per data index.
  assert (c.bytes_per_device, c.devices) == (itemsize * N, 2)
  assert report.cross_worker_bytes == itemsize * N * 2


def test_cond_branches(mesh):
  def f(a, p):
    synced = lambda a: lax.pcast(lax.pmean(a, 'worker'), 'worker',
                                 to='varying')
    return lax.cond(p > 0, synced, lambda a: a, a)

  f = _over_worker(mesh, f, in_specs=(P('worker'), P()))
  report = collective_bytes(f.lower(jnp.zeros(4 * N), 1).compile(), mesh)
  c = _one(report)
  (name,) = report.branches
  # lax.cond's branch 0 is the false branch, 1 the true branch.
  assert c.branch == ((name, 1),)
  assert report.cross_worker_bytes == 0
  assert report.branches == {name: (0, 4 * N * 8)}
  assert report.within_worker_branches == {name: (0, 0)}
  assert report.cross_worker_bytes_range == (0, 4 * N * 8)
  assert report.by_kind() == {}


def test_fori_loop_is_flagged(mesh):
  f = _over_worker(
    mesh,
    lambda a: lax.fori_loop(0, 3, lambda i, a: a + lax.pmean(a, 'worker'), a),
  )
  report = collective_bytes(f.lower(jnp.zeros(4 * N)), mesh)
  c = _one(report)
  assert c.in_loop and c.trip_count == 3
  assert report.cross_worker_bytes == 4 * N * 8  # counted once


def test_data_parallel_gradient_step(mesh):
  def step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

  w, x = jnp.zeros((4, 3)), jnp.zeros((16, 4))
  shard = lambda spec: jax.NamedSharding(mesh, spec)
  f = jax.jit(step, in_shardings=(shard(P()), shard(P(('worker', 'data')))),
              out_shardings=shard(P()))
  report = collective_bytes(f.lower(w, x).compile(), mesh)
  assert report.cross_worker_bytes == w.nbytes * 8
  assert report.within_worker_bytes == 0


def test_permuted_device_order():
  devices = np.array(jax.devices())[[3, 1, 7, 5, 0, 2, 6, 4]]
  mesh = _mesh(devices=devices)

  def f(a):
    b = lax.ppermute(a, 'worker', [(0, 1), (1, 2), (2, 3)])
    return lax.pmean(b, 'data')

  f = _manual(mesh, f, P('worker'), P(('worker', 'data')))
  compiled = f.lower(jnp.zeros(4 * N)).compile()
  # Logical device i of the program is mesh.devices.flat[i].
  order = [d.id for d in compiled.runtime_executable().local_devices()]
  assert order == [d.id for d in mesh.devices.flat]
  for program in (compiled, compiled.as_text()):
    report = collective_bytes(program, mesh)
    assert report.cross_worker_bytes == 4 * N * 3 * 2
    assert report.within_worker_bytes == 4 * N * 8


def test_compiled_program_maps_physical_devices(mesh):
  f = _manual(mesh, lambda a: lax.pmean(a, 'data'), P(('worker', 'data')),
              P('worker'))
  compiled = f.lower(jnp.zeros(8 * N)).compile()
  # Same devices, other workers: worker w of `other` is {w, w + 4} by id, so
  # the pairs {2w, 2w + 1} averaged over `data` span two of its workers.
  devices = np.array(jax.devices())[[0, 4, 1, 5, 2, 6, 3, 7]]
  other = _mesh(devices=devices)
  assert collective_bytes(compiled, other).cross_worker_bytes == 4 * N * 8
  # Text carries no devices: logical ids index `other.devices.flat`.
  assert collective_bytes(compiled.as_text(), other).cross_worker_bytes == 0


# ---------------------------------------------------------- hand-written HLO

_ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


def _module(body, params='p: f32[16]', extra='', header='num_partitions=8'):
  """An HLO module whose ENTRY has parameter `%p` and then `body`."""
  lines = ['%p = f32[16]{0} parameter(0)'] + body.strip().splitlines()
  entry = '\n'.join(f'  {ln.strip()}' for ln in lines)
  return (
    f'HloModule m, {header}\n{_ADD}{extra}\n'
    f'ENTRY %main ({params}) -> f32[16] {{\n{entry}\n}}\n'
  )


def _all_reduce(groups, name='ar', extra=', use_global_device_ids=true'):
  return (f'%{name} = f32[16]{{0}} all-reduce(%p), channel_id=1, '
          f'replica_groups={groups}{extra}, to_apply=%add')


@pytest.mark.parametrize(
  'groups, mesh_shape, cross, devices',
  [
    ('{{0,2,4,6},{1,3,5,7}}', (4, 2), True, 8),
    ('{{0,1},{2,3},{4,5},{6,7}}', (4, 2), False, 8),
    ('{{0,1},{2,3}}', (4, 2), False, 4),
    ('{{0,1,2,3},{4,5,6,7}}', (2, 4), False, 8),
    ('{{0,4}}', (2, 4), True, 2),
    ('[4,2]<=[8]', (4, 2), False, 8),
    ('[2,4]<=[2,4]', (2, 4), False, 8),
    ('[2,4]<=[4,2]T(1,0)', (4, 2), True, 8),  # {0,2,4,6},{1,3,5,7}
    ('[4,2]<=[2,4]T(1,0)', (2, 4), True, 8),  # {0,4},{1,5},...
    ("mesh['worker'=4,'data'=2] {'data'}", (4, 2), False, 8),
    ("mesh['worker'=4,'data'=2] {'worker'}", (4, 2), True, 8),
    ("mesh['worker'=4,'data'=2] {'worker','data'}", (4, 2), True, 8),
    ("mesh['axis_0'=8] {'axis_0'}", (4, 2), True, 8),
    # With device_ids, mesh position (w, d) holds id 4d + w: {0,4} share w.
    ("mesh['worker'=4,'data'=2], device_ids=([2,4]T(1,0)) {'data'}", (4, 2),
     True, 8),
    ("mesh['a'=4,'b'=2], device_ids=(0,2,1,3,4,6,5,7) {'b'}", (4, 2), True,
     8),  # {0,2},{1,3},...
    # Sub-axis 'b':(pre)size is the middle factor of b = [pre, size, rest].
    ("mesh['a'=2,'b'=4] {'b':(1)2}", (2, 4), False, 8),  # {0,2},{1,3},...
    ("mesh['a'=4,'b'=2] {'a':(2)2}", (4, 2), True, 8),  # {0,2},{1,3},...
    ("mesh['a'=4,'b'=2] {'a':(2)2}", (2, 4), False, 8),
    ("mesh['a'=4,'b'=2] {'a':(1)2}", (2, 4), True, 8),  # {0,4},{1,5},...
    ('{}', (4, 2), True, 8),
  ],
)
def test_replica_group_formats(groups, mesh_shape, cross, devices):
  report = collective_bytes(_module(_all_reduce(groups)), _mesh(mesh_shape))
  c = _one(report)
  assert (c.cross_worker, c.devices, c.bytes_per_device) == (cross, devices, 64)


def test_worker_axis_need_not_be_outermost():
  mesh = _mesh((2, 4), ('data', 'worker'))
  text = _module(_all_reduce('{{0,1,2,3},{4,5,6,7}}'))
  assert _one(collective_bytes(text, mesh)).cross_worker
  mesh = _mesh((4, 2), ('a', 'b'))
  text = _module(_all_reduce('{{0,1},{2,3},{4,5},{6,7}}'))
  assert _one(collective_bytes(text, mesh, worker_axis='b')).cross_worker
  assert not _one(collective_bytes(text, mesh, worker_axis='a')).cross_worker


def test_group_modes():
  # Cross-replica (no channel_id) on one replica: singleton groups, no bytes.
  text = _module('%ar = f32[16]{0} all-reduce(%p), replica_groups={}, '
                 'to_apply=%add')
  assert _one(collective_bytes(text, _mesh())).devices == 0
  # Two replicas of four partitions: logical id = replica * 4 + partition.
  header = 'replica_count=2, num_partitions=4'
  a2a = '%a = f32[16]{0} all-to-all(%p), channel_id=1, replica_groups={{0,1}}'
  c = _one(collective_bytes(_module(a2a, header=header), _mesh((2, 4))))
  assert (c.devices, c.cross_worker) == (4, False)  # {0,1} and {4,5}
  ar = _all_reduce('{{0,1}}', extra='')  # cross-replica-and-partition
  c = _one(collective_bytes(_module(ar, header=header), _mesh((2, 4))))
  assert (c.devices, c.cross_worker) == (8, True)
  cp = ('%cp = f32[16]{0} collective-permute(%p), channel_id=1, '
        'source_target_pairs={{0,1},{1,2},{3,3}}')
  c = _one(collective_bytes(_module(cp, header=header), _mesh((2, 4))))
  assert (c.devices, c.cross_worker) == (4, False)  # 2 pairs x 2 replicas


def test_dtype_sizes_of_tuple_all_reduce():
  params = ('p: f32[16], b: bf16[8], q: s4[9], r: pred[3], e: f8e4m3fn[5], '
            'u: u4[2,3], d: f64[2]')
  body = """
    %b = bf16[8]{0} parameter(1)
    %q = s4[9]{0:E(4)} parameter(2)
    %r = pred[3]{0} parameter(3)
    %e = f8e4m3fn[5]{0} parameter(4)
    %u = u4[2,3]{1,0} parameter(5)
    %d = f64[2]{0} parameter(6)
    %t = (f32[16]{0}, bf16[8]{0}, s4[9]{0:E(4)}, pred[3]{0}, f8e4m3fn[5]{0}, /*index=5*/u4[2,3]{1,0}, f64[2]{0}) all-reduce(%p, %b, %q, %r, %e, %u, %d), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
    ROOT %g = f32[16]{0} get-tuple-element(%t), index=0
  """  # noqa: E501
  c = _one(collective_bytes(_module(body, params), _mesh()))
  assert c.bytes_per_device == 64 + 16 + 5 + 3 + 5 + 3 + 16
  assert c.shape.startswith('(f32[16], bf16[8], s4[9], pred[3]')
  assert c.total_bytes == c.bytes_per_device * 8 and c.cross_worker


def test_inline_operand_types_and_result_fallback():
  # Operand types printed inline; `%missing` is unknown so the all-gather
  # falls back to its result f32[64] / group size 4.
  body = """
    %a = f32[16]{0} all-reduce(bf16[32]{0} %x), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
    %g = f32[64]{0} all-gather(%missing), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}, use_global_device_ids=true
    %s = f32[4]{0} reduce-scatter(%missing), channel_id=3, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}, use_global_device_ids=true, to_apply=%add
  """  # noqa: E501
  report = collective_bytes(_module(body), _mesh())
  assert [c.bytes_per_device for c in report.collectives] == [64, 64, 64]


def test_async_pairs_count_once():
  extra = """
%wrapped (wp: f32[64]) -> f32[16] {
  %wp = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%wp), channel_id=4, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true, to_apply=%add
}
"""  # noqa: E501
  body = """
    %ars = f32[16]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
    %ard = f32[16]{0} all-reduce-done(%ars)
    %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%ard), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true
    %agd = f32[64]{0} all-gather-done(%ags)
    %st = ((f32[64]{0}), f32[16]{0}) async-start(%agd), calls=%wrapped
    %dn = f32[16]{0} async-done(%st), calls=%wrapped
    %cps = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%dn), channel_id=3, source_target_pairs={{0,2},{2,4},{4,6},{6,0}}
    ROOT %cpd = f32[16]{0} collective-permute-done(%cps)
  """  # noqa: E501
  report = collective_bytes(_module(body, extra=extra), _mesh())
  kinds = [(c.kind, c.is_async, c.bytes_per_device, c.devices)
           for c in report.collectives]
  assert kinds == [
    ('all-reduce', True, 64, 8),
    ('all-gather', True, 64, 8),
    ('reduce-scatter', True, 256, 8),
    ('collective-permute', True, 64, 4),
  ]
  assert report.within_worker_bytes == 64 * 8
  assert report.cross_worker_bytes == 64 * 8 + 256 * 8 + 64 * 4
  assert report.by_kind(cross_worker=True) == {
    'all-gather': 512,
    'reduce-scatter': 2048,
    'collective-permute': 256,
  }


def test_while_nested_conditionals_and_calls():
  cross = "replica_groups=mesh['worker'=4,'data'=2] {'worker'}"
  within = "replica_groups=mesh['worker'=4,'data'=2] {'data'}"
  ar = ('all-reduce(%{0}), channel_id=1, ' + '{1}, use_global_device_ids=true, '
        'to_apply=%add')
  extra = f"""
%body (bp: f32[16]) -> f32[16] {{
  %bp = f32[16]{{0}} parameter(0)
  ROOT %in_loop = f32[16]{{0}} all-reduce(%bp), channel_id=1, {cross}, use_global_device_ids=true, to_apply=%add
}}

%cond (cp: f32[16]) -> pred[] {{
  %cp = f32[16]{{0}} parameter(0)
  ROOT %c = pred[] constant(true)
}}

%inner_a (ia: f32[16]) -> f32[16] {{
  %ia = f32[16]{{0}} parameter(0)
  ROOT %ina = f32[16]{{0}} {ar.format('ia', cross)}
}}

%inner_b (ib: f32[16]) -> f32[16] {{
  ROOT %ib = f32[16]{{0}} parameter(0)
}}

%outer_t (ot: f32[16]) -> f32[16] {{
  %ot = f32[16]{{0}} parameter(0)
  %k = s32[] constant(0)
  %w = f32[16]{{0}} {ar.format('ot', within)}
  %x = f32[16]{{0}} {ar.format('w', cross)}
  ROOT %inner = f32[16]{{0}} conditional(%k, %x, %x), branch_computations={{%inner_a, %inner_b}}
}}

%outer_f (of: f32[16]) -> f32[16] {{
  ROOT %of = f32[16]{{0}} parameter(0)
}}

%sub (sp: f32[16]) -> f32[16] {{
  %sp = f32[16]{{0}} parameter(0)
  ROOT %called = f32[16]{{0}} {ar.format('sp', cross)}
}}
"""  # noqa: E501
  body = """
    %loop = f32[16]{0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
    %pr = pred[] constant(true)
    %outer = f32[16]{0} conditional(%pr, %loop, %loop), true_computation=%outer_t, false_computation=%outer_f
    ROOT %r = f32[16]{0} call(%outer), to_apply=%sub
  """  # noqa: E501
  report = collective_bytes(_module(body, extra=extra), _mesh())
  by_name = {c.name: c for c in report.collectives}
  assert list(by_name) == ['in_loop', 'w', 'x', 'ina', 'called']
  assert by_name['in_loop'].in_loop and by_name['in_loop'].trip_count == 5
  assert not by_name['called'].in_loop and by_name['called'].branch is None
  assert by_name['ina'].branch == (('outer', 0), ('inner', 0))
  b = 64 * 8  # bytes of one f32[16] all-reduce on 8 devices
  assert report.cross_worker_bytes == 2 * b  # in_loop (once) + called
  assert report.within_worker_bytes == 0
  # Predicate form: branch 0 is true_computation.
  assert report.branches == {'outer': (2 * b, 0), 'inner': (b, 0)}
  assert report.within_worker_branches == {'outer': (b, 0), 'inner': (0, 0)}
  assert report.cross_worker_bytes_range == (2 * b, 4 * b)
  assert report.within_worker_bytes_range == (0, b)
  summary = report.summary()
  assert 'outer[0]/inner[0]' in summary and 'loop x5' in summary


# ------------------------------------------------------------------- errors


def test_errors(mesh):
  with pytest.raises(ValueError, match='HloModule'):
    collective_bytes('this is not HLO', mesh)
  f = _over_worker(mesh, lambda a: lax.pmean(a, 'worker'), out_specs=P())
  lowered = f.lower(jnp.zeros(4 * N))
  with pytest.raises(ValueError, match='StableHLO'):
    collective_bytes(lowered.as_text(), mesh)
  with pytest.raises(ValueError, match='no ENTRY'):
    collective_bytes('HloModule m\n', mesh)
  with pytest.raises(ValueError, match="no 'worker' axis"):
    collective_bytes(lowered, _mesh(names=('a', 'b')))
  with pytest.raises(ValueError, match='8 devices but the mesh has 4'):
    collective_bytes(lowered, jax.make_mesh((4,), ('worker',),
                     axis_types=(jax.sharding.AxisType.Auto,)))
  bad = _module(_all_reduce('{{0,1},{2,oops}}'))
  with pytest.raises(ValueError, match='replica_groups'):
    collective_bytes(bad, mesh)
  bad = _module(_all_reduce('{{0,9}}'))
  with pytest.raises(ValueError, match='names device 9'):
    collective_bytes(bad, mesh)
  bad = _module(_all_reduce("mesh['a'=8] {'z'}"))
  with pytest.raises(ValueError, match="unknown mesh axis 'z'"):
    collective_bytes(bad, mesh)
  bad = _module('%ar = zz9[16]{0} all-reduce(zz9[16] %p), replica_groups={}')
  with pytest.raises(ValueError, match="element type 'zz9'"):
    collective_bytes(bad, mesh)
  with pytest.raises(TypeError):
    collective_bytes(42, mesh)

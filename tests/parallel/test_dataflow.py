"""Tests of loc_opt.parallel.dataflow: what each collective waits for and
what waits on it, in compiled programs and in hand-written HLO."""

import jax
import jax.numpy as jnp
import pytest

from loc_opt import parallel

P = jax.P


@pytest.fixture(scope='module')
def mesh():
  return jax.make_mesh((4, 2), ('worker', 'data'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def compiled(mesh, f, *args):
  """``f`` manual over the worker axis, compiled."""
  g = jax.shard_map(f, mesh=mesh, in_specs=P('worker'),
                    out_specs=P('worker'), axis_names={'worker'})
  return jax.jit(g).lower(*args).compile()


def body(consume):
  """A per-worker function: a worker mean of ``x``, and a matmul of ``y``
  under the scope ``later`` that reads the mean when ``consume``."""

  def f(x, y):
    with jax.named_scope('send'):
      mean = jax.lax.pmean(jnp.sin(x), 'worker')
    with jax.named_scope('later'):
      w = y + mean[:, :1] if consume else y
      z = jnp.tanh(w @ y.T) @ y
    return z + mean * 0.5

  return f


@pytest.mark.parametrize('consume', [False, True])
def test_later_matmul_reads_the_mean_only_when_it_consumes_it(mesh,
                                                              consume):
  x = jnp.ones((8, 4))
  y = jnp.arange(32.0).reshape(8, 4)
  (flow,) = parallel.collective_dataflow(compiled(mesh, body(consume), x, y),
                                         mesh)
  assert flow.collective.kind == 'all-reduce' and flow.collective.cross_worker
  later = flow.users_where(scope='later')
  dots = flow.users_where(opcodes=('dot',))
  if consume:
    assert later and dots
  else:
    assert not later and not dots
    # the final sum does read it
    assert flow.users
  # the sine feeds it, the matmul never does
  assert flow.operands_where(scope='send/sin')
  assert not flow.operands_where(scope='later')


def test_within_worker_collectives_are_left_out_unless_asked(mesh):
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.psum(x, 'data'), mesh=mesh,
      in_specs=P('worker', 'data'), out_specs=P('worker')))
  program = f.lower(jnp.ones((8, 4))).compile()
  assert parallel.collective_dataflow(program, mesh) == ()
  flows = parallel.collective_dataflow(program, mesh,
                                       cross_worker_only=False)
  assert flows and not flows[0].collective.cross_worker


_HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  %ar = f32[4]{0} all-reduce(%q), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %n = f32[4]{0} negate(%ar)
}

%other (r: f32[4]) -> f32[4] {
  %r = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} copy(%r)
}

ENTRY %main (x: f32[4], y: f32[4], k: s32[]) -> (f32[4], f32[], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %k = s32[] parameter(2)
  %e = f32[4]{0} exponential(%x)
  %cond = f32[4]{0} conditional(%k, %e, %y), branch_computations={%branch, %other}
  %d = f32[] dot(%y, %y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %m = f32[4]{0} multiply(%y, %y), control-predecessors={%cond}
  %u = f32[4]{0} add(%cond, %y)
  ROOT %t = (f32[4]{0}, f32[], f32[4]{0}) tuple(%u, %d, %m)
}
"""


def test_hand_written_hlo_through_a_branch_and_control_edges(mesh):
  (flow,) = parallel.collective_dataflow(_HLO, mesh)
  assert flow.node.name == 'ar' and flow.node.computation == 'branch'
  users = {n.name for n in flow.users}
  # out of the branch through its root, then the conditional's users and
  # what must run after it (a control edge)
  assert {'n', 'cond', 'u', 'm', 't'} <= users
  assert 'd' not in users and 'e' not in users
  operands = {n.name for n in flow.operands}
  # in through the branch's parameter: the conditional's operand for that
  # branch and its branch index, not the other branch's operand
  assert operands == {'q', 'e', 'x', 'k'}
  assert [n.name for n in flow.users_where(opcodes=('multiply',))] == ['m']

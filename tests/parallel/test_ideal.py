"""Tests of loc_opt.parallel.ideal: the yardstick of the within-worker
bytes."""

import jax
import jax.numpy as jnp

from loc_opt.parallel import hlo
from loc_opt.parallel import ideal

P = jax.P


def test_xla_cpu_reduces_bfloat16_in_float32():
  """The fact behind ``reduce_width('cpu')``: a bfloat16 psum compiles to a
  float32 all-reduce on XLA:CPU (if a jaxlib stops promoting it, this fails
  and the CPU yardstick should count bfloat16 again)."""
  mesh = jax.make_mesh((8,), ('x',),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, 'x'), mesh=mesh,
                               in_specs=P('x'), out_specs=P()))
  arg = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16,
                             sharding=jax.NamedSharding(mesh, P('x')))
  report = hlo.collective_bytes(psum.lower(arg).compile())
  (reduce,) = [c for c in report.collectives if c.kind == 'all-reduce']
  assert reduce.shape == 'f32[1,16]'
  assert ideal.reduce_width(2, jax.default_backend()) == 4


def test_reduce_width_by_backend():
  assert ideal.reduce_width(2, 'cpu') == 4
  assert ideal.reduce_width(2, 'gpu') == ideal.reduce_width(2, 'tpu') == 2
  assert ideal.reduce_width(4, 'cpu') == 4


def test_tensor_bytes_count_the_reduction_width():
  """Megatron's (4 L + 2) all-reduces of one device's activations, each
  counted once per device, at ``reduce_bytes`` when given."""
  layout = ideal.WorkerLayout(data=1, fsdp=2, tensor=2, param_bytes=1000,
                              rows=8, length=16, d_model=32, num_layers=3,
                              act_bytes=2)
  activation = (8 // 2) * 16 * 32 * 2
  assert ideal.tensor_bytes(layout) == 14 * activation * 4
  wide = layout._replace(reduce_bytes=4)
  assert ideal.tensor_bytes(wide) == 2 * ideal.tensor_bytes(layout)
  assert ideal.fsdp_bytes(wide) == ideal.fsdp_bytes(layout) == 4 * 1000
  assert ideal.tensor_bytes(layout._replace(tensor=1)) == 0

"""A conformance suite every loc_opt gradient transformation passes.

Call :func:`check_all` (or the single checks) from a transform's test module
with a factory ``make(learning_rate) -> GradientTransformation`` whose update
runs outside any mapped axis (e.g. ``axis_name=None`` for wrappers).
"""

from collections.abc import Callable
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

Factory = Callable[..., optax.GradientTransformation]


def example_params(dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
      'w': jax.random.normal(k1, (4, 3), dtype),
      'b': jax.random.normal(k2, (3,), dtype),
  }


def example_grads(params, step: int):
  key = jax.random.fold_in(jax.random.key(1), step)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(
      tree,
      [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)],
  )


def run(tx, params, steps: int, *, jit: bool = True, **extra):
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  fn = jax.jit(step) if jit else step
  for i in range(steps):
    params, state = fn(params, state, example_grads(params, i))
  return params, state


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(
      lambda x, y: np.testing.assert_allclose(
          np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol,
          atol=atol),
      a, b,
  )


def check_jit_matches_eager(make: Factory, steps: int = 5):
  params = example_params()
  got, _ = run(make(1e-2), params, steps, jit=True)
  want, _ = run(make(1e-2), params, steps, jit=False)
  assert_trees_close(got, want)


def check_no_recompile(make: Factory, steps: int = 4):
  tx = make(1e-2)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = example_params()
  state = tx.init(params)
  for i in range(steps):
    params, state = step(params, state, example_grads(params, i))
  assert len(traces) == 1, f'traced {len(traces)} times'


def check_extra_args(make: Factory):
  tx = optax.with_extra_args_support(make(1e-2))
  params = example_params()
  state = tx.init(params)
  grads = example_grads(params, 0)
  plain, _ = tx.update(grads, state, params)
  extra, _ = tx.update(grads, state, params, loss=jnp.asarray(1.0))
  assert_trees_close(plain, extra)


def check_dtypes(make: Factory, dtype=jnp.bfloat16):
  params = example_params(dtype)
  new_params, state = run(make(1e-2), params, 3)
  for p in jax.tree.leaves(new_params):
    assert p.dtype == dtype, p.dtype
  tx = make(1e-2)
  updates, _ = tx.update(example_grads(params, 0), tx.init(params), params)
  for u in jax.tree.leaves(updates):
    assert u.dtype == dtype, u.dtype
  assert all(np.all(np.isfinite(np.asarray(x, np.float32)))
             for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype,
                                                              jnp.floating))


def check_abstract_init(make: Factory):
  tx = make(1e-2)
  params = example_params()
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  got = jax.eval_shape(tx.init, abstract)
  want = tx.init(params)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, (g, w)


def check_sharding_stable(make: Factory):
  """State shardings on an explicit mesh do not change across steps."""
  mesh = jax.make_mesh((2,), ('fsdp',),
                       axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  params = example_params()
  params = {
      'w': jax.device_put(params['w'],
                          jax.NamedSharding(mesh, jax.P('fsdp', None))),
      'b': jax.device_put(params['b'], jax.NamedSharding(mesh, jax.P())),
  }
  tx = make(1e-2)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)
    before = [x.sharding for x in jax.tree.leaves(state)]

    @jax.jit
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    for _ in range(2):
      params, state = step(params, state, grads)
  after = [x.sharding for x in jax.tree.leaves(state)]
  for b, a, x in zip(before, after, jax.tree.leaves(state)):
    assert b.is_equivalent_to(a, x.ndim), (b, a)
  assert params['w'].sharding.spec == jax.P('fsdp', None)


def check_inject_hyperparams(make: Factory):
  """The learning rate can be changed in the state without recompiling."""
  tx = optax.inject_hyperparams(make)(learning_rate=1e-2)
  params = example_params()
  state = tx.init(params)
  grads = example_grads(params, 0)
  small, _ = tx.update(grads, state, params)
  state.hyperparams['learning_rate'] = jnp.asarray(2e-2)
  large, _ = tx.update(grads, state, params)
  assert_trees_close(jax.tree.map(lambda x: 2 * x, small), large, rtol=1e-4)


def check_checkpoint_roundtrip(make: Factory, tmp_path: pathlib.Path):
  tx = make(1e-2)
  params, state = run(tx, example_params(), 3)
  path = pathlib.Path(tmp_path) / 'state'
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = ckptr.restore(path, abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Training on from the restored state equals training on from the original
  # (the same update, the same operations, on bit-equal inputs: exact).
  grads = example_grads(params, 7)
  u1, _ = tx.update(grads, state, params)
  u2, _ = tx.update(grads, restored, params)
  assert_trees_close(u1, u2, rtol=0, atol=0)


def check_all(make: Factory, tmp_path, *, inject: bool = True):
  check_jit_matches_eager(make)
  check_no_recompile(make)
  check_extra_args(make)
  check_dtypes(make)
  check_abstract_init(make)
  check_sharding_stable(make)
  if inject:
    check_inject_hyperparams(make)
  check_checkpoint_roundtrip(make, tmp_path)

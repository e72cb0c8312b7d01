"""Checkpoint I/O (loc_opt.train.orbax_io): on CPU devices the state's
shards reach the host whole, and the files are Orbax's standard ones."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from loc_opt.train import orbax_io


def _array():
  mesh = jax.make_mesh((4, 2), ('worker', 'data'))
  x = jnp.arange(96.0).reshape(8, 12)
  return jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, 'data')))


def _manager(directory, handlers):
  kwargs = {'item_handlers': handlers} if handlers else {}
  return ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(
          enable_async_checkpointing=False), **kwargs)


def _restore(directory, handlers, like):
  target = {'x': jax.ShapeDtypeStruct(like.shape, like.dtype,
                                      sharding=like.sharding)}
  with _manager(directory, handlers) as manager:
    return manager.restore(0, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))['state']['x']


def test_cpu_saves_without_replica_parallel_slices():
  assert not orbax_io.replica_parallel_helps()  # 8 CPU devices here
  handler = orbax_io.state_handler()
  registry = handler._impl._type_handler_registry  # pylint: disable=protected-access
  assert not registry.get(jax.Array)._use_replica_parallel  # pylint: disable=protected-access
  assert isinstance(handler, ocp.StandardCheckpointHandler)


def test_files_restore_with_either_handler(tmp_path):
  x = _array()
  ours, default = tmp_path / 'ours', tmp_path / 'default'
  for directory, handlers in ((ours, orbax_io.item_handlers()),
                              (default, None)):
    with _manager(directory, handlers) as manager:
      manager.save(0, args=ocp.args.Composite(
          state=ocp.args.StandardSave({'x': x}),
          config=ocp.args.JsonSave({'seed': 0})))
  for directory in (ours, default):
    for handlers in (orbax_io.item_handlers(), None):
      y = _restore(directory, handlers, x)
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
      assert y.sharding == x.sharding

"""How the train state's arrays reach the host when Orbax saves them.

Orbax's ``ArrayHandler`` saves replicated arrays *replica-parallel* by
default (except where ``JAX_PLATFORMS`` names a GPU): each replica of a
shard copies its own slice of it to the host, so the device-to-host links
of all replicas work at once. Each slice is an eager ``lax.slice_in_dim``,
so the first save of a state compiles one small program per distinct
(shard shape, slice, device) -- on 8 virtual CPU devices nearly two hundred
of them for a run of the one-block test model, several seconds of XLA compilation that
move nothing faster: CPU devices share the host's memory, so there is no
link to parallelize.

:func:`state_handler` gives the ``StandardCheckpointHandler`` that the
trainer saves its state with: Orbax's own, with replica-parallel copies
turned off when every device is a CPU (kept on accelerators, where Orbax
chooses). The checkpoint on disk is the same either way (replica-parallel
only splits the copy; the tensorstore writes and the metadata are those of
the default handler), so checkpoints of either kind restore with either.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp


def replica_parallel_helps() -> bool:
  """Whether replica-parallel device-to-host copies can be faster here:
  not when every device is a CPU (one shared memory)."""
  return any(d.platform != 'cpu' for d in jax.devices())


def _whole_shard_registry():
  """Orbax's standard type handlers, with ``jax.Array`` shards copied to
  the host whole (``use_replica_parallel=False``); the array metadata store
  is Orbax's default one, so the files written are the same."""
  th = ocp.type_handlers
  default = th.get_type_handler(jax.Array)
  store = getattr(default, '_array_metadata_store', None)
  return th.create_type_handler_registry(
      (int, th.ScalarHandler()), (float, th.ScalarHandler()),
      (bytes, th.ScalarHandler()), (np.number, th.ScalarHandler()),
      (np.ndarray, th.NumpyHandler()),
      (jax.Array, th.ArrayHandler(use_replica_parallel=False,
                                  array_metadata_store=store)),
      (str, th.StringHandler()))


def state_handler() -> ocp.StandardCheckpointHandler:
  """The handler of the ``state`` item: Orbax's standard one, without
  replica-parallel copies where they cannot help (see the module doc)."""
  handler = ocp.StandardCheckpointHandler()
  if not replica_parallel_helps():
    # The same class (Orbax matches save args to handler classes), over
    # the registry above.
    handler._impl = ocp.PyTreeCheckpointHandler(  # pylint: disable=protected-access
        type_handler_registry=_whole_shard_registry())
  return handler


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
  """The handlers of a checkpoint's items: the state, and the JSON items
  ``config``, ``layout`` and ``digests`` (``loc_opt.train.checkpoint``)."""
  return {'state': state_handler(), 'config': ocp.JsonCheckpointHandler(),
          'layout': ocp.JsonCheckpointHandler(),
          'digests': ocp.JsonCheckpointHandler()}

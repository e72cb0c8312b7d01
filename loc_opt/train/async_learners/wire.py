"""What a learner's pseudo-gradient looks like in the store: raw float32
leaves, or each leaf through a ``loc_opt.compression`` codec (the codec's
payload arrays are what is written: int8 codes as int8, 4-bit codes two to
a byte), with error feedback kept on the learner.

The bytes counted are the codec's ``payload_bytes`` per leaf (the wire size
the codecs define everywhere in the library); the files Orbax writes add
their own metadata on top.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt.compression import registry


def _codec(name: str | None):
  return None if name in (None, '', 'none') else registry.make_codec(name)


def _padded_size(n: int, block: int | None) -> int:
  block = block or 1
  return -(-n // block) * block


def _key(seed: int, leaf: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), leaf)


def encode(delta: Any, codec: str | None, seed: int = 0
           ) -> tuple[Any, int, Any]:
  """``(stored tree, bytes, decoded delta)`` of a learner's ``delta``.

  Without a codec the stored tree is ``delta`` in float32 (4 bytes per
  element). With one, the stored tree is a list (one entry per leaf of
  ``delta``) of the codec's payload pytrees, and the decoded delta is what
  the syncer will read back (the learner's error feedback is ``delta -
  decoded``).
  """
  c = _codec(codec)
  leaves, treedef = jax.tree.flatten(delta)
  if c is None:
    out = [np.asarray(x, np.float32) for x in leaves]
    return treedef.unflatten(out), sum(x.size * 4 for x in out), \
        treedef.unflatten(out)
  stored, decoded, nbytes = [], [], 0
  for i, x in enumerate(leaves):
    flat = jnp.ravel(jnp.asarray(x, jnp.float32))
    n = _padded_size(flat.size, c.block_size)
    flat = jnp.pad(flat, (0, n - flat.size))
    payload = c.encode(flat, _key(seed, i))
    stored.append(jax.tree.map(np.asarray, payload))
    decoded.append(np.asarray(
        c.decode(payload, n, _key(seed, i))[:np.size(x)]).reshape(
            np.shape(x)))
    nbytes += int(c.payload_bytes(n))
  return stored, nbytes, treedef.unflatten(decoded)


def decode(stored: Any, codec: str | None, seed: int, params_like: Any
           ) -> Any:
  """The float32 delta (in ``params_like``'s structure) of a stored tree
  written by :func:`encode` with the same ``codec`` and ``seed``."""
  c = _codec(codec)
  leaves, treedef = jax.tree.flatten(params_like)
  if c is None:
    got = treedef.flatten_up_to(stored)
    return treedef.unflatten([np.asarray(x, np.float32) for x in got])
  if not isinstance(stored, (list, tuple)) or len(stored) != len(leaves):
    raise ValueError(f'a {codec} payload has {len(stored)} leaves; the '
                     f'model has {len(leaves)}')
  out = []
  for i, (payload, x) in enumerate(zip(stored, leaves)):
    n = _padded_size(int(np.size(x)), c.block_size)
    payload = jax.tree.map(jnp.asarray, payload)
    out.append(np.asarray(c.decode(payload, n, _key(seed, i))
                          [:np.size(x)]).reshape(np.shape(x)))
  return treedef.unflatten(out)

"""What a learner's pseudo-gradient looks like in the store: raw float32
leaves, or each leaf through a ``loc_opt.compression`` codec (the codec's
payload arrays are what is written: int8 codes as int8, 4-bit codes two to
a byte), with error feedback kept on the learner.

The bytes counted are the codec's ``payload_bytes`` per leaf (the wire size
the codecs define everywhere in the library); the files Orbax writes add
their own metadata on top.

With ``P > 1`` fragments (:class:`Fragments`) a payload holds one
fragment's leaves only, so its bytes are that fragment's.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loc_opt import _checks
from loc_opt.compression import registry
from loc_opt.outer._fragments import balanced_fragments


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


class Fragments:
  """A model split into ``P`` fragments of whole leaves, and the staggered
  schedule on which a learner publishes them.

  The split is :func:`loc_opt.outer.decoupled_diloco`'s default,
  :func:`loc_opt.outer.balanced_fragments` (whole tensors bin-packed to
  near-equal size; Douillard et al., *Decoupled DiLoCo*, 2026,
  arXiv 2604.21428). The schedule is :func:`loc_opt.outer.decoupled_timeline`'s
  (Streaming DiLoCo's): fragment ``p`` comes due when the inner-step count
  ``t`` has ``t mod H = p H / P``, i.e. every ``H`` steps at offset ``p H /
  P`` (fragment 0 at ``H, 2H, ...``), so a learner publishes one fragment
  every ``H / P`` steps.

  A fragment's tree (:meth:`take`) is the list of its leaves in
  tree-flatten order; with ``P = 1`` it is the model's tree itself, so a
  one-fragment payload is the whole model exactly as without fragments.

  Args:
    params_like: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
    num_fragments: ``P``, a positive int, at most the number of leaves.
  """

  def __init__(self, params_like: Any, num_fragments: int):
    self.num = _checks.positive_int(num_fragments, 'num_fragments')
    leaves, self.treedef = jax.tree.flatten(params_like)
    ids = (self.treedef.flatten_up_to(
        balanced_fragments(params_like, num_fragments))
           if num_fragments > 1 else [0] * len(leaves))
    self.leaves = tuple(tuple(i for i, f in enumerate(ids) if f == p)
                        for p in range(num_fragments))
    self.like = [self.take(params_like, p) for p in range(num_fragments)]

  def take(self, tree: Any, p: int) -> Any:
    """Fragment ``p`` of ``tree`` (a tree like the params)."""
    if self.num == 1:
      return tree
    flat = self.treedef.flatten_up_to(tree)
    return [flat[i] for i in self.leaves[p]]

  def put(self, tree: Any, p: int, part: Any) -> Any:
    """``tree`` with fragment ``p`` replaced by ``part`` (a new tree)."""
    if self.num == 1:
      return part
    flat = list(self.treedef.flatten_up_to(tree))
    for i, x in zip(self.leaves[p], part, strict=True):
      flat[i] = x
    return self.treedef.unflatten(flat)

  def stride(self, sync_every: int) -> int:
    """``H / P``: inner steps between two payloads of a learner."""
    if sync_every % self.num:
      raise ValueError(f'num_fragments={self.num} must divide sync_every='
                       f'{sync_every} (a fragment is published every '
                       'sync_every / num_fragments inner steps)')
    return sync_every // self.num

  def due(self, step: int, sync_every: int) -> int:
    """The fragment a learner publishes after inner step ``step``."""
    return (step // self.stride(sync_every)) % self.num

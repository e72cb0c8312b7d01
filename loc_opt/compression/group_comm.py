"""Collectives inside groups of consecutive workers, by point-to-point shifts.

:class:`GroupComm` is a :class:`~loc_opt.compression.comm.Comm` whose means,
sums and gathers run over this worker's *group* (``group_size``
consecutive workers of the worker axis) instead of the whole axis, so that
every compressor of this package (codecs through
:func:`~loc_opt.compression.from_codec`, the row quantizers, error feedback
and partition wrappers) averages inside groups unchanged, and only its
encoded payloads cross between workers.

``jax.lax.psum(..., axis_index_groups=...)`` raises ``NotImplementedError``
under ``vmap`` and ``shard_map`` (JAX 0.12), so a group gather is ``G - 1``
shifts (``lax.ppermute``): shift ``s`` sends worker ``gG + i`` to
``gG + (i + s) % G``. Each names only pairs of workers of one group, which
the compiled program shows, and moves one payload per worker: ``(G - 1)``
payloads per worker in all.

The gathered rows are put in the order of the members' positions in the
group before anything is summed, so every member reduces the same values
in the same order and all members hold bit-identical results (a sum in the
order the shifts arrive would differ by rounding for ``G >= 3``).

References:
  Kim, Kim, Lee, Jeon, Kim, *HALoS: Hierarchical Asynchronous Local SGD over
  Slow Networks for Geo-Distributed Large Language Model Training*, ICML
  2025. https://arxiv.org/abs/2506.04531

  Thérien et al., *MuLoCo: Muon is a practical inner optimizer for
  DiLoCo*, 2025 (its code's TreeLoCo: DiLoCo reductions over a tree of
  worker groups). https://arxiv.org/abs/2505.23725
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from loc_opt.compression import comm as comm_lib


def group_shifts(num_workers: int, group_size: int
                 ) -> list[list[tuple[int, int]]]:
  """The ``G - 1`` permutations whose values, with the own one, are the
  group's: shift ``s`` sends worker ``g G + i`` to ``g G + (i + s) % G``.
  """
  return [[(g + i, g + (i + s) % group_size)
           for g in range(0, num_workers, group_size)
           for i in range(group_size)]
          for s in range(1, group_size)]


@dataclasses.dataclass(frozen=True)
class GroupComm(comm_lib.Comm):
  """:class:`~loc_opt.compression.comm.Comm` over groups of workers.

  ``size()`` is the group size, and ``pmean``, ``psum``, ``pmax``,
  ``all_gather`` (hence ``all_gather_packed``) reduce or gather over the
  group only. ``index()`` stays the worker's index on the whole axis, so
  codecs that fold it into their keys (``randomness='per_worker'``) draw
  independently on every worker; ``ppermute`` takes whole-axis indices as
  :class:`~loc_opt.compression.comm.Comm`'s. ``all_to_all`` is refused.

  Attributes:
    group_size: ``G``, consecutive workers per group; divides the worker
      count (checked when traced).
  """

  group_size: int = 1

  def size(self) -> int:
    """Workers per group."""
    return self.group_size

  def member(self) -> jax.Array:
    """This worker's position in its group, ``index() % G``."""
    return self.index() % self.group_size

  def _shifts(self) -> list[list[tuple[int, int]]]:
    m = jax.lax.axis_size(self.axis_name)
    if m % self.group_size:
      raise ValueError(f'group_size={self.group_size} does not divide the '
                       f'{m} workers')
    return group_shifts(m, self.group_size)

  def all_gather(self, tree: Any) -> Any:
    """Every group member's copy of each leaf, stacked on a new leading
    axis in the members' order (row ``j``: member ``j``), by ``G - 1``
    shifts of the whole leaf."""
    g = self.group_size
    if g == 1:
      return jax.tree.map(lambda x: x[None], tree)
    received = [tree] + [super(GroupComm, self).ppermute(tree, perm)
                         for perm in self._shifts()]
    # received[s] came from member (i - s) % G: row j is received[(i-j) % G]
    order = (self.member() - jnp.arange(g)) % g
    return jax.tree.map(lambda *xs: jnp.stack(xs)[order], *received)

  def psum(self, tree: Any) -> Any:
    """Sum over the group, added in the members' order."""
    def total(rows):
      out = rows[0]
      for j in range(1, self.group_size):
        out = out + rows[j]
      return out

    return jax.tree.map(total, self.all_gather(tree))

  def pmean(self, tree: Any) -> Any:
    """Mean over the group (:meth:`psum` over ``G``)."""
    return jax.tree.map(lambda t: t / self.group_size, self.psum(tree))

  def pmax(self, tree: Any) -> Any:
    """Max over the group."""
    return jax.tree.map(lambda rows: jnp.max(rows, axis=0),
                        self.all_gather(tree))

  def all_to_all(self, tree: Any) -> Any:
    raise NotImplementedError(
        'GroupComm has no all_to_all: a two-phase codec reduction '
        "(reduce='two_phase') cannot run inside worker groups; use "
        "reduce='gather'")

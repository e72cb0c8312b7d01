"""The Transformer's dense projections on a mesh with tensor parallelism.

Two changes of how a block's products are written, found by listing the
collectives of the compiled step on workers 2 x fsdp 2 x tensor 2
(``docs/sharding.md``, "The fsdp x tensor mesh"); both compute the same
products as ``flax.nnx.Linear``:

* :func:`one_product`: with the heads split over a mesh axis, the query,
  key and value projections are one product of their stacked kernels, so
  the backward pass sums their input's gradient before Megatron's
  all-reduce (XLA:CPU reduced each product's partial sums apart: three
  all-reduces per block instead of one);
* :func:`dense`: under remat a kernel is cast to the activation dtype and
  gathered over the FSDP axes once, by a forward-only constraint, for both
  products that read it in the backward pass (XLA gathered the ~8B MLP's
  up kernel twice there).

Reference:
  Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language
  Models Using Model Parallelism, 2019.
"""

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from loc_opt.models import sharding
from loc_opt.models import weight_grad as _weight_grad


def gather(config: Any, kernel: jax.Array,
           logical: tuple[str | None, ...]) -> jax.Array:
  """``kernel`` cast to ``config.dtype``; under remat then gathered over
  the FSDP axes by a forward-only constraint to ``logical`` less
  ``'embed'`` (its gradient is reduced as before). Without remat the
  gathered copy would be kept for the backward pass (+9% temporary memory
  at ~1B scanned, fsdp 4), so there XLA places the gathers."""
  kernel = kernel.astype(config.dtype)
  if config.remat == 'none':
    return kernel
  return sharding.constrain_forward(
      kernel, tuple(None if a == 'embed' else a for a in logical),
      config.axis_rules)


def dense(config: Any, layer: nnx.Linear, x: jax.Array,
          logical: tuple[str, str]) -> jax.Array:
  """``layer(x)``, the same product, its kernel through :func:`gather`
  under remat (``logical``: the kernel's logical axes)."""
  if config.remat == 'none':
    return layer(x)
  return _weight_grad.matmul(x.astype(config.dtype),
                             gather(config, layer.kernel[...], logical),
                             config.weight_grad)


def one_product(config: Any, x: jax.Array,
                layers: tuple[nnx.Linear, ...]) -> tuple[jax.Array, ...]:
  """``layer(x)`` for each of ``layers`` (kernels ``('embed', 'heads')``)
  from one product with their kernels stacked on a new axis 1."""
  kernel = gather(config, jnp.stack([l.kernel[...] for l in layers], 1),
                  ('embed', None, 'heads'))
  y = jnp.einsum('btd,dkh->btkh', x.astype(config.dtype), kernel)
  return tuple(y[:, :, i] for i in range(len(layers)))

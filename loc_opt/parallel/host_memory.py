"""Reuse of freed host memory, for programs that run on XLA:CPU.

XLA:CPU allocates each execution's temporary buffer with ``posix_memalign``
and frees it at the end. For a training step that buffer is large (348 MB
for the 853k-parameter reference LM at batch 32 x 128 on one device), and
glibc's malloc serves a request that size with a fresh ``mmap`` (always, from
the per-thread arenas of XLA's worker threads, whose heaps are at most 64 MB)
and returns it with ``munmap``. Every step then faults in and zero-fills the
whole buffer again: 91,000 page faults and 146 ms of kernel time per step
there, against 200 ms of computation.

:func:`reuse_freed_memory` tells glibc to keep such memory: one arena for
every thread (``M_ARENA_MAX``), no ``mmap`` for large requests
(``M_MMAP_MAX = 0``, so they come from the heap) and no trimming of the
heap's top (``M_TRIM_THRESHOLD``), so the next step's buffer reuses the
pages of the last. It must run before the JAX backend starts (its worker
threads pick their arenas on their first allocation). The cost is that the
process keeps its peak host memory, and threads share one arena's lock,
which is why :func:`setup`'s ``'auto'`` applies it only where no accelerator
plugin is installed.
"""

import ctypes
import ctypes.util
import importlib.metadata

MODES = ('auto', 'on', 'off')

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1  # The largest a C int holds: never trim.

# Distributions whose presence means JAX will run on an accelerator.
_ACCELERATOR_PREFIXES = ('jax-cuda', 'jax_cuda', 'jax-rocm', 'jax_rocm',
                         'libtpu')


def accelerator_installed() -> bool:
  """Whether a JAX GPU or TPU plugin is installed in this environment."""
  for dist in importlib.metadata.distributions():
    name = (dist.metadata['Name'] or '').lower()
    if name.startswith(_ACCELERATOR_PREFIXES):
      return True
  return False


def reuse_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed memory (see the module docstring).

  Returns:
    True where it was applied; False where the C library is not glibc (no
    ``mallopt``) or refused a setting.
  """
  path = ctypes.util.find_library('c')
  if path is None:
    return False
  libc = ctypes.CDLL(path)
  mallopt = getattr(libc, 'mallopt', None)
  if mallopt is None:
    return False
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
              (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
  return all(mallopt(param, value) == 1 for param, value in settings)


def setup(mode: str) -> bool:
  """Applies :func:`reuse_freed_memory` per ``mode``; returns whether it did.

  Args:
    mode: ``'on'``, ``'off'``, or ``'auto'`` (on unless a GPU or TPU plugin
      is installed, where the host mostly feeds the accelerator and the
      input pipeline's threads would share one arena).

  Raises:
    ValueError: for an unknown ``mode``.
  """
  if mode not in MODES:
    raise ValueError(f'host memory mode must be one of {list(MODES)}, got '
                     f'{mode!r}')
  if mode == 'off' or (mode == 'auto' and accelerator_installed()):
    return False
  return reuse_freed_memory()

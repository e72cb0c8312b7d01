"""Reuse of freed host memory, for programs that run on XLA:CPU.

XLA:CPU allocates each execution's temporary buffer with ``posix_memalign``
and frees it at the end. For a training step that buffer is large (348 MB
for the 853k-parameter reference LM at batch 32 x 128 on one device), and
glibc's malloc serves a request that size with a fresh ``mmap`` (always, from
the per-thread arenas of XLA's worker threads, whose heaps are at most 64 MB)
and returns it with ``munmap``. Every step then faults in and zero-fills the
whole buffer again: 91,000 page faults and 146 ms of kernel time per step
there, against 200 ms of computation.

:func:`reuse_freed_memory` tells glibc to keep such memory: no ``mmap``
for large requests (``M_MMAP_MAX = 0``) and no trimming of the heaps
(``M_TRIM_THRESHOLD``), so the next step's buffer reuses the pages of the
last. A worker thread's own arena grows in heaps of at most 64 MB, and
glibc maps any larger request from such an arena afresh whatever the
settings, so buffers above 64 MB are only reused from the main arena:
``one_arena=True`` puts every thread there (``M_ARENA_MAX = 1``), at the
price of one lock for all of them. Measured with the launcher at the 853k
LM (2 cores, ``docs/benchmarks.md``):

=============  =========================  ========================
CPU devices    heaps kept (tokens/s)      one arena too (tokens/s)
=============  =========================  ========================
1 (stacked)    21,600 (no gain)           31,500
2 (stacked)    22,300                     29,000
4              23,500                     32,000
8 (default)    31,700                     22,300
=============  =========================  ========================

(without either: about 21,500 at every layout), so :func:`setup`'s
``'auto'`` takes one arena up to 4 devices per process and the kept heaps
alone above. It must run before the JAX backend starts (its worker threads
pick their arenas on their first allocation). The process keeps its peak
host memory; ``'auto'`` does nothing where a GPU or TPU plugin is installed,
where the host mostly feeds the accelerator and an input pipeline's threads
would share the settings.
"""

import ctypes
import ctypes.util
import importlib.metadata

MODES = ('auto', 'heap', 'one_arena', 'off')
# 'auto' takes one arena up to this many CPU devices per process.
ONE_ARENA_MAX_DEVICES = 4

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


def reuse_freed_memory(one_arena: bool) -> bool:
  """Sets glibc's malloc to keep freed memory (see the module docstring).

  Args:
    one_arena: also put every thread in the main arena, so that buffers
      above 64 MB are reused too.

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
  settings = [(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)]
  if one_arena:
    settings.insert(0, (_M_ARENA_MAX, 1))
  return all(mallopt(param, value) == 1 for param, value in settings)


def setup(mode: str, cpu_devices: int) -> str:
  """Applies :func:`reuse_freed_memory` per ``mode``; returns what it did.

  Args:
    mode: ``'heap'`` (keep freed memory), ``'one_arena'`` (and one arena
      for every thread), ``'off'``, or ``'auto'``: nothing where a GPU or
      TPU plugin is installed, else ``'one_arena'`` up to
      :data:`ONE_ARENA_MAX_DEVICES` CPU devices and ``'heap'`` above.
    cpu_devices: the virtual CPU devices this process will make.

  Returns:
    ``'heap'``, ``'one_arena'`` or ``'off'`` (also where the C library has
    no ``mallopt``).

  Raises:
    ValueError: for an unknown ``mode``.
  """
  if mode not in MODES:
    raise ValueError(f'host memory mode must be one of {list(MODES)}, got '
                     f'{mode!r}')
  if mode == 'auto':
    if accelerator_installed():
      return 'off'
    mode = 'one_arena' if cpu_devices <= ONE_ARENA_MAX_DEVICES else 'heap'
  if mode == 'off':
    return 'off'
  return mode if reuse_freed_memory(mode == 'one_arena') else 'off'

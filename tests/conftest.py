"""Test setup: 8 virtual CPU devices, set before any JAX backend use.

The suite is almost all XLA compiles of small programs, so it compiles
with ``jax_disable_most_optimizations`` (XLA's backend optimization level 0
and no expensive LLVM passes): about a third less CPU time per compile.
XLA's HLO passes (SPMD partitioning, collective placement) still run, so
the collectives and bytes that the tests read from compiled programs are
those of a default build; numerics comparisons run both sides under the
same setting. Subprocesses (the multi-process and preemption tests)
inherit it through the environment. Set ``JAX_DISABLE_MOST_OPTIMIZATIONS=0``
to run the suite with default optimization.
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)

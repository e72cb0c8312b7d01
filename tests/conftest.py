"""Test setup: 8 virtual CPU devices, set before any JAX backend use."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)

"""Tests for loc_opt.parallel.host_memory (freed host memory kept for reuse)."""

import json
import subprocess
import sys
import textwrap

import pytest

from loc_opt.parallel import host_memory

# A child process: the mode, then a jitted gradient of a [4096, 4096]
# hidden layer (64 MB intermediates, larger than a worker thread's malloc
# heap); prints the page faults per call.
_CHILD = textwrap.dedent('''
    import json, resource, sys
    from loc_opt.parallel import host_memory
    applied = host_memory.setup(sys.argv[1])
    import jax, jax.numpy as jnp
    jax.config.update('jax_num_cpu_devices', 1)
    x = jnp.ones((4096, 256))
    w1, w2 = jnp.ones((256, 4096)), jnp.ones((4096, 256))
    loss = lambda w1, w2: jnp.sum(jnp.tanh(x @ w1) @ w2)
    f = jax.jit(jax.grad(loss, (0, 1)))
    jax.block_until_ready(f(w1, w2))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
      jax.block_until_ready(f(w1, w2))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(json.dumps({'applied': applied, 'faults': (after - before) / 3}))
''')


def _faults(mode):
  out = subprocess.run([sys.executable, '-c', _CHILD, mode], check=True,
                       capture_output=True, text=True, timeout=300).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='glibc mallopt')
def test_reuse_stops_the_per_call_page_faults():
  off, on = _faults('off'), _faults('on')
  assert not off['applied'] and on['applied']
  # Without reuse every call maps its temporary buffer afresh: about 37,000
  # faults of 4 KB pages per call on the development machine, against about
  # 10,000 with reuse (the outputs' pages).
  assert off['faults'] > 20_000
  assert on['faults'] < off['faults'] / 2


def test_unknown_mode():
  with pytest.raises(ValueError, match='host memory mode'):
    host_memory.setup('always')

"""Tests for loc_opt.parallel.host_memory (freed host memory kept for reuse)."""

import json
import subprocess
import sys
import textwrap

import pytest

from loc_opt.parallel import host_memory

# A child process: the mode, then, in a thread of its own (as XLA's worker
# threads), five rounds of allocating a 256 MB buffer (as XLA:CPU's
# temporary buffer of a step: larger than a thread arena's 64 MB heaps),
# writing it and freeing it; prints the page faults of the last four rounds.
_CHILD = textwrap.dedent('''
    import ctypes, ctypes.util, json, resource, sys, threading
    from loc_opt.parallel import host_memory
    applied = host_memory.setup(sys.argv[1], int(sys.argv[2]))
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 256 << 20, []

    def rounds():
      for i in range(5):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                      - before)

    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    print(json.dumps({'applied': applied, 'faults': sum(faults[1:]) / 4}))
''')


def _faults(mode, devices=1):
  out = subprocess.run([sys.executable, '-c', _CHILD, mode, str(devices)],
                       check=True,
                       capture_output=True, text=True, timeout=300).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='glibc mallopt')
def test_reuse_stops_the_per_call_page_faults():
  off, heap, one_arena = (_faults('off'), _faults('heap'),
                          _faults('one_arena'))
  assert [r['applied'] for r in (off, heap, one_arena)] == [
      'off', 'heap', 'one_arena']
  pages = (256 << 20) // 4096
  # Without reuse every round maps the buffer afresh and faults in each
  # page; a thread's own arena cannot hold it, so only one arena reuses it.
  assert off['faults'] > pages / 2
  assert heap['faults'] > pages / 2
  assert one_arena['faults'] < pages / 20


def test_unknown_mode():
  with pytest.raises(ValueError, match='host memory mode'):
    host_memory.setup('always', 1)


def test_auto_picks_by_devices(monkeypatch):
  applied = []
  monkeypatch.setattr(host_memory, 'reuse_freed_memory',
                      lambda one_arena: applied.append(one_arena) or True)
  monkeypatch.setattr(host_memory, 'accelerator_installed', lambda: False)
  assert host_memory.setup('auto', 1) == 'one_arena'
  assert host_memory.setup('auto', 4) == 'one_arena'
  assert host_memory.setup('auto', 8) == 'heap'
  assert host_memory.setup('off', 8) == 'off'
  assert applied == [True, True, False]
  monkeypatch.setattr(host_memory, 'accelerator_installed', lambda: True)
  assert host_memory.setup('auto', 1) == 'off'
  assert host_memory.setup('heap', 1) == 'heap'  # asked for explicitly

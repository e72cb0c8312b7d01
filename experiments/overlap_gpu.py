r"""What the GPU compiler schedules while a sync's collective is in flight.

The overlapped window programs (``loc_opt.parallel.overlap_window``,
``outer.overlap='compiled'``) leave the sync's cross-worker collective
independent of the steps after it (``tests/outer/test_overlap.py`` proves
that from the dataflow on CPU). This program compiles them for GPUs, where
XLA splits each collective into a start and a done and its latency-hiding
scheduler places independent work between the two, and reads the schedule
(``loc_opt.parallel.schedule``): for every cross-worker collective, the
matrix products of which window steps run while it is in flight. The same
is reported for one program per step (what runs without the option) and
for plain DiLoCo's sync, which reads its average at once.

One GPU is enough to compile for several: ``--mock_processes=4`` (JAX's
``mock_num_gpu_processes``) makes the client present 4 hosts of one GPU,
one worker each, with mocked NCCL. Only compiling is needed for the
schedules; ``--timed=N`` also runs each program N times on the real GPU
(the other workers and the collectives are mocked: no byte crosses a wire,
so those times are the compute's, not an overlap measurement, which needs
two or more real accelerators). On a machine with several GPUs,
``--mock_processes=0`` compiles for them, one worker each, and ``--timed``
runs the programs with real collectives: a window's time per step against
its steps' one program each is then the overlap measured (NCCL's
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` send the transfers through the
network stack, a slower link than NVLink). That path has not run: the
machines lent so far had one GPU.

  python -m experiments.overlap_gpu --workdir=/tmp/overlap_gpu \
      --mock_processes=4 --timed=0 --hlo_dir=/tmp/overlap_gpu/hlo

Writes ``overlap_gpu.{md,json}`` and, with ``--hlo_dir``, each program's
optimized HLO (gzip), to read again with
``loc_opt.parallel.collective_schedule``.
"""

import functools
import gzip
import os
import pathlib
import re
import statistics
import time

from absl import app
from absl import flags

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results go.',
                               required=True)
_MOCK = flags.DEFINE_string(
    'mock_topology', '', "jax_mock_gpu_topology ('': off): slices x hosts "
    'x GPUs per host; GPUs per host must be the real count.')
_MOCK_PROCESSES = flags.DEFINE_integer(
    'mock_processes', 4, 'jax mock_num_gpu_processes (0: off, the real '
    'devices): that many hosts of the real GPUs, one worker per GPU.')
_TARGET = flags.DEFINE_string(
    'target_config', None, 'An XLA GpuTargetConfigProto (text): compile for '
    'that GPU without one (e.g. experiments/reference/'
    'h100_target_config.pbtxt; needs the CUDA plugin installed, not a GPU); '
    'compile only.')
_WORKERS = flags.DEFINE_integer('workers', 4, 'GPUs (one worker each) with '
                                '--target_config.')
_HLO_DIR = flags.DEFINE_string('hlo_dir', None,
                               'Where to write the programs\' HLO (gzip).')
_LAYERS = flags.DEFINE_integer('num_layers', 4, 'Transformer blocks.')
_D_MODEL = flags.DEFINE_integer('d_model', 512, 'Residual width.')
_SEQ = flags.DEFINE_integer('seq_len', 256, 'Tokens per sequence.')
_BATCH = flags.DEFINE_integer('batch', 16, 'Sequences per worker.')
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'Activation dtype.')
_PROFILE = flags.DEFINE_string(
    'profile_dir', None, 'Where to write a profile (with a Perfetto trace) '
    'of two calls of each window program, read back for the device time in '
    'flight; turns GPU command buffers off (each kernel then names its HLO '
    'instruction), for --timed too.')
_TIMED = flags.DEFINE_integer('timed', 0, 'Timed calls per program '
                              '(0: compile and read schedules only).')

_NAME = flags.DEFINE_string('results_name', 'overlap_gpu', 'The results '
                            'file: NAME.json and NAME.md in --workdir.')

_NO_COMMAND_BUFFERS = re.compile(r'--xla_gpu_enable_command_buffer=(\s|$)')

# Streaming DiLoCo, H = 8, P = 2, tau = 2; Eager updates, H = 8 (the
# trainer scans runs of 4 or more equal steps: 7 inner steps, one scan).
H, FRAGMENTS, TAU, SCAN_FROM = 8, 2, 2, 4


def _model():
  from loc_opt import models  # pylint: disable=g-import-not-at-top
  return models.build_model({
      'name': 'transformer', 'vocab_size': 256, 'd_model': _D_MODEL.value,
      'num_layers': _LAYERS.value, 'num_heads': max(1, _D_MODEL.value // 64),
      'd_ff': 4 * _D_MODEL.value, 'max_len': _SEQ.value,
      'dtype': _DTYPE.value})


def _methods(model):
  """name -> (transform, plan, steps a window overlaps)."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from loc_opt import outer  # pylint: disable=g-import-not-at-top
  inner = optax.adamw(1e-3)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  # Blocks 0, 2 (with the embedding, final norm and head) and blocks 1, 3.
  ids = outer.fragment_ids(shapes, FRAGMENTS, separate_non_block=False)
  return {
      'streaming_diloco': (
          outer.streaming_diloco(inner, sync_every=H, fragments=ids,
                                 overlap=TAU),
          outer.streaming_plan(H, FRAGMENTS, TAU), TAU),
      'eager_diloco': (outer.eager_diloco(inner, sync_every=H),
                       outer.eager_plan(H), H),
      'diloco': (outer.diloco(inner, sync_every=H), None, 0),
  }


def _step_fn(model, tx):
  """``step(carry, batch, phase)`` of one worker, as the windows take it."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from loc_opt import models  # pylint: disable=g-import-not-at-top

  # loc_opt.train.programs.loss_fn's loss; not imported from there, as
  # loc_opt.train pulls in TFDS and Orbax, which the CUDA venv of
  # `make overlap-gpu` does not install.
  def loss(params, batch):
    return models.lm_loss(model.apply(params, batch[:, :-1]), batch[:, 1:])

  def step(carry, batch, phase):
    params, state = carry
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params, sync=phase)
    return (optax.apply_updates(params, updates), state), value

  return step


def _first_window(plan, steps):
  """The phases of the first window (a sync and ``steps`` after it)."""
  count = next(c for c in range(4 * H) if plan.is_sync(plan(c)))
  return count, plan.window(count, steps)


def _compile(fn, mesh, args, options=None):
  import jax  # pylint: disable=g-import-not-at-top

  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  mapped = jax.jit(parallel.shard_map_workers(fn, mesh), donate_argnums=0)
  return mapped.lower(*args).compile(compiler_options=options)


def _programs(model, mesh, carry, batch):
  """name -> (compiled program, the phases it runs, window or step)."""
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.parallel import overlap  # pylint: disable=g-import-not-at-top
  out = {}
  for name, (tx, plan, steps) in _methods(model).items():
    step = _step_fn(model, tx)
    abstract = carry[name]
    if steps:
      _, phases = _first_window(plan, steps)
      window = parallel.overlap_window(step, phases, scan_from=SCAN_FROM)
      xs = (batch,) * len(phases)
      out[f'{name}/window'] = (_compile(
          lambda c, xs, w=window: w(c, xs), mesh, (abstract, xs),
          overlap.COMPILER_OPTIONS), phases, 'window')
    else:
      phases = (True,)  # DiLoCo's sync step: the average is read at once
    for phase in sorted(set(phases), key=repr):
      out[f'{name}/step{phase}'] = (_compile(
          lambda c, x, p=phase: step(c, x, p), mesh, (abstract, batch)),
          (phase,), 'step')
  return out


def _save_hlo(programs, hlo_dir) -> dict[str, str]:
  """Each program's optimized HLO text, also written (gzip) to
  ``hlo_dir`` when given."""
  texts = {}
  for name, (compiled, _, _) in programs.items():
    texts[name] = compiled.as_text()
    if hlo_dir:
      path = pathlib.Path(hlo_dir) / (re.sub(r'[^\w.-]', '_', name.replace(
          '/', '.')) + '.hlo.gz')
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(gzip.compress(texts[name].encode()))
  return texts


def schedule_rows(programs, texts, mesh) -> list[dict]:
  """One row per cross-worker collective of each program: what its
  schedule runs while the collective is in flight."""
  from loc_opt.parallel import overlap  # pylint: disable=g-import-not-at-top
  from loc_opt.parallel import schedule  # pylint: disable=g-import-not-at-top
  rows = []
  for name, (_, phases, kind) in programs.items():
    for span in schedule.collective_schedule(texts[name], mesh):
      rows.append({
          'program': name, 'kind': kind, 'phases': repr(phases),
          'collective': span.collective.kind, 'name': span.start.name,
          'bytes_per_device': span.collective.bytes_per_device,
          'in_branch': span.collective.branch is not None,
          'async': span.is_async, 'scheduled_between': len(span.between),
          'matmuls_in_flight': len(span.matmuls),
          'steps_in_flight': sorted(schedule.steps_in_flight(
              span, overlap.steps_of)),
      })
  return rows


def _time(programs, carry, batches, timed):
  """Median seconds per call of each program (after two untimed calls)."""
  import jax  # pylint: disable=g-import-not-at-top
  out = {}
  for name, (compiled, phases, kind) in programs.items():
    print(f'timing {name}', flush=True)  # which one, should one hang
    state = carry[name.split('/')[0]]()
    xs = tuple(batches for _ in phases) if kind == 'window' else batches
    times = []
    for i in range(timed + 2):
      t = time.perf_counter()
      state, loss = compiled(state, xs)
      jax.block_until_ready(loss)
      if i >= 2:
        times.append(time.perf_counter() - t)
    out[name] = {'median_s': statistics.median(times),
                 'steps': len(phases),
                 'per_step_s': statistics.median(times) / len(phases)}
  return out


def _profile(programs, carries, batch, profile_dir) -> pathlib.Path:
  """Two calls of each window program under ``jax.profiler``; returns the
  Perfetto trace."""
  import jax  # pylint: disable=g-import-not-at-top
  with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
    for name, (compiled, phases, kind) in programs.items():
      if kind != 'window':
        continue
      state = carries[name.split('/')[0]]()
      for _ in range(2):
        with jax.profiler.TraceAnnotation(name):
          state, loss = compiled(state, (batch,) * len(phases))
          jax.block_until_ready(loss)
  traces = list(pathlib.Path(profile_dir).rglob('perfetto_trace.json.gz'))
  if not traces:
    raise FileNotFoundError(f'the profiler wrote no perfetto_trace.json.gz '
                            f'under {profile_dir}')
  return max(traces, key=lambda p: p.stat().st_mtime)


def profile_rows(programs, texts, mesh, trace) -> list[dict]:
  """Per asynchronous cross-worker collective of each profiled program (its
  last call): the device time of the kernels scheduled while it is in
  flight, and the link per worker at which the transfer takes that long."""
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.parallel import kernels  # pylint: disable=g-import-not-at-top
  from loc_opt.parallel import schedule  # pylint: disable=g-import-not-at-top
  trace = kernels.load_trace(trace)
  found, rows = kernels.read_kernels(trace), []
  m = mesh.shape[parallel.WORKER]
  for name in programs:
    calls = kernels.host_spans(trace, name)
    if not calls:
      continue
    call = kernels.between(found, *calls[-1])
    loose = kernels.unattributed(call, texts[name])
    for span in schedule.collective_schedule(texts[name], mesh):
      if not span.is_async:
        continue
      hidden = kernels.in_flight(span, call)
      one_gbps = parallel.collective_seconds(
          span.collective.kind, span.collective.bytes_per_device, m,
          parallel.Link(1.0))  # seconds at 1 Gbit/s
      rows.append({
          'program': name, 'name': span.start.name,
          'collective': span.collective.kind,
          'bytes_per_device': span.collective.bytes_per_device,
          'in_branch': span.collective.branch is not None,
          'kernels_in_flight': hidden.kernels,
          'in_flight_s': hidden.seconds,
          'call_kernels': len(call),
          'call_busy_s': sum(k.duration_us for k in call) * 1e-6,
          'unattributed_kernels': len(loose),
          'gbps_hidden': (one_gbps / hidden.seconds if hidden.seconds
                          else None)})
  return rows


def _devices():
  """The GPUs to compile for: ``--target_config``'s, else the client's."""
  import jax  # pylint: disable=g-import-not-at-top
  if not _TARGET.value:
    return jax.devices()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  text = pathlib.Path(_TARGET.value).read_text()
  return topologies.get_topology_desc(
      '', 'cuda', target_config=text,
      topology=f'1x1x{_WORKERS.value}').devices


def _run_timed(model, mesh, txs, programs):
  """Real arrays (the first worker's on the real GPU under the mock
  client), then :func:`_time` and, with ``--profile_dir``, :func:`_profile`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  m = mesh.shape[parallel.WORKER]
  sharding = jax.NamedSharding(mesh, jax.P(parallel.WORKER))

  def stacked(x):
    x = np.broadcast_to(np.asarray(x), (m,) + np.shape(x))
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  params = jax.tree.map(stacked, jax.jit(model.init)(jax.random.key(0)))
  copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=sharding)

  def carry_of(tx):  # a fresh carry: the programs donate theirs
    # vmap, not shard_map: a state that is a NamedTuple would come back
    # from shard_map as a plain tuple of its fields.
    state = jax.jit(jax.vmap(tx.init), out_shardings=sharding)(params)
    return copy(params), state

  carries = {n: functools.partial(carry_of, tx) for n, tx in txs.items()}
  tokens = np.random.default_rng(0).integers(
      0, 256, (m, _BATCH.value, _SEQ.value + 1), dtype=np.int32)
  batches = stacked(tokens[0])
  timing = _time(programs, carries, batches, _TIMED.value) if _TIMED.value \
      else {}
  trace = (_profile(programs, carries, batches, _PROFILE.value)
           if _PROFILE.value else None)
  return timing, trace


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _TARGET.value and (_TIMED.value or _PROFILE.value):
    raise app.UsageError('--target_config compiles only: use --timed=0 and '
                         'no --profile_dir')
  # Autotuning sharded over the (mocked) processes waits for them. In a
  # command buffer (CUDA graph) a kernel names the buffer, not its HLO
  # instruction: the profile needs them off.
  flags_ = os.environ.get('XLA_FLAGS', '') + ' --xla_gpu_shard_autotuning=false'
  if _PROFILE.value and not _NO_COMMAND_BUFFERS.search(flags_):
    flags_ += ' --xla_gpu_enable_command_buffer='
  os.environ['XLA_FLAGS'] = flags_
  import jax  # pylint: disable=g-import-not-at-top
  if _TARGET.value:  # compile-only devices: no client to mock
    pass
  elif _MOCK_PROCESSES.value:
    jax.config.update('mock_num_gpu_processes', _MOCK_PROCESSES.value)
  elif _MOCK.value:
    jax.config.update('jax_mock_gpu_topology', _MOCK.value)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from experiments import _runs  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  devices = _devices()
  mesh = parallel.make_worker_mesh(len(devices), devices=devices)
  m = len(devices)
  model = _model()
  sharding = jax.NamedSharding(mesh, jax.P(parallel.WORKER))

  def spec(s):  # the abstract stacked array of one worker's ``s``
    return jax.ShapeDtypeStruct((m,) + s.shape, s.dtype, sharding=sharding)

  txs = {n: v[0] for n, v in _methods(model).items()}
  aparams = jax.tree.map(spec, jax.eval_shape(model.init, jax.random.key(0)))
  abstract = {n: (aparams, jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      jax.eval_shape(jax.vmap(tx.init), aparams))) for n, tx in txs.items()}
  batch = jax.ShapeDtypeStruct((m, _BATCH.value, _SEQ.value + 1), jnp.int32,
                               sharding=sharding)
  programs = _programs(model, mesh, abstract, batch)
  print(f'compiled {len(programs)} programs', flush=True)
  texts = _save_hlo(programs, _HLO_DIR.value)
  rows, error = [], None
  try:
    rows = schedule_rows(programs, texts, mesh)
  except Exception as e:  # noqa: BLE001 (the HLO is saved to read again)
    error = f'schedule: {type(e).__name__}: {e}'[:2000]
  timing, profile, trace = {}, [], None
  if _TIMED.value or _PROFILE.value:
    try:
      timing, trace = _run_timed(model, mesh, txs, programs)
    except Exception as e:  # noqa: BLE001 (the schedules stand without it)
      error = f'{error or ""} timing: {type(e).__name__}: {e}'[:4000]
  if trace:
    try:
      profile = profile_rows(programs, texts, mesh, trace)
    except Exception as e:  # noqa: BLE001 (the trace is kept to read again)
      error = f'{error or ""} profile: {type(e).__name__}: {e}'[:4000]
  info = {'devices': [str(d) for d in devices],
          'device_kind': devices[0].device_kind, 'platform':
          devices[0].platform, 'mock_topology': _MOCK.value,
          'mock_processes': _MOCK_PROCESSES.value,
          'target_config': _TARGET.value,
          'num_params': model.num_params, 'error': error}
  results = {'schedule': rows, 'timing': timing, 'profile': profile,
             'command_buffers': not _NO_COMMAND_BUFFERS.search(
                 os.environ.get('XLA_FLAGS', '')), **info,
             'sizes': {'num_layers': _LAYERS.value, 'd_model': _D_MODEL.value,
                       'seq_len': _SEQ.value, 'batch': _BATCH.value,
                       'dtype': _DTYPE.value}}
  from experiments import _sharding_tables  # pylint: disable=g-import-not-at-top
  _runs.write(_WORKDIR.value, _NAME.value, _sharding_tables.overlap_gpu_main(
      {'results': results}), results)


if __name__ == '__main__':
  app.run(main)

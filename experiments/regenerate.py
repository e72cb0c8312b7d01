r"""Reruns the benchmarks behind the docs and re-renders the docs tables.

  python -m experiments.regenerate --workdir=/work/runs      # everything
  python -m experiments.regenerate --workdir=DIR --only=diloco_family,wire_bytes
  python -m experiments.regenerate --list
  python -m experiments.regenerate --render_only             # docs from
                                                             # docs/results

For each chosen benchmark (in the order of :data:`BENCHMARKS`) it runs
``python -m experiments.<module> --workdir=DIR/<name> <args>`` in a child
process (output in ``DIR/<name>.log``), copies the results file
``DIR/<name>/<name>.json`` to ``docs/results/``, and in the end rewrites
every table between ``<!-- results:... -->`` markers in ``docs/`` and the
figures of ``experiments.tables.FIGURES`` from ``docs/results/``.

It is resumable: each benchmark reads back its finished runs and resumes an
interrupted one from its last checkpoint, and a benchmark whose results file
in DIR was written by the code of the current commit (clean tree) is not
started again (``--force`` starts it anyway, still reusing finished runs).
A run that finished under other code is read back, not retrained: delete
its run directory to retrain it (what a change to numerics needs).

Before training it names each chosen benchmark whose committed results
were made on another corpus than this machine's
(:func:`experiments.tables.corpus_report`): rerun here, its numbers come
from other text, unless the configs read a corpus file of the old text
(``--config.data.corpus_file``, docs/benchmarks.md, "The corpus").
"""

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from experiments import provenance
from experiments import tables


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One command behind a docs table."""
  module: str  # Under experiments/.
  args: tuple[str, ...] = ()  # Besides --workdir.
  doc: str = 'docs/benchmarks.md'  # Where its tables are published.
  # Figures it draws itself: file in its workdir -> path in the repository.
  figures: tuple[tuple[str, str], ...] = ()


# name (of the results file) -> how to make it, cheapest and most wanted
# first. Every name is also the results file's name.
# experiments.step_ab's runs: the workers stacked on one CPU device, H = 10;
# the defaults (narrow weight gradients, fused backward rules) first.
_STEP_AB_ARGS = (
    '--config=configs/diloco_lm.py', '--config.mesh.simulate_workers=True',
    '--config.mesh.data=1', '--cpu_devices=1',
    '--config.outer.method=diloco', '--config.outer.sync_every=10')
_STEP_AB_VARIANTS = (
    '--variant=defaults=',
    '--variant=backward_xla=model.backward=xla',
    '--variant=jax_rules=model.weight_grad=xla,model.backward=xla',
    '--variant=dot_product_attention=model.attention=xla',
    "--variant=query_blocks_2=model.causal_blocks='2'")

BENCHMARKS: dict[str, Benchmark] = {
    'wire_bytes': Benchmark('wire_bytes'),
    'outer_sweep': Benchmark('outer_sweep'),
    'outer_sweep_own': Benchmark('outer_sweep', (
        '--results_name=outer_sweep_own', '--methods=co2,noloco',
        '--workers=4', '--momenta=0.9,0.5,0.3,0.1')),
    'diloco_family': Benchmark('diloco_family'),
    'compare_dp_diloco': Benchmark('compare_dp_diloco'),
    'compression_tradeoff': Benchmark('compression_tradeoff'),
    'benchmark_step_time': Benchmark('benchmark_step_time',
                                     ('--steps=60', '--repeats=3')),
    # The 853k and 1.48M LMs' backward-rule and attention variants, one CPU
    # device.
    'step_ab_853k': Benchmark('step_ab', (
        '--results_name=step_ab_853k', *_STEP_AB_ARGS,
        '--config.model.num_layers=4', *_STEP_AB_VARIANTS)),
    'step_ab_1480k': Benchmark('step_ab', (
        '--results_name=step_ab_1480k', *_STEP_AB_ARGS,
        '--config.model.num_layers=4', '--config.model.d_model=192',
        *_STEP_AB_VARIANTS)),
    # Where the stacked step's time goes on one core, by category (three
    # sizes, two child processes each, minutes).
    'profile_step': Benchmark('profile_step', ('--steps=10',)),
    'schedules': Benchmark('schedules', (), 'docs/benchmarks.md',
                           (('schedules.png', 'docs/figures/schedules.png'),)),
    'spikes': Benchmark('spikes', (), 'docs/benchmarks.md',
                        (('spikes.png', 'docs/figures/spikes.png'),)),
    'inner_under_diloco': Benchmark('inner_under_diloco'),
    'muloco': Benchmark('muloco'),
    # Compile only (docs/sharding.md): the ~8B unrolled inner step's compile
    # takes minutes and about 5 GiB of host memory.
    'outer_state_memory': Benchmark('outer_state_memory', ('--compile',),
                                    'docs/sharding.md'),
    # The sync's bytes, replicated against sharded outer state (the trainer's
    # tiny LM and the ~1B transform alone; compile only, minutes).
    'sharded_sync_bytes': Benchmark('sharded_sync_bytes', (),
                                    'docs/sharding.md'),
    'scale_1b': Benchmark('scale_check', ('--table=scale_1b',),
                          'docs/sharding.md'),
    'scale_8b': Benchmark('scale_check', ('--table=scale_8b',),
                          'docs/sharding.md'),
    # The sync step beside the inner step at ~1B and ~8B on both meshes
    # (scanned, remat full): eight compiles, minutes.
    'scale_sync': Benchmark('scale_check', ('--table=scale_sync',),
                            'docs/sharding.md'),
    # A ~0.86B Mixture-of-Experts LM, experts x fsdp (and tensor); compile
    # only, minutes.
    'scale_moe': Benchmark('scale_check', ('--table=scale_moe',),
                           'docs/moe.md'),
    # Data-parallel vs DiLoCo on a MoE LM and the dense LM of equal active
    # parameters (four 600-step runs, about 45 minutes on 2 shared cores);
    # then the MoE LM with its routers on their own period.
    'moe_study': Benchmark('moe_study', (
        '--runs=dense_dp,dense_diloco,moe_dp,moe_diloco',), 'docs/moe.md'),
    'moe_study_router': Benchmark('moe_study', (
        '--runs=moe_router_sync', '--results_name=moe_study_router'),
        'docs/moe.md'),
    # Small models, seconds each: the bytes of DiLoCo's sync under each
    # aggregate and one adversarial worker; hierarchical DiLoCo's compiled
    # bytes per group codec and per phase.
    'robust_aggregation': Benchmark('robust_aggregation', (),
                                    'docs/robust_aggregation.md'),
    'hierarchical_bytes': Benchmark('hierarchical_bytes', (),
                                    'docs/hierarchical.md'),
    # The reference run's step-60 checkpoint on disk (a 60-step run,
    # minutes): bytes per item and per part of the saved state.
    'checkpoint_size': Benchmark('checkpoint_size', (), 'docs/resilience.md'),
    'hierarchical': Benchmark(
        'hierarchical', ('--runs=flat_h30,flat_h60,hier_30_60,'
                         'hier_30_60_int8_stat2',), 'docs/hierarchical.md'),
    'decoupled': Benchmark('decoupled', (), 'docs/decoupled_diloco.md'),
    'goodput': Benchmark('goodput', (), 'docs/decoupled_diloco.md',
                         (('goodput.png', 'docs/figures/goodput.png'),)),
    'dropout': Benchmark('dropout', (), 'docs/faults.md'),
    'qsr': Benchmark('qsr', (), 'docs/claims.md'),
    # Claim 9 at about 21 tokens per parameter: the 0.2M LM, 1000 steps,
    # the inner peak lr picked on the constant H_base run first, M = 4
    # stacked on one device; 16 runs, about an hour of CPU.
    'qsr_budget': Benchmark('qsr', (
        '--results_name=qsr_budget', '--size=0.2M', '--num_steps=1000',
        '--syncs=50,25', '--peak_lrs=0.012,0.024', '--simulate_workers',
        '--cpu_devices=1', '--config.mesh.workers=1',
        '--config.mesh.data=1'), 'docs/claims.md'),
    # Claim 8 at about 21 tokens per parameter: the schedules benchmark on
    # the 0.2M LM, 1000 steps of 32 x 128 bytes, data-parallel on one
    # device, every peak at data-parallel's tuned 2.4e-2; 3 seeds of the
    # rows that decide the verdict, schedule-free at three other peaks
    # (seed 0). 33 runs, 70 minutes of wall time on 2 shared cores.
    'schedules_budget': Benchmark('schedules', (
        '--results_name=schedules_budget', '--size=0.2M',
        '--config.num_steps=1000', '--config.batch_size=32',
        '--config.data.seq_len=128', '--config.optimizer.learning_rate=0.024',
        '--budgets=0.25,0.5,1.0', '--wsm_interval=50', '--cpu_devices=1',
        '--config.mesh.workers=1', '--config.mesh.data=1', '--seeds=0,1,2',
        '--seed_runs=cosine,linear,wsd linear,wsd 1-sqrt,'
        'schedule-free adamw,wsd-s,cosine per budget',
        '--sf_lrs=0.012,0.048,0.096'), 'docs/claims.md',
        (('schedules_budget.png', 'docs/figures/schedules_budget.png'),)),
    # Claim 4 at about 21 tokens per parameter: Eager updates' outer step
    # tuned (local search from DiLoCo M = 2's best) on the 0.2M LM, 1000
    # steps, M = 2 stacked on one device; the naive one-round delay at its
    # default, at Eager's best and around its own best; 3 seeds of
    # Eager's best and of DiLoCo at claims_long's best. About an hour of CPU.
    'outer_sweep_budget': Benchmark('outer_sweep', (
        '--results_name=outer_sweep_budget', '--size=0.2M', '--search=local',
        '--methods=eager_diloco', '--workers=2',
        '--learning_rates=1.0,0.7,0.4', '--momenta=0.5,0.3,0.9,0.0',
        '--best_seeds=3', '--also=eager_naive@0.7:0.9,'
        'eager_naive@eager_diloco,diloco@1.0:0.5:3,eager_naive@0.7:0.0,'
        'eager_naive@0.4:0.3,eager_naive@0.4:0.0,eager_naive@0.4:0.5,'
        'eager_naive@0.2:0.3', '--simulate_workers',
        '--cpu_devices=1', '--config.mesh.workers=1', '--config.mesh.data=1',
        '--config.num_steps=1000', '--config.optimizer.learning_rate=1.2e-2',
        '--config.eval_every=166', '--config.checkpoint_every=166'),
        'docs/claims.md'),
    # Hours of CPU (three sizes, tuned, seeds): last.
    # The 2M / 8M data-parallel and M = 1 rows come from a GPU
    # (tools/claims_on_gpu.sh) and 8M M = 4 from a separate CPU run; they
    # are imported, not retrained.
    'claims': Benchmark('claims', (
        '--sizes=0.5M,2M', '--import_results=' + ','.join(
            f'docs/results/{n}.json' for n in (
                'claims_gpu/2M_dp', 'claims_gpu/2M_diloco_m1',
                'claims_gpu/8M_dp', 'claims_gpu/8M_diloco_m1',
                'claims_cpu/8M_diloco_m4', 'claims_cpu/8M_diloco_m1_seeds',
                'claims_cpu/8M_diloco_m4_seeds'))),
                        'docs/claims.md'),
    # Claim 1 at about 21 tokens per parameter: 0.5M at 2400 steps and 0.2M
    # at 1000 (H = 30): a local search from each method's start (data-
    # parallel lr; DiLoCo outer lr and momentum at one inner lr per method
    # and size), then 3 seeds of each best; one device (the workers
    # stacked), so two such processes fit 2 cores. Days of CPU.
    'claims_long': Benchmark('claims', (
        '--results_name=claims_long', '--sizes=0.2M,0.5M', '--num_steps=2400',
        '--steps_per_size=0.2M=1000', '--search=local',
        '--methods=dp,diloco_m1,diloco_m4,diloco_m2',
        '--dp_lrs=1.2e-2,2.4e-2,6e-3,3e-3,4.8e-2',
        '--outer_lrs=0.7,0.4,1.0,0.2,1.4', '--outer_momenta=0.9,0.5,0.3,0.0',
        '--diloco_inner_lrs=3e-3',
        '--method_inner_lrs=diloco_m1=6e-3,0.2M:diloco_m1=1.2e-2,'
        '0.2M:diloco_m4=1.2e-2,0.2M:diloco_m2=1.2e-2', '--seeds=1,2',
        '--simulate_workers', '--cpu_devices=1', '--config.mesh.workers=1',
        '--config.mesh.data=1'), 'docs/claims.md'),
    # The same comparison at 50 tokens per parameter (0.2M, 2400 steps) at
    # the 1000-step best settings: how the gaps move with the budget.
    'claims_budget': Benchmark('claims', (
        '--results_name=claims_budget', '--sizes=0.2M', '--num_steps=2400',
        '--search=grid', '--methods=dp,diloco_m1,diloco_m4',
        '--dp_lrs=2.4e-2', '--outer_lrs=0.7', '--outer_momenta=0.5',
        '--diloco_inner_lrs=1.2e-2', '--seeds=', '--simulate_workers',
        '--cpu_devices=1', '--config.mesh.workers=1',
        '--config.mesh.data=1'), 'docs/claims.md'),
    # The bytes-at-quality frontier at the same budget (0.2M at 1000 steps,
    # M = 4 on 4 devices, bytes from the compiled programs), knobs tuned:
    # hours of CPU.
    'frontier': Benchmark('frontier', (
        '--tune', '--size=0.2M', '--num_steps=1000', '--dp_lr=2.4e-2',
        '--inner_lr=1.2e-2', '--config.outer.momentum=0.5'),
        'docs/claims.md'),
    # The rows that can decide its answer at the 0.5M LM (2400 steps,
    # claim 1's M = 4 settings at that size, outer lr 1.0 and 0.7): 21
    # runs of 5 to 12 minutes.
    'frontier_459k': Benchmark('frontier', (
        '--results_name=frontier_459k', '--size=0.5M', '--num_steps=2400',
        '--tune', '--dp_lr=6e-3', '--inner_lr=3e-3', '--outer_lrs=1.0,0.7',
        '--config.outer.momentum=0.3',
        '--runs=dp,diloco_h30_fp32,diloco_h30_fp4,diloco_h30_2bit,demo,'
        'diloco_h30_int8,muloco2bit_h30,diloco_h100_fp4,streaming_h100_fp4,'
        'noloco_h30,sparseloco_h30'), 'docs/claims.md'),
}


def _current(results: pathlib.Path) -> bool:
  """Whether ``results`` was written by this commit's code, clean."""
  if not results.exists():
    return False
  p = json.loads(results.read_text()).get('provenance', {})
  now = provenance.git_state()
  return (now['commit'] is not None and not now['dirty']
          and p.get('commit') == now['commit'] and p.get('dirty') is False)


def run_benchmark(name: str, workdir: pathlib.Path, *, force: bool,
                  python: str = sys.executable) -> pathlib.Path:
  """Runs (or skips) benchmark ``name`` into ``workdir/name``; returns its
  results file. Raises ``RuntimeError`` naming the log if it fails."""
  b = BENCHMARKS[name]
  out = workdir / name
  results = out / f'{name}.json'
  if not force and _current(results):
    print(f'{name}: results of this commit already in {results}; skipped',
          flush=True)
    return results
  log = workdir / f'{name}.log'
  cmd = [python, '-m', f'experiments.{b.module}', f'--workdir={out}',
         *b.args]
  print(f'{name}: {" ".join(cmd[1:])} (log {log})', flush=True)
  env = dict(os.environ, PYTHONPATH=str(tables.REPO))
  t0 = time.time()
  with open(log, 'a') as f:
    rc = subprocess.call(cmd, cwd=tables.REPO, env=env, stdout=f,
                         stderr=subprocess.STDOUT)
  if rc != 0 or not results.exists():
    raise RuntimeError(f'{name} failed (exit {rc}); see {log}')
  print(f'{name}: done in {time.time() - t0:.0f} s', flush=True)
  return results


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', type=pathlib.Path,
                      help='Parent of the benchmarks\' run dirs (keep it '
                      'outside the repository).')
  parser.add_argument('--only', default='',
                      help=f'Comma-separated subset of {list(BENCHMARKS)}.')
  parser.add_argument('--force', action='store_true',
                      help='Start benchmarks whose results are current.')
  parser.add_argument('--keep_going', action='store_true',
                      help='Go on to the next benchmark after a failure.')
  parser.add_argument('--no_copy', action='store_true',
                      help='Leave docs/results/ and the docs alone.')
  parser.add_argument('--render_only', action='store_true',
                      help='Only re-render docs tables and figures.')
  parser.add_argument('--list', action='store_true',
                      help='Print the benchmarks and exit.')
  args = parser.parse_args(argv)
  if args.list:
    for name, b in BENCHMARKS.items():
      print(f'{name}: python -m experiments.{b.module} --workdir=DIR/{name} '
            f'{" ".join(b.args)}  ({b.doc})')
    return 0
  names = [n for n in args.only.split(',') if n] or list(BENCHMARKS)
  unknown = sorted(set(names) - set(BENCHMARKS))
  if unknown:
    parser.error(f'unknown --only {unknown}; choose from {list(BENCHMARKS)}')
  failed = []
  if not args.render_only:
    if args.workdir is None:
      parser.error('--workdir is required (or --render_only)')
    for line in tables.corpus_report(names=names):
      print(f'corpus: {line}', flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    for name in names:
      try:
        results = run_benchmark(name, args.workdir, force=args.force)
      except RuntimeError as e:
        if not args.keep_going:
          raise
        print(e, flush=True)
        failed.append(name)
        continue
      if not args.no_copy:
        shutil.copyfile(results, tables.RESULTS / results.name)
        print(f'{name}: copied to {tables.RESULTS / results.name}',
              flush=True)
        for src, dst in BENCHMARKS[name].figures:
          shutil.copyfile(results.parent / src, tables.REPO / dst)
          print(f'{name}: copied {src} to {dst}', flush=True)
  if not args.no_copy:
    tables.main(['--figures'])
  if failed:
    print(f'failed: {failed}')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())

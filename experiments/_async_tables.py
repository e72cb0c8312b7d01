"""The table of ``experiments/async_chaos.py``: Decoupled DiLoCo's
learners and syncer as separate processes, in wall-clock time."""

from typing import Any

from experiments import _registry

LABELS = {'no_failures': 'no failures',
          'chaos': 'kill -9 schedule',
          'chaos_staleness': 'kill -9 schedule + staleness options'}


def async_chaos_main(data: dict[str, Any]) -> str:
  """Per run: learner and syncer kills, goodput, merges per minute, tokens
  merged, dropped as stale and not merged by the end, final eval loss."""
  s = data['settings']
  lines = [
      f'{s["num_learners"]} learners + 1 syncer (separate processes, one '
      f'store directory), {s["seconds"]:.0f} s window each; learner '
      f'{s["num_learners"] - 1} {s["slow_factor"]:g}x slower (pace '
      f'{s["pace_s"]:g} s per step); schedule seed {s["seed"]}.', '',
      '| run | learner kills | syncer kills | goodput | merges / min | '
      'tokens merged | tokens stale | tokens not merged | final eval loss |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|']
  for name, r in data['results'].items():
    lines.append(
        f'| {LABELS.get(name, name)} | {r["learner_kills"]} | '
        f'{r["syncer_kills"]} | {r["goodput"]:.2f} | '
        f'{r["merges_per_min"]:.1f} | {r["tokens_merged"]:,} | '
        f'{int(r["tokens_stale"]):,} | {r["tokens_unmerged"]:,} | '
        f'{r["eval_loss"]:.4f} |')
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('async_chaos', 'main'): async_chaos_main,
})

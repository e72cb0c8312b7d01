"""The table of ``experiments/async_chaos.py``: Decoupled DiLoCo's
learners and syncer as separate processes, in wall-clock time."""

from typing import Any

from experiments import _registry

LABELS = {'no_failures': 'no failures',
          'chaos': 'kill -9 schedule',
          'chaos_staleness': 'kill -9 schedule + staleness options',
          'sync_no_failures': 'synchronous DiLoCo, no failures',
          'sync_chaos_spare': 'synchronous DiLoCo, kill -9 schedule, '
                              'restarted at once (a spare machine)',
          'sync_chaos': 'synchronous DiLoCo, kill -9 schedule, restarted '
                        'when its workers are back'}


def _tokens(r: dict[str, Any], key: str) -> str:
  return f'{int(r[key]):,}' if key in r else '-'


def async_chaos_main(data: dict[str, Any]) -> str:
  """Per run: learner and syncer kills, goodput measured and predicted by
  the virtual-clock models, merges (synchronous: syncs) per minute, tokens
  merged (kept), dropped as stale, not merged by the end and lost to
  restarts, final eval loss."""
  s = data['settings']
  lines = [
      f'{s["num_learners"]} learners + 1 syncer (separate processes, one '
      f'store directory), {s["seconds"]:.0f} s window each; learner '
      f'{s["num_learners"] - 1} {s["slow_factor"]:g}x slower (pace '
      f'{s["pace_s"]:g} s per step); schedule seed {s["seed"]}.'
      + (f' Synchronous DiLoCo: one job of {s["num_learners"]} processes '
         f'(--local_processes), each sleeping its learner\'s pace; a '
         f'checkpoint every {s["checkpoint_every"]} steps.'
         if 'checkpoint_every' in s else ''), '',
      '| run | learner kills | syncer kills | goodput | goodput predicted '
      '| merges / min | tokens merged | tokens stale | tokens not merged | '
      'tokens lost to restarts | final eval loss |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for name, r in data['results'].items():
    predicted = r.get('goodput_predicted')
    lines.append(
        f'| {LABELS.get(name, name)} | {r["learner_kills"]} | '
        f'{r.get("syncer_kills", "-")} | {r["goodput"]:.2f} | '
        f'{"-" if predicted is None else f"{predicted:.2f}"} | '
        f'{r["merges_per_min"]:.1f} | {r["tokens_merged"]:,} | '
        f'{_tokens(r, "tokens_stale")} | {r["tokens_unmerged"]:,} | '
        f'{_tokens(r, "tokens_lost")} | {r["eval_loss"]:.4f} |')
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('async_chaos', 'main'): async_chaos_main,
})

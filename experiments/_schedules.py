"""The schedules benchmark's run names and seed handling, without flags.

:mod:`experiments.schedules` defines absl flags, so the parts tests import
live here.
"""

SHAPES = ('linear', 'cosine', '1-sqrt', '1-square')
# The runs a seed repeats ('cosine per budget': part 2's shorter cosines).
SEEDABLE = ('cosine', 'linear', *(f'wsd {s}' for s in SHAPES),
            'schedule-free adamw', 'wsd-s', 'cosine per budget')


# What the first seed can run: every repeatable run and the constant WSD
# main run with its WSM merges and branched decays.
RUNS = (*SEEDABLE, 'constant main')


def seed_dir(name: str, seed: int, first: int) -> str:
  """Run ``name``'s directory name at ``seed`` (the first seed's runs keep
  the plain name, so a one-seed workdir reads the same as before seeds)."""
  base = name.replace(' ', '_')
  return base if seed == first else f'{base}_s{seed}'


def chosen_runs(names) -> list[str]:
  """``--runs`` checked against :data:`RUNS`, in :data:`RUNS`' order unless
  given otherwise (the order they train in); a bad name is a ValueError."""
  unknown = [n for n in names if n not in RUNS]
  if unknown or not names:
    raise ValueError(f'--runs {unknown or names} are not runs of the '
                     f'schedules benchmark; known: {list(RUNS)}')
  return list(dict.fromkeys(names))


def parse_seeds(values, runs) -> tuple[list[int], list[str]]:
  """``--seeds`` as ints and ``--seed_runs`` checked against
  :data:`SEEDABLE`; a bad value is a ValueError naming it."""
  try:
    seeds = [int(v) for v in values]
  except ValueError as e:
    raise ValueError(f'--seeds must be integers, got {list(values)}') from e
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f'--seeds must be distinct and not empty, got {seeds}')
  unknown = [r for r in runs if r not in SEEDABLE]
  if unknown:
    raise ValueError(f'--seed_runs {unknown} are not repeatable runs; '
                     f'known: {list(SEEDABLE)}')
  return seeds, list(runs)

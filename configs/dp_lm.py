"""Data-parallel baseline for configs/diloco_lm.py (same model, data, mesh).

Gradients are all-reduced over all 8 devices every step, so every step moves
the full gradient across workers.

Launch:
  python -m experiments.train --config=configs/dp_lm.py --workdir=DIR
"""

import ml_collections

from configs import diloco_lm


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config with ``outer.method = 'data_parallel'``."""
  c = diloco_lm.get_config(arg)
  c.outer.method = 'data_parallel'  # Plain Optax step on averaged gradients.
  return c

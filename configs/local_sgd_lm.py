"""Local SGD / FedAvg (parameter averaging) on the LM of configs/diloco_lm.py.

DiLoCo's outer step with learning rate 1 and no momentum.

Launch:
  python -m experiments.train --config=configs/local_sgd_lm.py --workdir=DIR
"""

import ml_collections

from configs import diloco_lm


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config with ``outer.method = 'local_sgd'``."""
  c = diloco_lm.get_config(arg)
  c.outer.method = 'local_sgd'  # Average the workers' parameters.
  return c

r"""``python -m experiments.train``: the package's launcher, for clones.

The same program as ``loc-opt-train`` and ``python -m loc_opt.launch``
(``loc_opt/launch.py`` has the flags and their meaning)::

  python -m experiments.train --config=diloco_lm:mlp --workdir=DIR
"""

from loc_opt import launch
from loc_opt.launch import cluster_detected  # noqa: F401 (tests, scripts)

if __name__ == '__main__':
  launch.train_main()

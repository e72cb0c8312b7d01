"""Inner optimizers and the registry the launcher resolves names in.

One module per algorithm, named after it:

* SPAM (:mod:`~loc_opt.inner.spam`) and Stable-SPAM
  (:mod:`~loc_opt.inner.stable_spam`), and their composable pieces
  (:mod:`~loc_opt.inner.clipping`): ``reset_every``,
  ``clip_by_moment_ratio``, ``adaptive_max_clip``, ``adaptive_grad_norm``.
* Matrix-aware and memory-lean optimizers: SWAN (:mod:`~loc_opt.inner.swan`),
  FRUGAL (:mod:`~loc_opt.inner.frugal`), Fira (:mod:`~loc_opt.inner.fira`),
  Dion (:mod:`~loc_opt.inner.dion`), Drop-Muon
  (:mod:`~loc_opt.inner.drop_muon`).
* MT-DAO's multi-timescale Adam (:mod:`~loc_opt.inner.multi_timescale`).
* MuLoCo's Muon + AdamW split by parameter path
  (:mod:`~loc_opt.inner.muon_adamw`).
* :func:`make_optimizer` / :data:`OPTIMIZERS`: every optimizer by name.

Private machinery shared by several of them lives in underscore modules:
``_sparse_momentum`` (SPAM family) and ``_matrix`` (matrix optimizers).
"""

from loc_opt.inner.clipping import adaptive_grad_norm
from loc_opt.inner.clipping import adaptive_max_clip
from loc_opt.inner.clipping import clip_by_moment_ratio
from loc_opt.inner.clipping import reset_every
from loc_opt.inner.dion import dion
from loc_opt.inner.dion import scale_by_dion
from loc_opt.inner.drop_muon import drop_muon
from loc_opt.inner.drop_muon import sampled_layers
from loc_opt.inner.drop_muon import scale_by_drop_muon
from loc_opt.inner.fira import fira
from loc_opt.inner.fira import scale_by_fira
from loc_opt.inner.frugal import frugal
from loc_opt.inner.frugal import scale_by_frugal
from loc_opt.inner.multi_timescale import multi_timescale_adam
from loc_opt.inner.multi_timescale import scale_by_multi_timescale
from loc_opt.inner.muon_adamw import muon_adamw
from loc_opt.inner.muon_adamw import muon_adamw_labels
from loc_opt.inner.registry import make_optimizer
from loc_opt.inner.registry import OPTIMIZERS
from loc_opt.inner.spam import scale_by_spam
from loc_opt.inner.spam import spam
from loc_opt.inner.spam import spam_warmup_factor
from loc_opt.inner.stable_spam import scale_by_stable_spam
from loc_opt.inner.stable_spam import stable_spam
from loc_opt.inner.stable_spam import stable_spam_kappa
from loc_opt.inner.swan import scale_by_swan
from loc_opt.inner.swan import swan

"""MuLoCo on the byte-level Transformer LM: Muon inside DiLoCo, 2-bit deltas.

Derived from configs/diloco_lm.py (same model, data and 4 x 2 mesh); only
the inner optimizer, the outer step and the pseudo-gradient codec differ:

* inner: Muon on the hidden matrices (attention and MLP kernels), AdamW with
  its own learning rate on the token embedding, the output head and the norm
  gains, chosen by parameter path (``optimizer.name = 'muon_adamw'``, see
  loc_opt/inner/muon_adamw.py), not by "every 2-D leaf";
* outer: Nesterov SGD with MuLoCo's K=1 defaults (lr 0.7, momentum 0.6),
  H = 30;
* codec: the row-wise statistical quantizer at 2 bits with error feedback
  (decay 0.9), norms, embedding and head sent uncompressed without error
  feedback (the paper's quantization sweeps).

Reference: Thérien, Huang, Rish, Belilovsky, *MuLoCo: Muon is a practical
inner optimizer for DiLoCo*, 2025 (arXiv 2505.23725).

Launch:
  python -m experiments.train --config=configs/muloco_lm.py --workdir=DIR
Uncompressed MuLoCo:
  python -m experiments.train --config=configs/muloco_lm.py --workdir=DIR \\
    --config.outer.codec=none --config.outer.error_feedback=none
"""

import ml_collections

from configs import diloco_lm
from loc_opt.inner.muon_adamw import DION_NS_COEFFS


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config with MuLoCo's inner optimizer, outer step and
  codec (``arg`` is unused)."""
  c = diloco_lm.get_config(arg)

  c.optimizer.name = 'muon_adamw'  # loc_opt.inner.muon_adamw.
  # Muon's peak learning rate (the paper's sweep grid is 0.011 to 0.047 at
  # 416M; small models take the upper end).
  c.optimizer.learning_rate = 0.02
  c.optimizer.schedule = 'warmup_cosine'  # Both groups follow it.
  c.optimizer.schedule_kwargs = {'warmup_steps': 0.1,  # Warmup (fraction).
                                 'end_value': 0.002}  # Final Muon rate.
  c.optimizer.grad_clip_norm = 1.0  # Global-norm clip of inner grads.
  c.optimizer.kwargs = {
      # AdamW's rate over Muon's: 0.15 x 0.02 = 3e-3, diloco_lm's AdamW
      # rate (departure: the paper uses the Muon rate, factor 1; not tuned
      # for this model, see docs/results/muloco.md).
      'adamw_lr_ratio': 0.15,
      'momentum': 0.9,  # Muon's momentum (the paper's configs).
      'nesterov': False,  # Plain momentum (the paper's configs).
      # Departure: optax's width rule sqrt(max(1, fan_out / fan_in)), not
      # Dion's sqrt(fan_out / fan_in) ('spectral'): at this Muon rate
      # Dion's rule ended 2.3% worse (docs/muloco.md).
      'width_scale': 'max1',
      'ns_coeffs': DION_NS_COEFFS,  # Dion's per-iteration coefficients.
      'weight_decay': 0.01,  # Muon's decoupled weight decay (150M value).
      'adamw_b1': 0.9,  # AdamW betas (embedding, head, norms): the
      'adamw_b2': 0.99,  # paper's (0.9, 0.99).
      'adamw_weight_decay': 0.1,  # AdamW's decoupled weight decay.
      # Path parts that go to AdamW (leaves with < 2 dims always do).
      'adamw_paths': ('embed', 'head', 'norm'),
  }

  c.outer.method = 'diloco'  # Local Muon steps, periodic outer steps.
  c.outer.sync_every = 30  # H = 30 (the paper, at every scale).
  # The authors' K=1 defaults (the K=8 research configs use 0.9 / 0.8
  # uncompressed, 0.8 / 0.9 quantized; none is published for K=4). Applied
  # once per sync on the compressed path too: the reference code's
  # compressed path also scales its error-feedback accumulator by the
  # outer rate (an effective rate squared), which is not reproduced.
  c.outer.learning_rate = 0.7  # Outer Nesterov learning rate.
  c.outer.momentum = 0.6  # Outer momentum (MuLoCo; DiLoCo uses 0.8-0.9).
  c.outer.nesterov = True  # Nesterov outer SGD.
  # Row-wise statistical quantizer (loc_opt.compression.statistical):
  # per row, centre, bins over +-3 sigma, centroid table per row.
  c.outer.codec = 'statistical'
  c.outer.codec_kwargs = {'bits': 2,  # 2, 4 or 8 bits per value.
                          'clip_sigmas': 3.0,  # Bins span +-3 sigma.
                          # Departure: the paper's sweeps re-quantize the
                          # average (a compressed reduce-scatter /
                          # all-gather); ours all-gathers each worker's
                          # payload, so it would add error, not save bytes.
                          'requantize': False}
  c.outer.error_feedback = 'ef'  # Error feedback on the compressed leaves.
  c.outer.ef_decay = 0.9  # e <- 0.9 (p - C(p)) (the paper's sweeps).
  # Sent in fp32 and plainly averaged, no error feedback.
  c.outer.compress_skip = ('norm', 'embed', 'head')
  return c

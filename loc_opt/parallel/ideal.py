"""What a sharded train step should move, to hold the compiled HLO against.

The figures use the convention of :func:`loc_opt.parallel.collective_bytes`:
a collective counts the operand each device contributes, times the devices.
So an all-gather of a parameter sharded ``n`` ways counts the parameter once
(``n`` shards), and a reduce-scatter (or an all-reduce) of its full gradient
counts it ``n`` times.

Inside one worker with ``data x fsdp x tensor`` devices, an ideal
FSDP + Megatron step over ``P`` parameter bytes moves

* FSDP (ZeRO-3): the parameters all-gathered over ``fsdp`` for the forward
  and again for the backward pass, ``2 P`` (each device gathers its tensor
  slice), and the gradients reduce-scattered over the batch axes (``data``,
  ``fsdp``), ``data * fsdp * P``;
* tensor parallelism (Megatron, no sequence parallelism): per block two
  all-reduces of the activations ``[rows, length, d_model]`` in the forward
  pass and two in the backward pass, plus one each for the vocabulary-parallel
  embedding (forward) and head (backward), every device contributing its
  rows: ``(4 L + 2) * A * devices`` with ``A`` the activation bytes of one
  device.

Small reductions (the loss, norms, finiteness checks) are left out; they are
a few bytes per row.

The activation all-reduces count at the width the backend reduces in
(:attr:`WorkerLayout.reduce_bytes`): XLA:CPU reduces 16-bit floats in float32
(its ``all-reduce-promotion`` pass, then ``float-normalization-bf16``, turn
a bfloat16 all-reduce into a float32 one: :func:`reduce_width`), so on 8
virtual CPU devices a bfloat16 model's Megatron all-reduces move twice the
bytes that they move on GPUs and TPUs, which reduce bfloat16 natively.

References:
  Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models, 2020.
  Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language
  Models Using Model Parallelism, 2019.
"""

from typing import NamedTuple

from loc_opt.parallel import hlo


class WorkerLayout(NamedTuple):
  """The devices of one worker and the sizes of one inner step.

  Attributes:
    data: data-parallel devices per worker.
    fsdp: devices the parameters are sharded over.
    tensor: tensor-parallel devices.
    param_bytes: bytes of one copy of the parameters.
    rows: sequences per worker per step.
    length: tokens per sequence.
    d_model: width of the residual stream.
    num_layers: Transformer blocks.
    act_bytes: bytes per activation element (2 for bfloat16).
    reduce_bytes: bytes per element of the activation all-reduces as the
      backend runs them (``None``: ``act_bytes``; :func:`reduce_width`).
  """

  data: int
  fsdp: int
  tensor: int
  param_bytes: int
  rows: int = 0
  length: int = 0
  d_model: int = 0
  num_layers: int = 0
  act_bytes: int = 4
  reduce_bytes: int | None = None

  @property
  def devices(self) -> int:
    return self.data * self.fsdp * self.tensor


def fsdp_bytes(layout: WorkerLayout) -> int:
  """Ideal FSDP bytes of one worker's step: two parameter all-gathers and
  one gradient reduce-scatter (see the module docstring)."""
  gather = 2 * layout.param_bytes if layout.fsdp > 1 else 0
  batch = layout.data * layout.fsdp
  reduce = batch * layout.param_bytes if batch > 1 else 0
  return gather + reduce


def tensor_bytes(layout: WorkerLayout) -> int:
  """Ideal Megatron activation bytes of one worker's step."""
  if layout.tensor == 1:
    return 0
  rows = layout.rows // (layout.data * layout.fsdp)
  width = layout.reduce_bytes or layout.act_bytes
  activation = rows * layout.length * layout.d_model * width
  return (4 * layout.num_layers + 2) * activation * layout.devices


def reduce_width(act_bytes: int, backend: str) -> int:
  """Bytes per element of an all-reduce of ``act_bytes``-wide floats on
  ``backend`` (``jax.default_backend()``): 4 for 16-bit floats on ``'cpu'``
  (XLA:CPU promotes them to float32; ``tests/parallel/test_ideal.py``
  checks it on the installed jaxlib), else ``act_bytes``."""
  return 4 if backend == 'cpu' and act_bytes == 2 else act_bytes


def inner_step_bytes(layout: WorkerLayout) -> int:
  """Ideal within-worker bytes of one worker's inner step (FSDP + TP)."""
  return fsdp_bytes(layout) + tensor_bytes(layout)


def unrolled_bytes(report: hlo.CollectiveReport, *, cross_worker: bool) -> int:
  """Unconditional bytes of one side, loop bodies times their trip count.

  :class:`~loc_opt.parallel.hlo.CollectiveReport` counts a collective in a
  ``while`` body once; for layers under ``jax.lax.scan`` the step moves it
  once per layer. A loop whose trip count XLA does not know counts once.
  """
  return sum(c.total_bytes * (c.trip_count or 1) for c in report.collectives
             if c.branch is None and c.cross_worker == cross_worker)

r"""Training throughput of exogym's DiLoCo on CPU, as a reference for loc_opt.

This program is not part of loc_opt and does not use its environment: it runs
the PyTorch simulator exogym (github.com/exo-explore/gym) the way a researcher
would, through ``exogym.Trainer.fit`` with exogym's ``DiLoCoStrategy``, and
prints the global training throughput in tokens per second, so that it can be
set beside loc_opt's own throughput for the same model and batch.

The run: 4 nodes (exogym starts one process per node with
``torch.multiprocessing`` and joins them with gloo collectives on CPU),
H = 10 inner steps between synchronizations, float32, AdamW inside (lr 3e-3,
betas (0.9, 0.95), weight decay 0.1, gradient clipping at norm 1.0 through
exogym's ``max_norm``) and Nesterov SGD outside (lr 0.7, momentum 0.9), a
constant learning rate, 8 sequences of 128 random bytes per node and step
(global batch 32), no evaluation (``val_size=0``) and exogym's no-op logger
(``disable_logging=True``).

The model is exogym's nanoGPT (``example/nanogpt/nanogpt.py``), configured as
close to loc_opt's reference LM (``loc_opt.models.transformer``) as it goes:
vocabulary 256, 4 heads, no biases (``bias=False``), no dropout, pre-norm
blocks, MLP hidden width ``--d_ff`` (512 by default, loc_opt's default at every
``d_model``), tanh-approximated GELU, and an untied output head (nanoGPT ties
it to the token embedding; the script gives the embedding its own weight).
What still differs: nanoGPT has a learned position table (``128 * d_model``
parameters) where loc_opt uses RoPE, LayerNorm (without bias) where loc_opt
uses RMSNorm (same parameter count), and PyTorch's fused
``scaled_dot_product_attention``. Its parameter count is printed beside
loc_opt's; it is 1.7 to 3.6 % higher at the sizes below.

Timing. ``Trainer.fit`` includes spawning the node processes, importing torch
in each and connecting them, so the program times the steps themselves: the
strategy is exogym's ``DiLoCoStrategy`` with two clock readings added on
rank 0 (nothing else changed), one when step ``--warmup_steps`` starts (after
exogym's per-step barrier, so every node has finished the warmup) and one
after the last step, behind a barrier, so every node has finished. Then

  tokens_per_s = 32 * 128 * (steps - warmup_steps) / seconds

counting, like loc_opt, batch_size * seq_len tokens per (global) step. Note
that exogym's first synchronization comes after step 11 (its strategy counts
from 0 and syncs when ``local_step % H == 0 and local_step > 0``), so the
default window, steps 11 to 60, holds 5 synchronizations in 50 steps;
exogym also calls ``dist.barrier()`` after every step, and rank 0 keeps the
outer (master) model and runs the outer step alone.

Threads: exogym has no setting for the threads of a node, so the program
sets ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` before the nodes are spawned
and calls ``torch.set_num_threads`` in each node, from the dataset factory
that exogym calls inside every node process.

Setup (a Python with torch, separate from loc_opt's environment):

  python -m venv /tmp/torchenv
  /tmp/torchenv/bin/pip install torch numpy tqdm psutil einops
  git clone https://github.com/exo-explore/gym /tmp/exogym_src
  git -C /tmp/exogym_src checkout 9fa323c26364f4437ffd23517da5d65946003963
  /tmp/torchenv/bin/pip install --no-deps -e /tmp/exogym_src

(exogym's own dependency list also names wandb, transformers, datasets,
torchvision and others that this run does not import.) An editable install
lets the program find ``example/nanogpt``; otherwise pass ``--exogym_src``.

Run (from the repository root):

  /tmp/torchenv/bin/python experiments/reference/exogym_throughput.py \
    --num_layers=4 --d_model=192 [--steps=60] [--threads=1]

The last line of the output is one JSON object (``num_params``,
``tokens_per_s``, ``seconds``, ...); the lines before it are exogym's.
loc_opt's parameter counts for comparison: 459,392 (2 layers, d_model 128),
853,120 (4 layers, 128), 1,476,288 (4 layers, 192).
"""

import argparse
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import exogym
from exogym import trainer as exogym_trainer
from exogym.strategy import diloco
from exogym.strategy import optim as exogym_optim
import torch
from torch import distributed as dist
from torch import nn

# The exogym commit this program was written against.
EXOGYM_COMMIT = '9fa323c26364f4437ffd23517da5d65946003963'
NUM_NODES = 4
H = 10
GLOBAL_BATCH = 32
SEQ_LEN = 128
VOCAB = 256
# Sequences of random bytes held by each node (the loader cycles over them).
SEQUENCES_PER_NODE = 512


def _init_process_group_on_loopback(backend, rank, world_size, retries=10):
  """``exogym.utils.init_process_group_portsafe`` for Linux.

  exogym pins gloo to the interface ``lo0`` (macOS's loopback), which Linux
  does not have, and only prints the error when all retries fail. This is the
  same function (port ``MASTER_PORT + 199``, retried on the next ports) with
  gloo on Linux's loopback ``lo``.

  Args:
    backend: ``'gloo'`` or ``'nccl'``.
    rank: this node's rank.
    world_size: number of nodes.
    retries: ports to try.
  """
  port = int(os.environ.get('MASTER_PORT', '29500')) + 199
  os.environ['MASTER_ADDR'] = 'localhost'
  if backend == 'gloo':
    os.environ['GLOO_SOCKET_IFNAME'] = 'lo'
  errors = []
  for _ in range(retries):
    try:
      os.environ['MASTER_PORT'] = str(port)
      dist.init_process_group(backend, rank=rank, world_size=world_size)
      return
    except RuntimeError as e:  # torch's DistNetworkError, gloo's errors.
      errors.append(str(e))
      port += 1
  raise RuntimeError(f'init_process_group failed: {errors}')


if sys.platform.startswith('linux'):
  # Runs in the launcher and again in every node process, which re-imports
  # this file before exogym's _worker looks the function up.
  exogym_trainer.init_process_group_portsafe = _init_process_group_on_loopback


class RandomBytes(torch.utils.data.Dataset):
  """Sequences of uniformly random bytes: (inputs, next-byte targets)."""

  def __init__(self, num_sequences, seq_len, seed):
    gen = torch.Generator().manual_seed(seed)
    self.tokens = torch.randint(0, VOCAB, (num_sequences, seq_len + 1),
                                generator=gen, dtype=torch.int64)

  def __len__(self):
    return self.tokens.shape[0]

  def __getitem__(self, i):
    return self.tokens[i, :-1], self.tokens[i, 1:]


def node_dataset(threads, rank, num_nodes, train_dataset=True):
  """exogym's dataset factory, called inside each node process.

  It is also where the node's torch threads are set: exogym has no setting
  for them, and this is the first code of ours that runs in the node.

  Args:
    threads: torch intra-op threads for this node.
    rank: the node's rank.
    num_nodes: number of nodes.
    train_dataset: training (True) or validation (False) data.

  Returns:
    A RandomBytes dataset, different on every node.
  """
  torch.set_num_threads(threads)
  seed = rank if train_dataset else num_nodes + rank
  return RandomBytes(SEQUENCES_PER_NODE if train_dataset else 8, SEQ_LEN,
                     seed)


class TimedDiLoCo(diloco.DiLoCoStrategy):
  """exogym's DiLoCoStrategy with two clock readings on rank 0.

  The clock starts when step ``warmup_steps`` (counted from 0) begins and
  stops when the last step has ended on every node; rank 0 writes both, and
  its torch thread count, to ``timing_path`` as JSON.
  """

  def __init__(self, timing_path, warmup_steps, **kwargs):
    super().__init__(**kwargs)
    self.timing_path = timing_path
    self.warmup_steps = warmup_steps
    self.start_time = None

  def zero_grad(self):
    # TrainNode._train_step begins with this; the previous step ended with
    # dist.barrier(), so every node has done `warmup_steps` steps.
    if self.rank == 0 and self.local_step == self.warmup_steps:
      self.start_time = time.perf_counter()
    super().zero_grad()

  def step(self):
    super().step()
    if self.local_step == self.max_steps:
      dist.barrier()
      if self.rank == 0:
        pathlib.Path(self.timing_path).write_text(json.dumps({
            'seconds': time.perf_counter() - self.start_time,
            'threads': torch.get_num_threads(),
        }))


def _find_exogym_src(flag_value):
  if flag_value:
    return pathlib.Path(flag_value)
  # An editable install: .../exogym_src/exogym/__init__.py.
  return pathlib.Path(exogym.__file__).resolve().parent.parent


def _exogym_commit(src):
  try:
    out = subprocess.run(['git', '-C', str(src), 'rev-parse', 'HEAD'],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return EXOGYM_COMMIT  # An exported tree: the commit it was written for.


def _fresh_linear(in_features, out_features, std):
  layer = nn.Linear(in_features, out_features, bias=False)
  nn.init.normal_(layer.weight, mean=0.0, std=std)
  return layer


def build_model(args, exogym_src):
  """exogym's nanoGPT, set up as close to loc_opt's LM as it goes."""
  nanogpt_dir = exogym_src / 'example' / 'nanogpt'
  if not (nanogpt_dir / 'nanogpt.py').exists():
    sys.exit(f'no {nanogpt_dir}/nanogpt.py: pass --exogym_src')
  # The module alone, not the package (its __init__ needs `datasets`). The
  # node processes inherit sys.path, so they can unpickle the model.
  sys.path.insert(0, str(nanogpt_dir))
  import nanogpt  # pylint: disable=g-import-not-at-top

  torch.manual_seed(0)
  config = nanogpt.GPTConfig(
      block_size=SEQ_LEN, vocab_size=VOCAB, n_layer=args.num_layers,
      n_head=args.num_heads, n_embd=args.d_model, dropout=0.0, bias=False)
  model = nanogpt.GPT(config)
  d, std = args.d_model, 0.02
  # Untie the output head from the token embedding.
  model.transformer.wte.weight = nn.Parameter(
      torch.empty(VOCAB, d).normal_(mean=0.0, std=std))
  for block in model.transformer.h:
    block.mlp.gelu = nn.GELU(approximate='tanh')
    if args.d_ff != 4 * d:  # nanoGPT's MLP is 4 * n_embd wide.
      block.mlp.c_fc = _fresh_linear(d, args.d_ff, std)
      block.mlp.c_proj = _fresh_linear(
          args.d_ff, d, std / math.sqrt(2 * args.num_layers))
  return model


def loc_opt_num_params(num_layers, d_model, d_ff):
  """Parameters of loc_opt's Transformer of the same sizes."""
  per_layer = 4 * d_model * d_model + 2 * d_model * d_ff + 2 * d_model
  return 2 * VOCAB * d_model + num_layers * per_layer + d_model


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--num_layers', type=int, default=2)
  parser.add_argument('--d_model', type=int, default=128)
  parser.add_argument('--d_ff', type=int, default=512,
                      help='MLP hidden width (loc_opt: 512 at every size).')
  parser.add_argument('--num_heads', type=int, default=4)
  parser.add_argument('--steps', type=int, default=60,
                      help='Inner steps per node, a multiple of H=10.')
  parser.add_argument('--warmup_steps', type=int, default=10,
                      help='Steps before the clock starts.')
  parser.add_argument('--threads', type=int, default=1,
                      help='torch threads per node process.')
  parser.add_argument('--port', type=int, default=12355,
                      help='exogym start_port (gloo uses port + 199).')
  parser.add_argument('--exogym_src', default='',
                      help='exogym source tree (default: where exogym is '
                      'installed, editable).')
  args = parser.parse_args(argv)
  if args.steps % H or not 0 <= args.warmup_steps < args.steps:
    parser.error(f'--steps must be a multiple of {H} and > --warmup_steps')
  return args


def main(argv=None):
  args = parse_args(argv)
  # Read by torch when each node process (spawned below) starts.
  for var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
    os.environ[var] = str(args.threads)
  torch.set_num_threads(args.threads)

  exogym_src = _find_exogym_src(args.exogym_src)
  model = build_model(args, exogym_src)
  num_params = sum(p.numel() for p in model.parameters())
  reference = loc_opt_num_params(args.num_layers, args.d_model, args.d_ff)

  with tempfile.TemporaryDirectory() as tmp:
    timing_path = os.path.join(tmp, 'timing.json')
    strategy = TimedDiLoCo(
        timing_path=timing_path,
        warmup_steps=args.warmup_steps,
        optim_spec=exogym_optim.OptimSpec(
            torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        outer_optim_spec=exogym_optim.OptimSpec(
            torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        H=H,
        max_norm=1.0,
    )
    factory = functools.partial(node_dataset, args.threads)
    trainer = exogym.Trainer(model, factory, factory, start_port=args.port,
                             device='cpu')
    per_node = GLOBAL_BATCH // NUM_NODES
    fit_start = time.perf_counter()
    trainer.fit(
        num_epochs=1,
        strategy=strategy,
        num_nodes=NUM_NODES,
        max_steps=args.steps,
        batch_size=per_node,
        minibatch_size=per_node,  # No accumulation, and no probe run.
        val_size=0,  # No evaluation.
        disable_logging=True,
        seed=0,
    )
    fit_seconds = time.perf_counter() - fit_start
    timing = json.loads(pathlib.Path(timing_path).read_text())

  timed_steps = args.steps - args.warmup_steps
  print(json.dumps({
      'num_params': num_params,
      'loc_opt_num_params': reference,
      'num_layers': args.num_layers,
      'd_model': args.d_model,
      'd_ff': args.d_ff,
      'num_nodes': NUM_NODES,
      'H': H,
      'global_batch': GLOBAL_BATCH,
      'seq_len': SEQ_LEN,
      'steps': args.steps,
      'warmup_steps': args.warmup_steps,
      'tokens_per_s': GLOBAL_BATCH * SEQ_LEN * timed_steps / timing['seconds'],
      'seconds': timing['seconds'],
      'fit_seconds': fit_seconds,
      'threads_per_node': timing['threads'],
      'torch': torch.__version__,
      'exogym_commit': _exogym_commit(exogym_src),
  }), flush=True)


if __name__ == '__main__':
  main()

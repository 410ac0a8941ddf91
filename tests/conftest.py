import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter; on a GPU, compile them
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed():
    """A fresh seed per test, printed so a failure can be replayed (MOEADAPT_TEST_SEED=s fixes it)."""
    s = int(os.environ.get("MOEADAPT_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"seed={s} (MOEADAPT_TEST_SEED={s} replays it)")
    torch.manual_seed(s)
    return s


def micro_spec(**kw):
    """A very small hybrid model for fast CPU tests: 2 KDA + 1 DSA... layers as requested."""
    from moeadapt.config import ModelSpec

    base = dict(name="micro", vocab_size=264, hidden_size=32, n_layers=4, kda_n_heads=2, kda_head_dim=8,
                n_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                index_n_heads=2, index_head_dim=8, index_topk=8, first_k_dense=1, intermediate_size=48,
                n_routed_experts=4, n_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, latent_dim=16,
                max_position_embeddings=256)
    base.update(kw)
    return ModelSpec(**base)


class ListBatches:
    """The trainer's sampler over fixed rows: each next() is the next [rows, seq + 1] tensor as (inputs, labels,
    no other model inputs)."""

    def __init__(self, rows: list):
        self.rows, self.i = rows, 0

    def next(self):
        x = self.rows[self.i]
        self.i += 1
        return x[:, :-1].contiguous(), x[:, 1:].contiguous(), {}


def trainer_loop(cfg, base, data: list):
    """The trainer's Loop on a copy of `base` (optimizer and weight copies as `moeadapt train` makes them,
    `trainer.make_optimizer`), constant lr, over the batches `data`: (loop, trainable parameters, copies)."""
    import copy

    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    m = copy.deepcopy(base).train()
    params = [p for p in m.parameters() if p.requires_grad]
    run = LocalRun(cfg, torch.device(cfg.train.device))
    opt, copies = trainer.make_optimizer(cfg, run, m, params)
    lp = trainer.Loop(cfg, run, m, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      ListBatches(data), NullLogger(), None, 1.0, True, copies=copies)
    return lp, params, copies

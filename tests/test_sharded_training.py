"""Sharded training with our losses (issue 48): a small causal LM trained 10 AdamW steps on 2
ranks under DDP and FSDP2 (fully_shard, bfloat16 parameters through MixedPrecisionPolicy),
its loss computed inside the model's forward by each of our losses, ends with the weights
that torch's losses give (1e-3 relative, norm-wise), each step's loss too. linear_cross_entropy takes the LM head's weight in
the model's forward, where FSDP2 has it unsharded, tied to the embedding or not. On CPU with
gloo (CI)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import losses
from helpers import run_on_ranks

WORLD, VOCAB, HIDDEN, SEQUENCE, BATCH, STEPS = 2, 96, 32, 12, 4, 10
LOSSES = ("cross_entropy", "linear_cross_entropy", "mse_loss", "kl_div")


class TinyCausalLM(nn.Module):
    """Embedding, two residual MLP blocks, an LM head (tied to the embedding or not); forward
    returns the training loss by `loss` (one of LOSSES), ours or torch's."""

    def __init__(self, loss: str, ours: bool, tied: bool):
        super().__init__()
        self.loss, self.ours = loss, ours
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        hidden, labels = hidden[:, :-1], labels[:, 1:]  # each position predicts the next token
        if self.loss == "linear_cross_entropy":
            if self.ours:
                return losses.linear_cross_entropy(hidden, self.head.weight, labels)
            # ours computes in float32 from the logits in hidden's dtype, as this does
            return F.cross_entropy(F.linear(hidden, self.head.weight).flatten(0, 1).float(), labels.flatten())
        logits = self.head(hidden).float()
        if self.loss == "cross_entropy":
            return (losses.cross_entropy if self.ours else F.cross_entropy)(logits.flatten(0, 1), labels.flatten())
        # Distillation-like objectives on the same logits: towards a fixed target distribution.
        teacher = torch.linspace(-1, 1, VOCAB, device=logits.device).softmax(0).expand_as(logits)
        if self.loss == "mse_loss":
            return (losses.mse_loss if self.ours else F.mse_loss)(logits.softmax(-1), teacher)
        return (losses.kl_div if self.ours else F.kl_div)(logits.log_softmax(-1), teacher, reduction="batchmean")


def train(loss, ours, tied, wrapper, rank, device):
    """(each step's loss, the model's weights after STEPS AdamW steps), each rank on its own
    batches. The losses too: Adam's steps hardly depend on the gradients' scale."""
    torch.manual_seed(0)  # the same initial weights on every rank and for both losses
    model = TinyCausalLM(loss, ours, tied).to(device)
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)  # the root holds the head: unsharded in the model's forward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + rank)
    history = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=data).to(device)
        value = model(ids, ids)
        value.backward()
        history.append(value.detach().float())
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(history), {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
                                  for name, p in model.named_parameters()}


def check_training(rank, device, wrappers):
    """Every loss, tied head or not, under each wrapper: ours against torch's, on this rank."""
    for wrapper in wrappers:
        for loss in LOSSES:
            for tied in (False, True):
                ours_history, ours = train(loss, True, tied, wrapper, rank, device)
                history, theirs = train(loss, False, tied, wrapper, rank, device)
                # FSDP2's bfloat16 parameters make our linear loss bfloat16 (units of 2^-8), as F.linear's.
                loss_rtol = 1e-2 if wrapper == "fsdp2" else 1e-3
                torch.testing.assert_close(ours_history, history, rtol=loss_rtol, atol=1e-6,
                                           msg=lambda m: f"{wrapper} {loss} tied={tied}: losses: {m}")
                # Norm-wise: Adam's first steps are about lr * sign(gradient), so a gradient near 0
                # that rounds the other way (bfloat16 logits, torch's or ours) moves one weight by 2 lr.
                for name, weight in theirs.items():
                    error = ((ours[name] - weight).norm() / weight.norm()).item()
                    assert error <= 1e-3, f"{wrapper} {loss} tied={tied} {name}: {error:.2e} relative"


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_and_fsdp2_training_matches_torchs_losses_on_cpu(tmp_path):
    wrappers = ["ddp"] + (["fsdp2"] if fsdp2_available() else [])  # fully_shard: torch 2.6+
    run_on_ranks(check_training, (wrappers,), "gloo", tmp_path / "store", WORLD, timeout=300)

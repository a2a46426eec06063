"""BatchNorm across ranks: global-batch statistics (``model.sync_bn``) and identical running buffers.

References are single processes: plain BatchNorm on the concatenated batch, and a frozen-BatchNorm step on the
ranks' averaged buffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_rank.train.batchnorm import CrossRankBatchNorm, batchnorm_buffers, convert_to_cross_rank
from tests.helpers.distributed import run_distributed

SIZES = (3, 5)  # uneven local batches: the global statistics weight rows, not ranks


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=0.3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = sum(SIZES)
    return torch.randn(n, 3, 5, 5, generator=g, dtype=torch.float64), torch.randn(
        n, 6, generator=g, dtype=torch.float64
    )


def local_slice(rank: int) -> slice:
    start = sum(SIZES[:rank])
    return slice(start, start + SIZES[rank])


def _sync_bn_worker(rank: int, world: int) -> dict[str, object]:
    model = convert_to_cross_rank(small_net().double())
    assert sum(isinstance(m, CrossRankBatchNorm) for m in model.modules()) == 2
    outputs, grads = [], []
    for step in range(2):
        x, w = global_batch(step)
        rows = local_slice(rank)
        model.zero_grad()
        out = model(x[rows])
        (out * w[rows]).sum().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return {"outputs": outputs, "grads": grads, "buffers": [b.clone() for b in batchnorm_buffers(model)]}


@pytest.mark.distributed
def test_cross_rank_batchnorm_equals_one_process_on_the_global_batch() -> None:
    got = run_distributed(_sync_bn_worker, len(SIZES))
    reference = small_net().double()
    for step in range(2):
        x, w = global_batch(step)
        reference.zero_grad()
        out = reference(x)
        (out * w).sum().backward()
        torch.testing.assert_close(torch.cat([g["outputs"][step] for g in got]), out.detach())
        for name, p in reference.named_parameters():
            # Each rank holds the gradient of its own rows' share; the engine's reduction adds them.
            summed = sum(g["grads"][step][name] for g in got)
            torch.testing.assert_close(summed, p.grad, msg=f"step {step}, {name}")
    for rank_result in got:
        for mine, want in zip(rank_result["buffers"], batchnorm_buffers(reference)):
            torch.testing.assert_close(mine, want)


def _average_worker(rank: int, world: int) -> list[torch.Tensor]:
    from ddp_rank.train.batchnorm import sync_batchnorm_buffers

    model = small_net()
    model.train()
    x, _ = global_batch(0)
    model(x[local_slice(rank)].float())  # each rank folds its own rows into the running statistics
    sync_batchnorm_buffers(model)
    return [b.clone() for b in batchnorm_buffers(model)]


@pytest.mark.distributed
def test_running_buffers_become_the_mean_over_ranks() -> None:
    got = run_distributed(_average_worker, len(SIZES))
    x, _ = global_batch(0)
    per_rank = []
    for rank in range(len(SIZES)):
        model = small_net().train()
        model(x[local_slice(rank)].float())
        per_rank.append(batchnorm_buffers(model))
    for i, (a, b) in enumerate(zip(*got)):
        assert torch.equal(a, b), f"buffer {i} differs across ranks"
        want = per_rank[0][i] if not a.is_floating_point() else (per_rank[0][i] + per_rank[1][i]) / 2
        torch.testing.assert_close(a, want)
    assert not torch.equal(per_rank[0][0], per_rank[1][0])  # they did differ before


def _chunk_after_direct_worker(rank: int, world: int) -> dict[str, object]:
    """A direct step (BatchNorm live: the ranks' buffers drift apart), then a chunked step under DDP with
    BatchNorm frozen (the chunked step refuses BatchNorm in train mode that is not ghost batch normalisation)."""
    from torch.nn.parallel import DistributedDataParallel

    from ddp_rank.distributed import GlobalBatchLoss
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.model import freeze_batchnorm
    from ddp_rank.train.backends import DDPBackend
    from ddp_rank.train.chunking.step import forward_backward

    model = DistributedDataParallel(small_net().double())
    backend = DDPBackend(model)
    loss = GlobalBatchLoss(FastAPLoss())
    labels = torch.arange(sum(SIZES)) % 3
    rows = local_slice(rank)
    x, _ = global_batch(0)
    forward_backward(backend, x[rows], labels[rows], loss)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.zero_grad()
    before = {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}
    before["buffers"] = [b.clone() for b in batchnorm_buffers(model.module)]
    x, _ = global_batch(1)
    freeze_batchnorm(model)
    forward_backward(backend, x[rows], labels[rows], loss, chunk_size=2)
    return {**before, "grads": {n: p.grad.clone() for n, p in model.module.named_parameters()}}


@pytest.mark.distributed
def test_a_chunked_step_after_a_direct_one_uses_the_same_statistics_in_both_passes() -> None:
    from ddp_rank.losses import FastAPLoss

    got = run_distributed(_chunk_after_direct_worker, len(SIZES))
    assert not torch.equal(got[0]["buffers"][0], got[1]["buffers"][0]), "the direct step should drift them"
    reference = small_net().double()
    reference.load_state_dict(got[0]["params"], strict=False)
    for buf, a, b in zip(batchnorm_buffers(reference), got[0]["buffers"], got[1]["buffers"]):
        buf.copy_((a + b) / 2 if a.is_floating_point() else a)
    reference.eval()  # frozen BatchNorm: the running statistics, averaged over the ranks before the step
    x, _ = global_batch(1)
    labels = torch.arange(sum(SIZES)) % 3
    FastAPLoss()(reference(x), labels).backward()
    for name, p in reference.named_parameters():
        for rank_result in got:
            torch.testing.assert_close(rank_result["grads"][name], p.grad, msg=name)


def _ghost_worker(rank: int, world: int) -> dict[str, dict[str, object]]:
    """Two steps under DDP of a model with ghost batch normalisation (groups of 2), direct, then afresh chunked."""
    from torch.nn.parallel import DistributedDataParallel

    from ddp_rank.distributed import GlobalBatchLoss
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.train import DDPBackend, convert_to_ghost, forward_backward

    results = {}
    for mode, chunk in (("direct", None), ("chunked", 2)):
        model = DistributedDataParallel(convert_to_ghost(small_net().double(), 2))
        backend, loss = DDPBackend(model), GlobalBatchLoss(FastAPLoss())
        labels, rows = torch.arange(sum(GHOST_SIZES)) % 3, slice(rank * 4, rank * 4 + 4)
        grads = []
        for step in range(2):
            x, _ = global_batch(step)
            forward_backward(backend, x[: sum(GHOST_SIZES)][rows], labels[rows], loss, chunk_size=chunk)
            grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()
        results[mode] = {"grads": grads, "buffers": [b.clone() for b in batchnorm_buffers(model.module)]}
    return results


GHOST_SIZES = (4, 4)


@pytest.mark.distributed
def test_ghost_batchnorm_under_ddp_chunked_equals_direct_with_each_ranks_running_statistics() -> None:
    """Pass 1 of the chunked step updates the running statistics with this rank's groups; pass 2's forwards
    under DDP broadcast rank 0's buffers, which must not replace them: the buffers equal the direct step's."""
    got = run_distributed(_ghost_worker, 2)
    direct, chunked = [r["direct"] for r in got], [r["chunked"] for r in got]
    for rank in range(2):
        for step in range(2):
            for name, g in direct[rank]["grads"][step].items():
                torch.testing.assert_close(chunked[rank]["grads"][step][name], g, msg=f"{rank} {step} {name}")
        for mine, want in zip(chunked[rank]["buffers"], direct[rank]["buffers"]):
            torch.testing.assert_close(mine, want)
    assert not torch.equal(direct[0]["buffers"][0], direct[1]["buffers"][0]), "each rank keeps its own update"


def _trainer_worker(rank: int, world: int, shards: str, out: str) -> dict[bool, dict[str, object]]:
    """Both settings of ``model.sync_bn``, one trainer after the other in the same 2 ranks."""
    from ddp_rank.config import load_config
    from ddp_rank.train.trainer import Trainer
    from tests.helpers.training import TINY_OVERRIDES

    results = {}
    for sync_bn in (False, True):
        extra = (f"model.sync_bn={str(sync_bn).lower()}", "model.freeze_bn=never")
        cfg = load_config(
            None,
            [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}/sync-bn-{sync_bn}", "train.steps=3",
             *extra],
        )  # fmt: skip
        trainer = Trainer(cfg)
        try:
            for _ in range(3):
                trainer.train_step()  # direct steps, BatchNorm in train mode
            local = [b.clone() for b in batchnorm_buffers(trainer.unwrapped)]
            metrics = trainer.evaluate()
            path = trainer.save_checkpoint()
            after = [b.clone() for b in batchnorm_buffers(trainer.unwrapped)]
            layers = sum(isinstance(m, CrossRankBatchNorm) for m in trainer.unwrapped.modules())
            results[sync_bn] = {"local": local, "after": after, "metrics": metrics, "path": str(path),
                                "sync_layers": layers}  # fmt: skip
        finally:
            trainer.close()
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[bool, dict[str, object]]]]:
    """The tiny shards, and 3 training steps, an evaluation and a checkpoint on 2 ranks with each setting of
    ``model.sync_bn`` (one pair of ranks for both: a rank's start-up is most of the cost)."""
    from tests.helpers.training import build_tiny_shards

    tmp_path = tmp_path_factory.mktemp("trainer-bn")
    shards = build_tiny_shards(tmp_path / "data")
    return shards, run_distributed(_trainer_worker, 2, args=(str(shards), str(tmp_path / "run")), timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sync_bn", [False, True])
def test_evaluation_equals_the_saved_checkpoint_rescored(
    sync_bn: bool, trained: tuple[Path, list[dict[bool, dict[str, object]]]]
) -> None:
    """2 ranks: the evaluation and the checkpoint see one model (the ranks' averaged BatchNorm statistics), so
    re-scoring the checkpoint in one process gives the logged numbers."""
    from ddp_rank.config import load_config
    from ddp_rank.eval.runner import evaluate_model
    from ddp_rank.eval.settings import evaluation_settings
    from ddp_rank.model.checkpoint_read import load_model_weights
    from ddp_rank.model.net import build_model
    from tests.helpers.training import TINY_OVERRIDES

    shards, results = trained
    got = [result[sync_bn] for result in results]
    assert got[0]["sync_layers"] == (4 if sync_bn else 0)
    local0, local1 = got[0]["local"], got[1]["local"]
    if not sync_bn:
        assert not torch.equal(local0[0], local1[0]), "each rank folds its own rows into its statistics"
    for i, (a, b) in enumerate(zip(got[0]["after"], got[1]["after"])):
        assert torch.equal(a, b), f"buffer {i} differs across ranks after the synchronisation"
        if a.is_floating_point():
            torch.testing.assert_close(a, (local0[i] + local1[i]) / 2)
    assert got[0]["metrics"] == got[1]["metrics"]

    cfg = load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}"])
    model = build_model(cfg.model, cfg.data.image_size)
    load_model_weights(model, got[0]["path"])
    rescored = evaluate_model(model, evaluation_settings(cfg))
    for name, value in got[0]["metrics"].items():
        assert rescored[name] == pytest.approx(value, abs=1e-6), name

"""The chunked (gradient-cache) step equals the direct step, in one process.

Multi-process versions (DDP, DeepSpeed, accelerate) are in test_distributed_training.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ddp_rank.losses import PNPLoss, SmoothAPLoss
from ddp_rank.train import PlainBackend, forward_backward

N, D_IN, D_OUT = 11, 6, 5  # 11 rows in chunks of 4: 4 + 4 + 3, an uneven last chunk


def mlp(dropout: float = 0.0, batchnorm: bool = False, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(D_IN, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, D_OUT)]
    return nn.Sequential(*layers).to(dtype)


def batch(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D_IN, generator=g, dtype=dtype), torch.arange(N) % 4


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_chunked_equals_direct_without_dropout() -> None:
    inputs, labels = batch()
    direct, chunked = mlp(), mlp()
    loss_fn = SmoothAPLoss(tau=0.1)
    out_direct = forward_backward(PlainBackend(direct), inputs, labels, loss_fn)
    out_chunked = forward_backward(PlainBackend(chunked), inputs, labels, loss_fn, chunk_size=4)
    assert (out_direct.chunks, out_chunked.chunks) == (1, 3)
    assert_close(out_chunked.loss, out_direct.loss, rtol=1e-12, atol=1e-14)
    for g_chunked, g_direct in zip(grads(chunked), grads(direct)):
        assert_close(g_chunked, g_direct, rtol=1e-10, atol=1e-13)


def test_batch_that_fits_runs_the_direct_path() -> None:
    inputs, labels = batch()
    assert forward_backward(PlainBackend(mlp()), inputs, labels, PNPLoss(tau=0.1), chunk_size=N).chunks == 1


def test_dropout_masks_are_replayed() -> None:
    """With dropout, the chunked gradient equals the gradient of the same chunk forwards WITH a graph: pass 2
    sees the masks of pass 1. Without the RNG replay it would not (the control below shows the masks matter)."""
    inputs, labels = batch()
    loss_fn = PNPLoss(variant="O", tau=0.1)

    def reference(seed: int) -> list[torch.Tensor]:
        model = mlp(dropout=0.5)
        torch.manual_seed(seed)
        embeddings = torch.cat([model(chunk) for chunk in inputs.split(4)])
        loss_fn(embeddings, labels).backward()
        return grads(model)

    chunked = mlp(dropout=0.5)
    torch.manual_seed(7)
    forward_backward(PlainBackend(chunked), inputs, labels, loss_fn, chunk_size=4)
    for g_chunked, g_ref in zip(grads(chunked), reference(7)):
        assert_close(g_chunked, g_ref, rtol=1e-10, atol=1e-13)
    assert not torch.allclose(reference(8)[0], reference(7)[0]), "dropout must change the gradient"


def test_batchnorm_in_train_mode_is_refused_by_the_chunked_path_not_silently_frozen() -> None:
    """The chunked path used to freeze BatchNorm while the direct path kept it live: two functions, picked by the
    chunk. Now it refuses, and BatchNorm frozen by the caller gives the direct gradient of the frozen model
    (tests/train/test_ghost_batchnorm.py has ghost batch normalisation, which both paths compute alike)."""
    inputs, labels = batch()
    model = mlp(batchnorm=True)
    with pytest.raises(ValueError, match=r"BatchNorm layer 1 in train mode"):
        forward_backward(PlainBackend(model), inputs, labels, SmoothAPLoss(tau=0.1), chunk_size=4)

    bn = model[1]
    bn.running_mean.fill_(0.1)
    bn.eval()  # frozen by the caller
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    forward_backward(PlainBackend(model), inputs, labels, SmoothAPLoss(tau=0.1), chunk_size=4)
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), f"BatchNorm {key} changed"
    assert model.training and not bn.training, "the step leaves the modes as it found them"

    reference = mlp(batchnorm=True)
    reference.load_state_dict(model.state_dict())
    reference[1].eval()
    forward_backward(PlainBackend(reference), inputs, labels, SmoothAPLoss(tau=0.1))
    for g_chunked, g_ref in zip(grads(model), grads(reference)):
        assert_close(g_chunked, g_ref, rtol=1e-10, atol=1e-13)


def test_amp_scales_the_loss_once() -> None:
    """bfloat16 autocast with a GradScaler: after unscaling, the chunked gradients are the float32 ones (up to
    bfloat16 rounding). Scaling twice, or not at all, would be off by the scale of 2**10."""
    inputs, labels = batch(torch.float32)
    loss_fn = SmoothAPLoss(tau=0.1)
    reference = mlp(dtype=torch.float32)
    forward_backward(PlainBackend(reference), inputs, labels, loss_fn)

    model = mlp(dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    backend = PlainBackend(model, scaler=scaler, autocast_dtype=torch.bfloat16)
    out = forward_backward(backend, inputs, labels, loss_fn, chunk_size=4)
    assert out.loss.dtype == torch.float32
    scaler.unscale_(optimizer)
    for g_amp, g_ref in zip(grads(model), grads(reference)):
        assert_close(g_amp, g_ref, rtol=0.05, atol=0.05 * float(g_ref.abs().max()))


def test_rejects_bad_arguments() -> None:
    inputs, labels = batch()
    backend = PlainBackend(mlp())
    with pytest.raises(ValueError, match="chunk_size"):
        forward_backward(backend, inputs, labels, SmoothAPLoss(), chunk_size=0)
    with pytest.raises(ValueError, match="rows"):
        forward_backward(backend, inputs, labels[:-1], SmoothAPLoss(), chunk_size=4)
    with pytest.raises(ValueError, match="0-d"):
        forward_backward(backend, inputs, labels, lambda e, y: e.sum(dim=1), chunk_size=4)

"""Ghost batch normalisation and the chunked step: BatchNorm never makes the chunked step train another function.

References: per-group statistics computed by hand, plain BatchNorm layers fed the groups one at a time, and the
direct step of the same model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ddp_rank.losses import FastAPLoss, SmoothAPLoss
from ddp_rank.model import freeze_batchnorm
from ddp_rank.train import GhostBatchNorm, PlainBackend, convert_to_ghost, forward_backward
from ddp_rank.train.batchnorm import CrossRankBatchNorm, batchnorm_buffers

N, G = 12, 4  # 12 rows, groups of 4


def images(n: int = N, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 0.5


def conv_net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=0.3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
    ).double()


def test_each_group_is_normalised_with_its_own_statistics_by_hand() -> None:
    layer = GhostBatchNorm(3, group_size=G, momentum=0.25).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    x = images(10)  # groups of 4, 4 and a last one of 2
    out = layer(x)
    running_mean, running_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for start in (0, 4, 8):
        group = x[start : start + G]
        values = group.transpose(0, 1).reshape(3, -1)  # [C, rows * H * W]
        mean = values.mean(dim=1)
        var = ((values - mean[:, None]) ** 2).mean(dim=1)  # biased: what normalises
        want = (group - mean.view(1, 3, 1, 1)) / torch.sqrt(var.view(1, 3, 1, 1) + layer.eps)
        want = want * layer.weight.view(1, 3, 1, 1) + layer.bias.view(1, 3, 1, 1)
        assert_close(out[start : start + G], want)
        unbiased = var * values.shape[1] / (values.shape[1] - 1)  # unbiased: what the running variance keeps
        running_mean = 0.75 * running_mean + 0.25 * mean
        running_var = 0.75 * running_var + 0.25 * unbiased
    assert_close(layer.running_mean, running_mean)
    assert_close(layer.running_var, running_var)
    assert int(layer.num_batches_tracked) == 3  # one update per group, in order

    layer.eval()  # eval mode: the running statistics, whatever the rows
    want = (x - running_mean.view(1, 3, 1, 1)) / torch.sqrt(running_var.view(1, 3, 1, 1) + layer.eps)
    assert_close(layer(x), want * layer.weight.view(1, 3, 1, 1) + layer.bias.view(1, 3, 1, 1))


def test_a_group_of_the_whole_batch_is_plain_batchnorm_and_the_weights_load_into_a_plain_model() -> None:
    plain, ghost = conv_net(), convert_to_ghost(conv_net(), N)
    assert sum(isinstance(m, GhostBatchNorm) for m in ghost.modules()) == 2
    assert_close(ghost(images()), plain(images()))
    for a, b in zip(batchnorm_buffers(ghost), batchnorm_buffers(plain)):
        assert torch.equal(a, b)
    fresh = conv_net()
    fresh.load_state_dict(ghost.state_dict(), strict=True)  # same keys: checkpoints stay plain


def test_convert_shares_parameters_and_mode_and_refuses_global_statistics() -> None:
    net = conv_net()
    bn = net[1]
    bn.eval()
    convert_to_ghost(net, G)
    assert isinstance(net[1], GhostBatchNorm) and net[1].weight is bn.weight and not net[1].training
    assert net[1].running_mean is bn.running_mean
    with pytest.raises(ValueError, match="global batch"):
        convert_to_ghost(CrossRankBatchNorm(4), G)


def _step(model: nn.Module, chunk: int | None, seed: int = 7) -> tuple[torch.Tensor, list[torch.Tensor]]:
    labels = torch.arange(N) % 3
    torch.manual_seed(seed)
    out = forward_backward(PlainBackend(model), images(), labels, FastAPLoss(num_bins=10), chunk_size=chunk)
    assert out.chunks == (1 if chunk is None else -(-N // chunk))
    return out.loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk", [4, 8])  # 8: chunks of 8 and 4, both whole groups
def test_ghost_batchnorm_chunked_equals_direct_loss_gradient_and_running_statistics(chunk: int) -> None:
    direct, chunked = convert_to_ghost(conv_net(dropout=0.3), G), convert_to_ghost(conv_net(dropout=0.3), G)
    loss_d, grads_d = _step(direct, None)
    loss_c, grads_c = _step(chunked, chunk)
    assert_close(loss_c, loss_d, rtol=1e-12, atol=1e-14)
    for g_c, g_d in zip(grads_c, grads_d):
        assert_close(g_c, g_d, rtol=1e-10, atol=1e-12)
    # Updated once per group (three groups), by the first pass only, as the direct step does.
    for b_c, b_d in zip(batchnorm_buffers(chunked), batchnorm_buffers(direct)):
        assert_close(b_c, b_d, rtol=1e-12, atol=1e-14)
    assert int(chunked[1].num_batches_tracked) == N // G


def test_dropout_still_changes_the_ghost_step() -> None:
    """Control for the test above: with another RNG seed the dropout masks, and so the gradients, differ."""
    _, first = _step(convert_to_ghost(conv_net(dropout=0.3), G), G, seed=7)
    _, second = _step(convert_to_ghost(conv_net(dropout=0.3), G), G, seed=8)
    assert not torch.allclose(first[0], second[0])


def test_a_chunked_step_refuses_batchnorm_that_would_change_the_function() -> None:
    labels = torch.arange(N) % 3
    plain = conv_net()
    before = [b.clone() for b in batchnorm_buffers(plain)]
    with pytest.raises(ValueError, match=r"cannot compute the batch statistics .* freeze BatchNorm"):
        forward_backward(PlainBackend(plain), images(), labels, SmoothAPLoss(tau=0.1), chunk_size=N - 1)
    assert all(torch.equal(a, b) for a, b in zip(batchnorm_buffers(plain), before)), "refused before a forward"
    # A chunk that holds the batch is the direct step, with the batch's statistics: no other path.
    assert forward_backward(PlainBackend(plain), images(), labels, SmoothAPLoss(tau=0.1), chunk_size=N).chunks == 1
    ghost = convert_to_ghost(conv_net(), G)
    with pytest.raises(ValueError, match="multiple of 4"):
        forward_backward(PlainBackend(ghost), images(), labels, SmoothAPLoss(tau=0.1), chunk_size=6)


def test_a_layer_without_running_statistics_is_refused_even_in_eval_mode() -> None:
    """Such a layer normalises with the statistics of its input in eval mode too: freezing does not help."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(75, 6), nn.BatchNorm1d(6, track_running_stats=False)).double()
    model.eval()
    with pytest.raises(ValueError, match="cannot compute the batch statistics"):
        forward_backward(PlainBackend(model), images(), torch.arange(N) % 3, SmoothAPLoss(tau=0.1), chunk_size=4)


def test_frozen_batchnorm_chunked_equals_direct_and_leaves_the_statistics() -> None:
    direct, chunked = conv_net(), conv_net()
    for model in (direct, chunked):
        model.train()
        freeze_batchnorm(model)
    before = [b.clone() for b in batchnorm_buffers(chunked)]
    loss_d, grads_d = _step(direct, None)
    loss_c, grads_c = _step(chunked, 5)
    assert_close(loss_c, loss_d, rtol=1e-12, atol=1e-14)
    for g_c, g_d in zip(grads_c, grads_d):
        assert_close(g_c, g_d, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(batchnorm_buffers(chunked), before))

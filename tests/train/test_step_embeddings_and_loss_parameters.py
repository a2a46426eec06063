"""What ``forward_backward`` gives a user's own loop: the detached embeddings when asked, and the gradient of a
loss's own parameters (a proxy loss) on the direct and the chunked path alike, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from ddp_rank.train import PlainBackend, forward_backward
from tests.train.test_chunked_step import N, batch, grads, mlp


class CentroidLoss(nn.Module):
    """A loss with parameters of its own: one learnt centre per class, softmax over negative distances."""

    def __init__(self, classes: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.centres = nn.Parameter(torch.randn(classes, width, dtype=torch.float64))

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        logits = -(torch.cdist(embeddings, self.centres) ** 2)
        return nn.functional.cross_entropy(logits, labels)


@pytest.mark.parametrize("chunk_size", [None, 4], ids=["direct", "chunked"])
def test_embeddings_are_returned_detached_when_asked(chunk_size: int | None) -> None:
    inputs, labels = batch()
    model = mlp()
    loss = CentroidLoss(4, 5)
    out = forward_backward(PlainBackend(model), inputs, labels, loss, chunk_size, return_embeddings=True)
    assert out.embeddings is not None and not out.embeddings.requires_grad
    assert_close(out.embeddings, model(inputs).detach(), rtol=1e-12, atol=1e-14)
    plain = forward_backward(PlainBackend(mlp()), inputs, labels, CentroidLoss(4, 5), chunk_size)
    assert plain.embeddings is None


def test_loss_parameters_get_the_same_gradient_on_both_paths() -> None:
    inputs, labels = batch()
    results = []
    for chunk_size in (None, 4):
        model, loss = mlp(), CentroidLoss(4, 5)
        out = forward_backward(PlainBackend(model), inputs, labels, loss, chunk_size)
        assert out.chunks == (1 if chunk_size is None else 3)
        assert loss.centres.grad is not None and loss.centres.grad.abs().max() > 1e-6
        results.append((out.loss, loss.centres.grad.clone(), grads(model)))
    (loss_d, centres_d, model_d), (loss_c, centres_c, model_c) = results
    assert_close(loss_c, loss_d, rtol=1e-12, atol=1e-14)
    assert_close(centres_c, centres_d, rtol=1e-10, atol=1e-13)
    for g_chunked, g_direct in zip(model_c, model_d):
        assert_close(g_chunked, g_direct, rtol=1e-10, atol=1e-13)
    assert N > 4

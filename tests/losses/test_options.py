"""The keyword arguments every listwise loss takes are declared once (``ListwiseOptions``) and reach
``ListwiseLoss`` from each loss unchanged."""

from __future__ import annotations

import inspect

import pytest
import torch

from ddp_rank.losses import FastAPLoss, ListwiseLoss, ListwiseOptions, PNPLoss, SmoothAPLoss

LOSSES = (FastAPLoss, PNPLoss, SmoothAPLoss)


def test_the_options_are_the_base_class_keywords_and_no_loss_repeats_them() -> None:
    base = inspect.signature(ListwiseLoss.__init__).parameters
    keywords = [name for name, p in base.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == list(ListwiseOptions.__annotations__)
    for loss in LOSSES:
        own = inspect.signature(loss.__init__).parameters
        assert not set(own) & set(keywords), f"{loss.__name__} declares a common keyword again"
        assert own["options"].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_hands_its_options_to_the_base_class(loss: type[ListwiseLoss]) -> None:
    options: ListwiseOptions = {
        "normalize": False,
        "chunk_rows": 3,
        "matmul_precision": "bf16",
        "kernel": "torch",
    }
    built = loss(**options)
    assert (built.normalize, built.chunk_rows, built.matmul_precision, built.kernel) == (
        False,
        3,
        "bf16",
        "torch",
    )
    default = loss()
    assert (default.normalize, default.chunk_rows, default.matmul_precision) == (True, None, "highest")
    with pytest.raises(TypeError, match="memroy_budget"):
        loss(memroy_budget=2**20)  # type: ignore[call-arg]
    embeddings, labels = torch.nn.functional.normalize(torch.randn(12, 4), dim=1), torch.arange(12) // 3
    assert torch.isfinite(built(embeddings, labels))

"""Every reference vector of the authors' code and of pytorch-metric-learning, loss and gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.reference import REFERENCE_DIR, load_case, reference_files

FILES = reference_files()


def test_reference_files_are_present():
    assert len(FILES) >= 58, f"expected the reference vectors in {REFERENCE_DIR}, found {len(FILES)}"


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-300))


@pytest.mark.parametrize("file", FILES)
def test_float64_matches_reference(file):
    case = load_case(file)
    x = torch.tensor(case.embeddings, requires_grad=True)
    loss = case.module(x, torch.tensor(case.labels))
    loss.backward()
    assert loss.dtype == torch.float64
    assert abs(loss.item() - case.loss) <= 1e-9 * abs(case.loss)
    assert _relative(x.grad.numpy(), case.grad) <= 1e-9


@pytest.mark.parametrize("file", FILES)
def test_float32_within_1e_5(file):
    case = load_case(file)
    x = torch.tensor(case.embeddings, dtype=torch.float32, requires_grad=True)
    loss = case.module(x, torch.tensor(case.labels))
    loss.backward()
    assert x.grad.dtype == torch.float32
    assert abs(loss.item() - case.loss) <= 1e-5 * abs(case.loss)
    assert _relative(x.grad.double().numpy(), case.grad) <= 1e-5


@pytest.mark.parametrize("file", FILES)
def test_valid_query_count_matches_reference(file):
    case = load_case(file)
    x = torch.tensor(case.embeddings)
    x = torch.nn.functional.normalize(x, dim=1)
    out = case.module.rows(x, torch.arange(len(x)), x, torch.tensor(case.labels), need_grad=False)
    assert out.n_valid == case.n_valid
    assert out.loss_sum.item() / out.n_valid == pytest.approx(case.loss, rel=1e-9)

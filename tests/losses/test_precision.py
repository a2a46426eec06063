"""The opt-in faster similarity matmul: bf16 (and TF32, a no-op on CPU) moves the loss only slightly."""

from __future__ import annotations

import pytest
import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

MAKE = {
    "fastap": lambda p: FastAPLoss(matmul_precision=p),
    "pnp": lambda p: PNPLoss("Dq", alpha=4.0, matmul_precision=p),
    "smoothap": lambda p: SmoothAPLoss(matmul_precision=p),
}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(512) // 4
    return torch.randn(129, 128, generator=g)[labels] + torch.randn(512, 128, generator=g), labels


@pytest.mark.parametrize("name", sorted(MAKE))
def test_bf16_similarities_move_the_loss_by_little(name: str) -> None:
    x, y = batch()
    values, grads = {}, {}
    for precision in ("highest", "tf32", "bf16"):
        e = x.clone().requires_grad_()
        value = MAKE[name](precision)(e, y)
        value.backward()
        values[precision], grads[precision] = float(value.detach()), e.grad
    assert values["tf32"] == values["highest"], "TF32 only changes CUDA matmuls"
    assert values["bf16"] != values["highest"], "bf16 operands must actually be used"
    assert abs(values["bf16"] - values["highest"]) < 1e-3
    cosine = torch.nn.functional.cosine_similarity(grads["bf16"].flatten(), grads["highest"].flatten(), dim=0)
    assert cosine > 0.95, f"the gradient direction survives bf16 similarities (cosine {cosine:.3f})"
    change = float((grads["bf16"] - grads["highest"]).norm() / grads["highest"].norm())
    assert change < (0.2 if name == "fastap" else 0.05), f"bf16 moved the gradient by {change:.1%}"


def test_unknown_precision_and_ranks_must_agree() -> None:
    with pytest.raises(ValueError, match="matmul_precision must be one of highest, tf32, bf16"):
        FastAPLoss(matmul_precision="fp8")
    assert FastAPLoss(matmul_precision="bf16").signature() != FastAPLoss().signature()


def test_a_torch_without_mm_out_dtype_multiplies_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """matmul_precision=bf16 on CUDA asks torch.mm for a float32 result of bf16 operands (``out_dtype``), a
    keyword older torch releases lack: there the product falls back to float32 operands instead of failing
    with a TypeError at the first step."""
    from ddp_rank.losses import matmul

    a = torch.randn(5, 8).to(torch.bfloat16)
    b = torch.randn(8, 3).to(torch.bfloat16)
    real_mm = torch.mm

    def old_mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # no out_dtype keyword
        return real_mm(x, y)

    matmul.mm_takes_out_dtype.cache_clear()
    monkeypatch.setattr(torch, "mm", old_mm)
    try:
        with pytest.warns(UserWarning, match="no torch.mm\\(out_dtype"):
            product = matmul.mm_float32_out(a, b)
        assert product.dtype == torch.float32
        torch.testing.assert_close(product, a.float() @ b.float())
    finally:
        matmul.mm_takes_out_dtype.cache_clear()
    monkeypatch.undo()
    assert matmul.mm_takes_out_dtype()  # the torch the suite runs on has the keyword


@pytest.mark.parametrize("name", sorted(MAKE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_loss_under_autocast_is_the_loss_of_its_inputs(name: str, dtype: torch.dtype) -> None:
    """A user's loop computes the loss inside ``torch.autocast`` (the model's forward and the loss in one block).
    Autocast would run the loss's matmuls in half precision, whose results the float32 gradient buffers refuse
    (an ``index_put`` dtype error at the first step); the loss takes its own precision (``matmul_precision``)
    instead: the same value and gradient as on the same embeddings outside autocast, the gradient in the
    embeddings' dtype."""
    x, y = batch()
    x = x.to(dtype)
    results = []
    for under_autocast in (False, True):
        e = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=under_autocast):
            value = MAKE[name]("highest")(e, y)
        value.backward()
        assert e.grad is not None and e.grad.dtype == dtype
        results.append((value.detach(), e.grad))
    (plain_value, plain_grad), (value, grad) = results
    assert value.dtype == plain_value.dtype == torch.float32
    assert torch.equal(value, plain_value) and torch.equal(grad, plain_grad)


def _tf32_on() -> bool:
    """CUDA's TF32 switch for float32 matmuls (a flag anyone can read, on CPU too), by the API torch has."""
    matmul = torch.backends.cuda.matmul
    return matmul.fp32_precision == "tf32" if hasattr(matmul, "fp32_precision") else bool(matmul.allow_tf32)


class _TF32AtEachMatmul(torch.overrides.TorchFunctionMode):
    """Records, at every matmul the loss makes, whether CUDA's TF32 switch is on (so what the loss asks of a GPU
    shows on CPU too)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in ("mm", "addmm_", "addmm", "matmul"):
            self.seen.append((name, _tf32_on()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(MAKE))
@pytest.mark.parametrize("precision", ["highest", "tf32"])
def test_tf32_takes_the_similarity_and_both_gradient_matmuls(name: str, precision: str) -> None:
    """``matmul_precision=tf32`` is for all three matmuls of a chunk (Q E^T, G E, G^T Q), as ``allow_tf32`` would
    be: the three are the floor of the loss's time, so TF32 on the similarity alone could not buy a third of it.
    The switch is put back after the call."""
    x, y = batch()
    e = x.clone().requires_grad_()
    before = _tf32_on()
    with _TF32AtEachMatmul() as mode:
        MAKE[name](precision)(e, y).backward()
    kinds = {kind for kind, _ in mode.seen}
    assert {"mm", "addmm_"} <= kinds, mode.seen  # the similarity and G E (mm), G^T Q (addmm_)
    assert len(mode.seen) >= 3
    assert all(on == (precision == "tf32") for _, on in mode.seen), mode.seen
    assert _tf32_on() == before


def test_tf32_keeps_a_setting_made_with_either_api() -> None:
    """A program that set TF32 with torch's newer ``fp32_precision`` must not meet torch's refusal to mix the
    two APIs (which reading ``allow_tf32`` would raise), and gets its setting back after the loss."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has the legacy TF32 flag only")
    x, y = batch()
    previous = matmul.fp32_precision
    try:
        for setting in ("tf32", "ieee"):
            matmul.fp32_precision = setting
            FastAPLoss(matmul_precision="tf32")(x.clone().requires_grad_(), y).backward()
            assert matmul.fp32_precision == setting
    finally:
        matmul.fp32_precision = previous

"""DeepSpeed's checkpoint files under the same guard as accelerate's: DeepSpeed 0.19 loads them with
``torch.load(weights_only=False)``; inside ``weights_only_loads`` that load is weights-only with DeepSpeed's own
classes allowed, a ZeRO checkpoint still loads exactly, and a pickle that would run code planted in any of its
files does not run (one process on DeepSpeed's CPU accelerator)."""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_rank.model.safe_pickles import (
    RNG_STATE_TYPES,
    deepspeed_types,
    unsafe_files,
    weights_only_loads,
)
from tests.helpers.distributed import run_distributed


class RunsCode:
    """Unpickled without restriction, this calls ``os.system`` (``touch`` of a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.rand(4, 4)

    def step() -> None:
        engine.backward(engine(x).square().sum())
        engine.step()

    step()
    saved = Path(root) / "saved"
    engine.save_checkpoint(str(saved), tag="t")
    at_save = _params(engine)
    step()  # one more step: the weights and Adam moments move on
    step()
    after_one_more = _params(engine)
    allowed = [*RNG_STATE_TYPES, *deepspeed_types()]
    out: dict[str, Any] = {"files": sorted(p.name for p in (saved / "t").iterdir())}
    out["scan"] = unsafe_files(saved, allowed)
    out["scan_without_deepspeed_types"] = unsafe_files(saved, RNG_STATE_TYPES)
    try:  # DeepSpeed asks for weights_only=False; inside the block it gets weights_only with torch's defaults
        with weights_only_loads(RNG_STATE_TYPES):
            engine.load_checkpoint(str(saved), tag="t")
        out["without_deepspeed_types"] = "loaded"
    except pickle.UnpicklingError as exc:
        out["without_deepspeed_types"] = str(exc)
    with weights_only_loads(allowed):
        engine.load_checkpoint(str(saved), tag="t")
    out["restored"] = all(torch.equal(a, b) for a, b in zip(_params(engine), at_save))
    step()
    step()  # the same two steps from the restored state (Adam moments included) give the same weights
    out["same_steps_again"] = all(torch.equal(a, b) for a, b in zip(_params(engine), after_one_more))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        planted = Path(root) / name
        shutil.copytree(saved, planted)
        marker = Path(root) / f"{name}.ran"
        torch.save({"state": RunsCode(marker)}, planted / "t" / name)
        outcome: dict[str, Any] = {"scan": unsafe_files(planted, allowed)}
        try:
            with weights_only_loads(allowed):
                engine.load_checkpoint(str(planted), tag="t")
            outcome["load"] = "loaded"
        except pickle.UnpicklingError as exc:
            outcome["load"] = str(exc)
        outcome["ran"] = marker.exists()
        out[name] = outcome
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_checkpoints_load_weights_only_and_run_no_planted_code(tmp_path: Path) -> None:
    """Needs DeepSpeed's CPU comm op: the first run on a machine JIT-compiles it (minutes of CPU)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional [deepspeed] extra")
    (out,) = run_distributed(_worker, 1, args=(str(tmp_path),), timeout=600)
    assert out["files"] == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert out["scan"] is None, "the allowed types cover what DeepSpeed writes"
    assert "names deepspeed." in (out["scan_without_deepspeed_types"] or "")
    assert "deepspeed." in out["without_deepspeed_types"], "DeepSpeed's weights_only=False was not overridden"
    assert out["restored"] and out["same_steps_again"]
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        outcome = out[name]
        assert not outcome["ran"], f"{name}: the planted pickle ran"
        assert f"t/{name} names posix.system, which no checkpoint needs" in (outcome["scan"] or ""), outcome
        assert "posix.system" in outcome["load"], outcome

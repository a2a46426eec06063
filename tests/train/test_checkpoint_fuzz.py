"""Fuzzing the checkpoint folder: hundreds of seeded mutations of a run's two checkpoints (truncation, flipped
and appended bytes, missing, extra and replaced files, a damaged ``meta.json`` and its record of the files).

Each case goes through what a resume does (the newest intact checkpoint, then accelerate's ``load_state`` of it)
and what ``eval`` / ``export`` do (the latest checkpoint's weights). Each must end within seconds in one of: the
latest checkpoint loads (the mutation left its recorded files alone), a fall back to the intact earlier one, or a
one-line :class:`CheckpointError` naming the checkpoint. Never another exception, never a damaged checkpoint
taken for an intact one.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddp_rank.model.checkpoint_read import (
    FILES_KEY,
    META_NAME,
    CheckpointError,
    load_model_weights,
    newest_intact_checkpoint,
)
from ddp_rank.train.checkpoints.write import CheckpointManager

CASES = 400
SEED = 20261125
SECONDS_PER_CASE = 5.0


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoints/step-00000002 and step-00000004 of a tiny model trained with Adam, saved by accelerate."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    root = tmp_path_factory.mktemp("fuzz") / "checkpoints"
    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    manager = CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3, 4):
        loss = model(torch.randn(8, 6)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            manager.save(step, {"world_size": 1}, lambda d: accelerator.save_state(str(d)))
    AcceleratorState._reset_state(True)
    return root


# ------------------------------------------------------------------------------------------------ mutations
def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.is_file() and p.name != META_NAME)


def truncate(rng: random.Random, ckpt: Path) -> str:
    f = rng.choice(_files(ckpt))
    data = f.read_bytes()
    f.write_bytes(data[: rng.randrange(len(data))])
    return "changed"


def flip(rng: random.Random, ckpt: Path) -> str:
    f = rng.choice(_files(ckpt))
    data = bytearray(f.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    f.write_bytes(bytes(data))
    return "changed"


def append(rng: random.Random, ckpt: Path) -> str:
    f = rng.choice(_files(ckpt))
    f.write_bytes(f.read_bytes() + rng.randbytes(rng.randint(1, 64)))
    return "changed"


def delete(rng: random.Random, ckpt: Path) -> str:
    rng.choice(_files(ckpt)).unlink()
    return "changed"


def to_folder(rng: random.Random, ckpt: Path) -> str:
    f = rng.choice(_files(ckpt))
    f.unlink()
    f.mkdir()
    return "changed"


def extra(rng: random.Random, ckpt: Path) -> str:
    name = rng.choice(["notes.txt", "random_states_1.pkl", "model_1.safetensors", ".DS_Store"])
    (ckpt / name).write_bytes(rng.randbytes(rng.randint(0, 256)))
    return "harmless"


def _edit_meta(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((ckpt / META_NAME).read_text())
    edit(meta)
    (ckpt / META_NAME).write_text(json.dumps(meta))


def meta_bytes(rng: random.Random, ckpt: Path) -> str:
    """meta.json cut or garbled: no longer a JSON object with its step, or (rarely) still one."""
    meta = ckpt / META_NAME
    data = bytearray(meta.read_bytes())
    if rng.random() < 0.5:
        data = data[: rng.randrange(len(data))]
    else:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    meta.write_bytes(bytes(data))
    try:
        still = json.loads(data)
        return "unknown" if isinstance(still, dict) else "changed"
    except ValueError:
        return "changed"


def meta_missing(rng: random.Random, ckpt: Path) -> str:
    (ckpt / META_NAME).unlink()
    return "incomplete"


def record_damaged(rng: random.Random, ckpt: Path) -> str:
    """The record of the files: a wrong digest or size, a bad type, a name outside the folder, garbage."""
    kind = rng.randrange(6)

    def edit(meta: dict[str, Any]) -> None:
        files = meta[FILES_KEY]
        name = rng.choice(sorted(files))
        if kind == 0:
            files[name]["sha256"] = "0" * 64
        elif kind == 1:
            files[name]["bytes"] += rng.choice([-1, 1, 1 << 40])
        elif kind == 2:
            files[name]["bytes"] = rng.choice(["12", -5, None, 1.5, True])
        elif kind == 3:
            files[rng.choice(["../../etc/hostname", "/etc/passwd", "nowhere.bin"])] = dict(files[name])
        elif kind == 4:
            meta[FILES_KEY] = rng.choice([[], "x", 3, {"a": 1}])
        else:
            del files[name]["sha256"]

    _edit_meta(ckpt, edit)
    return "changed"


def record_removed(rng: random.Random, ckpt: Path) -> str:
    """A checkpoint of an older version: no record, the files intact (checked by structure)."""
    _edit_meta(ckpt, lambda meta: meta.pop(FILES_KEY))
    return "harmless"


MUTATIONS = [truncate, flip, append, delete, to_folder, extra, meta_bytes, meta_missing, record_damaged,
             record_removed]  # fmt: skip


# ------------------------------------------------------------------------------------------------ the reader
def resume_outcome(root: Path, latest: Path) -> tuple[str, Path | None]:
    """What ``train.resume=auto`` does: the newest intact checkpoint, loaded by accelerate; or the error."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    path, damaged = newest_intact_checkpoint(root)
    if path is None:
        return ("error" if damaged else "fresh start"), None
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(str(path))  # a checkpoint found intact must load: any exception fails the test
    assert optimizer.state_dict()["state"], "the optimizer state was restored"
    return ("latest" if path == latest else "fell back"), path


def eval_outcome(latest: Path) -> str:
    """What ``eval`` / ``export`` do with the latest checkpoint: its weights, or one line naming it."""
    try:
        load_model_weights(tiny_model(), latest)
    except CheckpointError as exc:
        message = str(exc)
        assert "\n" not in message and str(latest) in message, message
        return "refused"
    return "loaded"


@pytest.mark.slow
def test_hundreds_of_damaged_checkpoint_folders(
    pristine: Path, tmp_path: Path, fresh_accelerator_state: None
) -> None:
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    slowest = 0.0
    for case in range(CASES):
        root = tmp_path / f"case-{case}"
        shutil.copytree(pristine, root)
        latest, earlier = root / "step-00000004", root / "step-00000002"
        mutation = rng.choice(MUTATIONS)
        effect = mutation(rng, latest)
        both = rng.random() < 0.25  # the earlier checkpoint damaged too: nothing intact to fall back to
        effect_earlier = rng.choice(MUTATIONS)(rng, earlier) if both else "harmless"
        what = f"case {case}: {mutation.__name__} ({effect}), earlier {'damaged' if both else 'intact'}"
        t0 = time.perf_counter()
        resumed, _ = resume_outcome(root, latest)
        evaluated = (
            eval_outcome(latest) if latest.is_dir() and (latest / META_NAME).is_file() else "incomplete"
        )
        seconds = time.perf_counter() - t0
        slowest = max(slowest, seconds)
        assert seconds < SECONDS_PER_CASE, f"{what}: {seconds:.1f} s"
        if effect in ("changed", "incomplete"):
            assert resumed != "latest", f"{what}: a damaged latest checkpoint was resumed"
        if effect == "changed":
            assert evaluated == "refused", f"{what}: eval loaded a damaged checkpoint"
        if effect == "harmless":
            assert resumed == "latest" and evaluated == "loaded", f"{what}: an intact checkpoint was refused"
        if effect_earlier == "harmless" and effect != "unknown":
            assert resumed in ("latest", "fell back"), f"{what}: {resumed} with an intact earlier checkpoint"
        outcomes[f"resume: {resumed}"] += 1
        outcomes[f"eval: {evaluated}"] += 1
        shutil.rmtree(root)
    print(
        f"\n{CASES} cases, slowest {slowest:.2f} s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
    )
    assert {"resume: latest", "resume: fell back", "resume: error", "eval: loaded", "eval: refused"} <= set(
        outcomes
    )

"""`ddp-rank plan` and every shipped config against manifests shaped like the real datasets (no images)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.train.chunking.plan_report import describe_plan
from tests.helpers.dataset_shapes import write

# Tests of seconds (every config's plan on its dataset's full shape): in make test, out of make test-fast.
pytestmark = pytest.mark.slow

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
# The world sizes each config is meant for (its header comment): one GPU and the launchers' node sizes.
WORLDS = {"demo": (1, 2), "inat_fastap_resnet50_global65536": (8, 64)}


def _shape(stem: str) -> str:
    return stem.split("_")[0]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_can_start_on_its_dataset(path: Path, tmp_path: Path) -> None:
    shards = write(_shape(path.stem), tmp_path / "shards")
    cfg = load_config(path, [f"data.shards={shards}"])
    for world in WORLDS.get(path.stem, (1, 8)):
        facts, problems = describe_plan(cfg, world)
        assert problems == [], f"{path.name} on {world} rank(s): {problems}"
        steps = int(dict(facts)["steps per epoch"].replace(",", ""))
        if path.stem.startswith("sop_fastap"):
            assert steps == 66 * 5, "FastAP supplement A: 12 categories, every pair 5 times"
        if path.stem.startswith("inshop"):
            assert steps == 253 * 2, "FastAP supplement A: 23 categories, every pair twice"


def test_the_papers_vehicleid_epoch(tmp_path: Path) -> None:
    """Each labelled model gives ceil(N_c / (M/2)) steps (supplement A: sum 2 N_c / M), small ones left out."""
    shards = write("vehicleid", tmp_path / "s")
    cfg = load_config(Path("configs/vehicleid_fastap_resnet50_m256.yaml"), [f"data.shards={shards}"])
    facts, problems = describe_plan(cfg, 8)
    assert not problems
    left = [v for k, v in facts if k == "left out"]
    assert left and all("a step needs 128 images" in v for v in left)
    manifest = Manifest.load(shards)
    per_model: dict[int, int] = {}
    for cid, n in manifest.split("train").class_counts.items():
        model = manifest.classes[cid].category
        if model is not None:
            per_model[model] = per_model.get(model, 0) + n
    expected = sum(-(-n // 128) for n in per_model.values() if n >= 128)
    assert int(dict(facts)["steps per epoch"].replace(",", "")) == expected


def test_plan_command_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = write("inat", tmp_path / "s")
    code = main(
        [
            "plan",
            "--config",
            "configs/inat_fastap_resnet50_global65536.yaml",
            "--world-size",
            "64",
            f"data.shards={shards}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "64 / 1,024 images" in out
    assert "chunked, 4 chunks of 256" in out
    assert "left out" in out and "Protozoa: a step needs 32768 images" in out
    assert "ok: the run can start" in out


def test_plan_says_why_a_config_cannot_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The old SOP 65,536 setup: no SOP category holds 32,768 images."""
    shards = write("sop", tmp_path / "s")
    code = main(
        [
            "plan",
            "--config",
            "configs/sop_fastap_resnet18_m256.yaml",
            "data.global_batch_size=65536",
            f"data.shards={shards}",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "cannot start" in captured.err and "needs 2 categories" in captured.err
    assert "bicycle: a step needs 32768 images" in captured.err
    code = main(
        [
            "plan",
            "--config",
            "configs/sop_fastap_resnet18_m256.yaml",
            "--world-size",
            "3",
            f"data.shards={shards}",
        ]
    )
    assert code == 1 and "not divisible by 3" in capsys.readouterr().err


def test_overrides_may_stand_on_both_sides_of_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddp_rank.cli import parse_command

    args = parse_command(
        ["train", "train.steps=2", "--config", "configs/demo.yaml", "train.seed=1", "eval.ks=1"]
    )
    assert args.config == "configs/demo.yaml"
    assert args.overrides == ["train.steps=2", "train.seed=1", "eval.ks=1"]
    args = parse_command(["plan", "data.sampler=pk", "--world-size", "4", "train.seed=1", "--steps", "1"])
    assert (args.world_size, args.steps, args.overrides) == (4, 1, ["data.sampler=pk", "train.seed=1"])
    with pytest.raises(SystemExit):
        parse_command(["train", "train.steps=2", "--bogus", "train.seed=1"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    shards = write("sop", tmp_path / "s")
    code = main(["plan", f"data.shards={shards}", "--config", "configs/sop_fastap_resnet18_m256.yaml",
                 "--world-size", "2", "train.seed=3"])  # fmt: skip
    assert code == 0 and "ok: the run can start" in capsys.readouterr().out


def test_plan_reports_the_work_space_the_step_uses(tmp_path: Path) -> None:
    """The work space line is the loss's own chunk plan for this batch on the run's device, beside the budget
    (a 128-image batch on a CPU takes well under a MiB, not the budget)."""
    shards = write("sop", tmp_path / "s")
    # The loss's work space does not depend on the backbone: the tiny one spares probing a ResNet's activations.
    cfg = load_config(None, [f"data.shards={shards}", "data.global_batch_size=128", "loss.name=pnp",
                             "model.backbone=tiny_cnn"])  # fmt: skip
    facts, problems = describe_plan(cfg, 2, device="cpu")
    assert not problems
    line = dict(facts)["loss work space per rank"]
    assert "on cpu" in line and "budget 32.0 MiB" in line and "1 chunk(s) of 64 query rows" in line
    assert "GiB" not in line


@pytest.mark.parametrize(("budget_mb", "chunked"), [(1, True), (4096, False)])
def test_plan_says_which_chunk_auto_chooses_and_why(tmp_path: Path, budget_mb: int, chunked: bool) -> None:
    shards = write("sop", tmp_path / "s")
    cfg = load_config(None, [f"data.shards={shards}", "data.global_batch_size=256", "model.backbone=tiny_cnn",
                             "data.image_size=32", "data.resize_size=32", f"distributed.memory_budget_mb={budget_mb}"])  # fmt: skip
    facts, problems = describe_plan(cfg, 2, device="cpu")
    assert not problems
    why, step = dict(facts)["chunk (auto)"], dict(facts)["step"]
    assert "of activations per image" in why and f"distributed.memory_budget_mb={budget_mb}" in why
    assert step.startswith("chunked") is chunked and ("runs in chunks of" in why) is chunked


def _tiny_cnn_plan(shards: Path, *overrides: str) -> list[str]:
    return [f"data.shards={shards}", "data.global_batch_size=256", "model.backbone=tiny_cnn", *overrides]


def test_plan_cannot_start_when_not_even_one_image_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = write("sop", tmp_path / "s")
    args = _tiny_cnn_plan(
        shards, "data.image_size=512", "data.resize_size=512", "distributed.memory_budget_mb=1"
    )
    facts, problems = describe_plan(load_config(None, args), 2, device="cpu")
    assert any("exceed the memory budget" in p for p in problems), problems
    assert dict(facts)["step"] == "none: the run cannot start"
    assert main(["plan", "--world-size", "2", "--device", "cpu", *args]) == 1
    captured = capsys.readouterr()
    assert "cannot start" in captured.err and "exceed the memory budget" in captured.err
    assert "ok: the run can start" not in captured.out


def test_plan_probes_in_the_precision_the_launcher_gives_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.mixed_precision=auto under a bf16 launcher: the trainer probes under bf16 autocast, so plan does."""
    shards = write("sop", tmp_path / "s")
    cfg = load_config(None, _tiny_cnn_plan(shards, "data.image_size=32", "data.resize_size=32"))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    facts, problems = describe_plan(cfg, 2, device="cpu")
    assert not problems
    assert (
        dict(facts)["mixed precision"] == "bf16" and "under bfloat16 autocast" in dict(facts)["chunk (auto)"]
    )
    fp16 = load_config(None, _tiny_cnn_plan(shards, "train.mixed_precision=fp16"))
    _, problems = describe_plan(fp16, 2, device="cpu")
    assert any("the launcher asks for mixed precision bf16" in p for p in problems), problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for a GPU this machine does not have")
def test_plan_for_a_gpu_it_does_not_have_leaves_the_step_to_start_up(tmp_path: Path) -> None:
    shards = write("sop", tmp_path / "s")
    cfg = load_config(None, _tiny_cnn_plan(shards, "data.image_size=32", "data.resize_size=32"))
    facts, problems = describe_plan(cfg, 2, device="cuda")
    assert not problems
    assert "chosen at start-up" in dict(facts)["chunk (auto)"]
    assert dict(facts)["step"] == "chunked or direct, decided at start-up from the GPU's free memory"


def test_plan_says_the_batchnorm_mode_and_keeps_ghost_groups_whole(tmp_path: Path) -> None:
    shards = write("sop", tmp_path / "s")
    base = _tiny_cnn_plan(shards, "data.image_size=32", "data.resize_size=32", "distributed.memory_budget_mb=1")
    facts, problems = describe_plan(load_config(None, [*base, "model.bn_group_size=4"]), 2, device="cpu")
    assert not problems
    assert "statistics of each group of 4 local images" in dict(facts)["BatchNorm"]
    chunk = int(dict(facts)["step"].rsplit(" ", 1)[1])
    why = dict(facts)["chunk (auto)"]
    chosen = int(why.split("runs in chunks of ")[1].split(";")[0].replace(",", ""))
    assert chunk % 4 == 0 and chunk == chosen - chosen % 4
    assert ("to hold whole BatchNorm groups of 4" in why) is (chosen % 4 != 0)

    facts, problems = describe_plan(load_config(None, base), 2, device="cpu")  # the default: freeze_bn=auto
    assert not problems and dict(facts)["BatchNorm"].startswith("frozen")

    # Live statistics of the whole local batch cannot be chunked: refused, not trained as another function.
    facts, problems = describe_plan(load_config(None, [*base, "model.freeze_bn=never"]), 2, device="cpu")
    assert any("whole local batch of 128 images" in p for p in problems), problems
    assert dict(facts)["step"] == "none: the run cannot start"

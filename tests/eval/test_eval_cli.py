"""``ddp-rank eval`` on shards built by the dataset recipes, with the run's own config.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.train.trainer import run_training
from tests.helpers.recipe_datasets import recipe_shards
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step tiny_cnn run (16-d embeddings): its config.yaml is what eval must read to rebuild the model."""
    tmp = tmp_path_factory.mktemp("run")
    shards = build_tiny_shards(tmp)
    out = tmp / "run"
    run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}",
                                    "train.steps=2", "model.embedding_dim=12"]))  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ("sop", {"split 'test'", "R@1", "MAP@R"}),
        ("inshop", {"split 'test'", "R@1", "MAP@R"}),
        ("vehicleid", {"split 'test_small, test_medium, test_large'", "small/R@1", "large/R@5"}),
    ],
)
def test_eval_on_recipe_shards_with_the_runs_config(
    recipe: str, expected: set[str], run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shards = recipe_shards(recipe, tmp_path)
    capsys.readouterr()
    out_json = tmp_path / "eval.json"
    args = ["eval", "--checkpoint", str(run_dir), "--output", str(out_json), f"data.shards={shards}",
            f"eval.protocol={recipe}", "eval.ks=1,5"]  # fmt: skip
    if recipe == "vehicleid":
        args.append("data.test_split=test_large")
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert all(e in printed for e in expected), printed
    metrics = next(iter(json.loads(out_json.read_text()).values()))["metrics"]
    if recipe == "vehicleid":
        # 2 / 4 / 6 vehicles of 3 images: one gallery image each, the other two query it.
        assert [metrics[f"{s}/num_queries"] for s in ("small", "medium", "large")] == [4, 8, 12]
        assert metrics["recall@1"] == metrics["large/recall@1"]
        assert not any(k.endswith("map@r") for k in metrics), "MAP@R equals R@1 for VehicleID: left out"
        assert "MAP@R" not in printed
    elif recipe == "inshop":
        assert metrics["num_queries"] == 4  # one query image per test item, searched in the gallery
    else:
        assert metrics["num_queries"] == 18  # every test image queries the 17 others


def test_one_vehicleid_list_by_split_name(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shards = recipe_shards("vehicleid", tmp_path)
    out_json = tmp_path / "eval.json"
    args = ["eval", "--checkpoint", str(run_dir), "--split", "test_medium", "--output", str(out_json),
            f"data.shards={shards}", "eval.protocol=vehicleid"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    metrics = next(iter(json.loads(out_json.read_text()).values()))["metrics"]
    assert metrics["medium/num_queries"] == 8 and "large/recall@1" not in metrics


def test_config_comes_from_the_run_or_the_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    from ddp_rank.eval.workflow import load_run_config

    step_dir = next((run_dir / "checkpoints").glob("step-*"))
    for where in (run_dir, run_dir / "checkpoints", step_dir):
        assert load_run_config(None, str(where), []).model.embedding_dim == 12
    assert load_run_config(None, str(run_dir), ["model.embedding_dim=7"]).model.embedding_dim == 7
    # A checkpoint copied away from its run still carries its config in meta.json.
    import shutil

    lone = tmp_path / "copied" / "step"
    shutil.copytree(step_dir, lone)
    assert load_run_config(None, str(lone), []).model.embedding_dim == 12


def test_eval_without_a_config_or_checkpoint_says_what_to_pass(capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", "--baseline", "untrained"]) == 2
    assert "data.shards is empty" in capsys.readouterr().err


def test_one_checkpoint_one_set_of_numbers_under_a_bf16_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_accelerator_state: None
) -> None:
    """``train.mixed_precision=auto`` under a launcher that asks for bf16: the trainer evaluates in bf16, and
    ``ddp-rank eval`` of the checkpoint it saved takes the same precision from its accelerator (it used to read
    the config's ``auto`` and run in float32), so both report the same numbers."""
    import torch

    import ddp_rank.eval.workflow as workflow
    from ddp_rank.train.run_outputs import read_metrics

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    shards = build_tiny_shards(tmp_path)
    run = tmp_path / "run"
    run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={run}",
                                    "train.steps=2", "train.eval_every=2", "train.mixed_precision=auto"]))  # fmt: skip
    trained = next(r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval" and r["step"] == 2)

    seen: list[torch.dtype | None] = []
    evaluate = workflow.evaluate_model

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("autocast_dtype"))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(workflow, "evaluate_model", spy)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a new command: a new process would start with no state
    assert main(["eval", "--checkpoint", str(run), "--output", str(tmp_path / "eval.json")]) == 0
    assert seen == [torch.bfloat16]
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    metrics = next(iter(evaluated.values()))["metrics"]
    for key in ("recall@1", "recall@2", "map@r"):
        assert metrics[key] == trained[key], key

"""Starting from another run's weights (model.init_from) and safe resumes (changed config refused or applied)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from ddp_rank.cli import main
from ddp_rank.config import ConfigError, load_config
from ddp_rank.model.checkpoint_read import CheckpointError, resolve_checkpoint
from ddp_rank.model.net import ModelError
from ddp_rank.train.trainer import Trainer, run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


# No PNGs (the plots of a finished run, the retrieval picture of each evaluation): what these runs check is their
# checkpoints, config and log; the pictures are tests/train/test_train_e2e.py's and tests/eval's.
NO_PICTURES = ["train.plots=false", "eval.grid_queries=0"]


def cfg_for(shards: Path, out: Path, *extra: str):
    return load_config(
        None, [*TINY_OVERRIDES, *NO_PICTURES, f"data.shards={shards}", f"train.output_dir={out}", *extra]
    )


@pytest.fixture(scope="module")
def source_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("source") / "run"
    run_training(cfg_for(shards, out, "train.steps=3", "optim.lr=1e-2"))
    return out


def weights_of(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(resolve_checkpoint(run) / "model.safetensors"))


# ---------------------------------------------------------------------------------------------- init_from
def test_init_from_a_run_with_a_changed_head_size(
    shards: Path, source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = weights_of(source_run)
    trainer = Trainer(
        cfg_for(shards, tmp_path / "new", f"model.init_from={source_run}", "model.embedding_dim=8")
    )
    try:
        own = trainer.unwrapped.state_dict()
        for k, v in source.items():
            if k.startswith("backbone."):
                torch.testing.assert_close(own[k], v, rtol=0, atol=0, msg=k)
        assert own["head.weight"].shape == (8, 128) and source["head.weight"].shape == (16, 128)
        assert trainer.step == 0 and not trainer.optimizer.state, "weights only: no step, no optimizer state"
        note = trainer.notes[0]
        assert (
            "kept freshly initialised (shape differs):" in note
            and "head.weight [16, 128] -> [8, 128]" in note
        )
        assert "head.bias [16] -> [8]" in note and " model.init_from=" in capsys.readouterr().err
    finally:
        trainer.close()


def test_init_from_files_and_mismatches(shards: Path, source_run: Path, tmp_path: Path) -> None:
    from ddp_rank.model.init_weights import init_from
    from ddp_rank.model.net import build_model

    cfg = cfg_for(shards, tmp_path)
    source = weights_of(source_run)
    ckpt_file = resolve_checkpoint(source_run) / "model.safetensors"
    model = build_model(cfg.model, 16)
    report = init_from(model, ckpt_file)
    assert not (report.missing or report.unexpected or report.mismatched) and len(report.loaded) == len(
        source
    )
    torch.testing.assert_close(model.head.weight, source["head.weight"])
    # A backbone-only file (e.g. a backbone saved from elsewhere): matched against the backbone, head reported.
    backbone_only = tmp_path / "backbone.pth"
    torch.save({"state_dict": {k.removeprefix("backbone."): v for k, v in source.items() if "backbone" in k}},
               backbone_only)  # fmt: skip
    fresh = build_model(cfg.model, 16)
    report = init_from(fresh, backbone_only)
    assert report.missing == ["head.weight", "head.bias"]
    with pytest.raises(CheckpointError, match=r"none of its \d+ tensors fits"):
        init_from(build_model(load_config(None, ["model.backbone=resnet18"]).model, 16), ckpt_file)
    with pytest.raises(CheckpointError, match="not a weights file"):
        init_from(fresh, tmp_path / "nowhere")
    # model.weights is for backbone weights: a whole network's file says to use init_from instead.
    with pytest.raises(ModelError, match=r"model\.init_from="):
        build_model(load_config(None, ["model.backbone=tiny_cnn", f"model.weights={ckpt_file}"]).model, 16)


# ---------------------------------------------------------------------------------------------- resumes
@pytest.fixture(scope="module")
def trained_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step run, trained once for the module; each test gets a copy of it (``run``)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run_training(cfg_for(shards, out, "train.steps=2"))
    return out


@pytest.fixture()
def run(trained_run: Path, tmp_path: Path) -> Path:
    """A copy of ``trained_run`` of this test's own: a resume compares the model, optimizer and loss sections of
    the config, never train.output_dir, so the copy resumes as the original would."""
    import shutil

    return Path(shutil.copytree(trained_run, tmp_path / "run"))


@pytest.mark.parametrize(
    ("change", "listed"),
    [
        ("optim.lr=1e-2", "optim.lr: 0.001 -> 0.01"),
        ("optim.head_lr_mult=1", "optim.head_lr_mult: 10.0 -> 1.0"),
        ("optim.weight_decay=1e-4", "optim.weight_decay: 0.0 -> 0.0001"),
        ("optim.name=sgd", "optim.name: 'adam' -> 'sgd'"),
        ("model.embedding_dim=8", "model.embedding_dim: 16 -> 8"),
        ("model.pooling=gem", "model.pooling: 'default' -> 'gem'"),
        ("loss.name=smoothap", "loss.name: 'fastap' -> 'smoothap'"),
        ("loss.num_bins=20", "loss.num_bins: 10 -> 20"),
    ],
)
@pytest.mark.slow
def test_changed_resume_is_refused_and_leaves_the_run_intact(
    shards: Path, run: Path, change: str, listed: str, capsys: pytest.CaptureFixture
) -> None:
    config_before = (run / "config.yaml").read_text()
    assert main(["train", *TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={run}", "train.steps=4",
                 change]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert listed in err and "train.force_resume=true" in err and "model.init_from=" in err
    assert (run / "config.yaml").read_text() == config_before, "config.yaml must not change before the check"
    assert len(list((run / "config-history").glob("start-*.yaml"))) == 1
    # The run's own config still resumes its checkpoints.
    assert run_training(cfg_for(shards, run, "train.steps=3"))["steps"] == 3


def test_forced_hyper_parameter_change_applies_the_new_values(
    shards: Path, run: Path, capsys: pytest.CaptureFixture
) -> None:
    trainer = Trainer(cfg_for(shards, run, "train.steps=4", "optim.lr=1e-2", "optim.weight_decay=1e-4",
                              "optim.betas=0.8,0.9", "train.force_resume=true"))  # fmt: skip
    try:
        assert trainer.resume() is not None and trainer.step == 2
        backbone, head = trainer.optimizer.param_groups
        assert (backbone["lr"], head["lr"]) == pytest.approx((1e-2, 1e-1))
        assert backbone["weight_decay"] == 1e-4 and backbone["betas"] == (0.8, 0.9)
        assert trainer.optimizer.state, "the Adam moments of the checkpoint are kept"
        assert trainer.train_step().lr == pytest.approx(1e-2)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
        assert "the new values apply: optim.lr: 0.001 -> 0.01" in capsys.readouterr().err
    finally:
        trainer.close()


def test_forced_schedule_change_continues_the_new_curve(shards: Path, run: Path) -> None:
    from ddp_rank.train.optim import lr_factor

    cfg = cfg_for(shards, run, "train.steps=6", "optim.schedule=cosine", "train.force_resume=true")
    trainer = Trainer(cfg)
    try:
        trainer.resume()
        expected = 1e-3 * lr_factor(cfg.optim, 6)(2)
        assert trainer.train_step().lr == pytest.approx(expected)
    finally:
        trainer.close()


@pytest.mark.parametrize("change", ["optim.name=sgd", "model.embedding_dim=8"])
def test_forced_structural_change_starts_a_fresh_optimizer(
    shards: Path, run: Path, change: str, capsys: pytest.CaptureFixture
) -> None:
    summary = run_training(cfg_for(shards, run, "train.steps=3", change, "train.force_resume=true"))
    assert summary["steps"] == 3 and summary["steps_this_run"] == 1
    err = capsys.readouterr().err
    assert "optimizer state and RNG are not restored" in err and change.split("=")[0] in err
    history = sorted((run / "config-history").glob("start-*.yaml"))
    assert [p.name for p in history] == ["start-001-step-00000000.yaml", "start-002-step-00000002.yaml"]
    key, value = change.split("=")
    section, name = key.split(".")
    first, second = (yaml.safe_load(p.read_text())[section][name] for p in history)
    assert str(second) == value and str(first) != value
    assert "note 1" in (run / "summary.md").read_text()


def test_unchanged_or_init_only_changes_resume_silently(
    shards: Path, run: Path, capsys: pytest.CaptureFixture
) -> None:
    capsys.readouterr()
    # How the loss is computed (its kernel, the matmuls' precision, its work space) is not what is trained.
    summary = run_training(cfg_for(shards, run, "train.steps=3", "model.init_from=", "loss.memory_budget_mb=1",
                                   "loss.matmul_precision=bf16"))  # fmt: skip
    assert summary["resumed_from"].endswith("step-00000002") and summary["steps_this_run"] == 1
    assert "force" not in capsys.readouterr().err


@pytest.mark.slow
def test_rewind_moves_the_abandoned_checkpoints_aside(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Resuming a run from its own earlier checkpoint (e.g. with a lower optim.lr after a divergence): the later
    checkpoints move to abandoned-*/, so that the next train.resume=auto continues the new timeline."""
    from ddp_rank.model.checkpoint_read import read_meta
    from ddp_rank.train.checkpoints.write import CheckpointManager

    run = tmp_path / "run"
    common = ["train.steps=4", "train.checkpoint_every=1", "train.keep_last=5", "data.test_split="]
    run_training(cfg_for(shards, run, *common))
    rewind = [*common, "optim.lr=1e-4", "train.force_resume=true"]
    trainer = Trainer(cfg_for(shards, run, *rewind, f"train.resume={run}/checkpoints/step-00000002"))
    try:
        assert trainer.resume() is not None and trainer.step == 2
        trainer.train_step()
        trainer.save_checkpoint()  # step 3 of the new timeline; then the process is killed
    finally:
        trainer.close()
    root = run / "checkpoints"
    assert [s for s, _ in CheckpointManager(root).complete()] == [1, 2, 3]
    (abandoned,) = root.glob("abandoned-*")
    assert sorted(p.name for p in abandoned.iterdir()) == ["step-00000003", "step-00000004"]
    assert read_meta(abandoned / "step-00000004")["config"]["optim"]["lr"] == 1e-3, "kept, not deleted"
    err = capsys.readouterr().err
    assert "rewound to step 2" in err and str(abandoned) in err
    trainer = Trainer(cfg_for(shards, run, *rewind))  # the relaunch, train.resume=auto
    try:
        path = trainer.resume()
        assert path == root / "step-00000003" and trainer.step == 3
        assert read_meta(path)["config"]["optim"]["lr"] == 1e-4
    finally:
        trainer.close()


@pytest.mark.slow
def test_resume_with_other_weight_shapes_is_refused_or_forced(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A timm ViT's position embeddings follow data.image_size (no model.* key): the shapes are compared before
    load_state, the resume refused with the tensors that differ, or forced with the weights that fit."""
    pytest.importorskip("timm")
    run = tmp_path / "run"
    vit = ["model.backbone=timm:vit_tiny_patch16_224", "data.test_split=", "data.resize_size=32"]
    run_training(cfg_for(shards, run, *vit, "train.steps=1"))
    larger = [*vit, "train.steps=2", "data.image_size=32"]
    with pytest.raises(CheckpointError) as info:
        run_training(cfg_for(shards, run, *larger))
    message = str(info.value)
    assert "tensor backbone.net.pos_embed: [1, 2, 192] -> [1, 5, 192]" in message
    assert "data.image_size" in message and "train.force_resume=true" in message
    summary = run_training(cfg_for(shards, run, *larger, "train.force_resume=true"))
    assert summary["steps"] == 2 and summary["steps_this_run"] == 1
    err = capsys.readouterr().err
    assert "optimizer state and RNG are not restored" in err
    assert (
        "kept freshly initialised (shape differs): backbone.net.pos_embed [1, 2, 192] -> [1, 5, 192]" in err
    )


# ---------------------------------------------------------------------------------------------- start-up checks
@pytest.mark.parametrize(
    ("overrides", "valid"),
    [
        (["train.best_metric=recall@3"], "recall@1, recall@2, map@r"),
        (["train.best_metric=map@r", "eval.map_at_r=false"], "recall@1, recall@2"),
    ],
)
def test_best_metric_is_checked_at_start_up(
    shards: Path, tmp_path: Path, overrides: list[str], valid: str
) -> None:
    with pytest.raises(ConfigError, match=f"valid: {valid}$"):
        Trainer(cfg_for(shards, tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists(), "refused before anything was written"


def test_config_of_a_run_without_history_is_kept(shards: Path, run: Path) -> None:
    """A run started before config-history existed: its config.yaml is kept as start-000 at the next start."""
    import shutil

    shutil.rmtree(run / "config-history")
    before = (run / "config.yaml").read_text()
    run_training(cfg_for(shards, run, "train.steps=3"))
    names = sorted(p.name for p in (run / "config-history").iterdir())
    assert names == ["start-000-earlier.yaml", "start-001-step-00000002.yaml"]
    assert (run / "config-history" / "start-000-earlier.yaml").read_text() == before


def test_another_pml_loss_is_a_structural_change_a_listwise_one_is_not() -> None:
    from ddp_rank.config import Config, LossConfig, to_dict
    from ddp_rank.train.checkpoints.resume_check import resume_changes
    from ddp_rank.train.settings import config_record

    def meta_of(name: str) -> dict:
        return {"config": {**to_dict(Config()), "loss": {**to_dict(Config())["loss"], "name": name}}}

    def changes(saved: str, new: str) -> dict:
        cfg = Config(loss=LossConfig(name=new))
        return {c.key: c.structural for c in resume_changes(meta_of(saved), config_record(cfg))}

    assert changes("fastap", "pnp") == {"loss.name": False}
    assert changes("fastap", "pml:ProxyAnchorLoss(margin=0.1)") == {"loss.name": True}
    assert changes("pml:ContrastiveLoss()", "fastap") == {"loss.name": True}
    assert changes("fastap", "fastap") == {}


@pytest.mark.slow
def test_a_changed_output_stride_is_refused_as_a_structural_change(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """resnet18 cut at stride 16 has no layer4 and a 256-wide head input: the checkpoint cannot load as it is."""
    from ddp_rank.config import Config, ModelConfig, to_dict
    from ddp_rank.train.checkpoints.resume_check import resume_changes
    from ddp_rank.train.settings import config_record

    run = tmp_path / "run"
    # chunk_size=0: no chunk trial
    resnet = ("model.backbone=resnet18", "model.weights=none", "distributed.chunk_size=0")
    run_training(cfg_for(shards, run, "train.steps=1", *resnet))
    config_before = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", *TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={run}", "train.steps=2",
                 *resnet, "model.output_stride=16"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "model.output_stride: 32 -> 16" in err and "train.force_resume=true" in err
    assert "tensor backbone.layer4.0.bn1.weight: [512] -> 'absent'" in err, "the cut drops layer4's weights"
    assert "(its weights have other shapes)" in err and "ViT" not in err  # no hint about another model's keys
    assert (run / "config.yaml").read_text() == config_before
    # Structural (a forced resume starts the optimizer afresh); a checkpoint older than the key used 32.
    older = {"config": {**to_dict(Config()), "model": {"backbone": "resnet18"}}}
    cfg = Config(model=ModelConfig(backbone="resnet18"))
    assert resume_changes(older, config_record(cfg)) == []
    cfg = Config(model=ModelConfig(backbone="resnet18", output_stride=16))
    assert [(c.key, c.structural) for c in resume_changes(older, config_record(cfg))] == [
        ("model.output_stride", True)
    ]


@pytest.mark.slow
def test_a_resume_sets_a_checkpoint_folder_without_meta_aside_and_says_so(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A step-* folder without meta.json (a copy of a later checkpoint cut short) is not resumed from and not
    deleted: it moves to incomplete-*/ with its files, the resume continues from the last complete checkpoint,
    and the log names the folder."""
    run = tmp_path / "run"
    common = ["train.steps=2", "train.checkpoint_every=1", "data.test_split="]
    run_training(cfg_for(shards, run, *common))
    root = run / "checkpoints"
    copy = root / "step-00000007"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes(b"half a copy")
    trainer = Trainer(cfg_for(shards, run, "train.steps=3", "train.checkpoint_every=1", "data.test_split="))
    try:
        assert trainer.resume() == root / "step-00000002" and trainer.step == 2
    finally:
        trainer.close()
    (folder,) = root.glob("incomplete-*")
    assert (folder / "step-00000007" / "model.safetensors").read_bytes() == b"half a copy"
    assert not copy.exists()
    err = capsys.readouterr().err
    assert "without meta.json" in err and str(folder) in err and "step-00000007" in err

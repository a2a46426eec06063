"""A sweep's grid: axes and fixed overrides (a lone empty value included), the cartesian product in order, folder
names (two values sharing one refused), ``--equal images`` (intervals and learning-rate milestones), and bad input
that fails before anything runs, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_rank.config import ConfigError
from ddp_rank.experiments.grid import expand_grid, split_axes


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(
        "data: {global_batch_size: 128}\n"
        "train: {steps: 100, log_every: 10, eval_every: 50, checkpoint_every: 0, output_dir: runs/x}\n"
        "optim: {warmup_steps: 3}\n"
    )
    return path


def test_several_values_make_an_axis_one_value_applies_to_every_point() -> None:
    fixed, axes = split_axes(
        ["loss.name=fastap,pnp", "train.seed=3", "eval.ks=1,10;1,2,4", "eval.protocol=sop"]
    )
    assert fixed == ["train.seed=3", "eval.protocol=sop"]
    assert axes == [("loss.name", ["fastap", "pnp"]), ("eval.ks", ["1,10", "1,2,4"])]
    assert split_axes(["eval.ks=1,10"]) == (["eval.ks=1,10"], [])  # a list-valued key: one value, commas kept


def test_commas_inside_a_calls_arguments_stay_in_its_value(config: Path) -> None:
    contrastive = "pml:ContrastiveLoss(pos_margin=0.0, neg_margin=1.0)"
    fixed, axes = split_axes(
        [
            f"loss.name={contrastive},fastap",
            "loss.miner=pml:BatchEasyHardMiner(pos_strategy=easy, neg_strategy=hard)",
        ]
    )
    assert axes == [("loss.name", [contrastive, "fastap"])]
    assert fixed == ["loss.miner=pml:BatchEasyHardMiner(pos_strategy=easy, neg_strategy=hard)"]
    _, points = expand_grid(config, [f"loss.name={contrastive},pml:TripletMarginLoss(margin=0.2)"])
    assert [p.config.loss.name for p in points] == [contrastive, "pml:TripletMarginLoss(margin=0.2)"]
    assert len({p.name for p in points}) == 2


def test_a_lone_empty_value_is_a_fixed_override_as_train_takes_it(config: Path) -> None:
    fixed, axes = split_axes(["data.test_split=", "model.init_from=", "loss.name=fastap,pnp"])
    assert fixed == ["data.test_split=", "model.init_from="] and axes == [("loss.name", ["fastap", "pnp"])]
    _, points = expand_grid(config, ["data.test_split=", "loss.name=fastap,pnp"])
    assert [p.config.data.test_split for p in points] == ["", ""]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["loss.name=fastap,,pnp"], r"'loss.name=fastap,,pnp' has an empty value"),
        (["eval.ks=1,2;"], r"separated by ';'"),
        (["loss.name=pnp,pnp"], "names a value twice"),
        (["loss.name=pnp,fastap", "loss.name=smoothap"], "loss.name is given twice"),
        (["steps"], "not of the form section.key=value"),
        (["loss.name=pml:ContrastiveLoss(pos_margin=0.0,fastap"], r"unbalanced '\(' or '\)'"),
    ],
)
def test_malformed_sweep_values_are_refused(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        split_axes(items)


def test_the_grid_is_the_cartesian_product_in_the_order_given(config: Path) -> None:
    base, points = expand_grid(config, ["data.global_batch_size=64,256", "loss.name=fastap,pnp,smoothap"])
    assert base.data.global_batch_size == 128
    assert [p.name for p in points] == [
        f"data.global_batch_size={b},loss.name={n}" for b in (64, 256) for n in ("fastap", "pnp", "smoothap")
    ]
    assert [(p.config.data.global_batch_size, p.config.loss.name) for p in points][:2] == [
        (64, "fastap"),
        (64, "pnp"),
    ]
    assert all(p.config.train.steps == 100 and p.derived == () for p in points)  # equal steps by default


def test_folder_names_keep_only_safe_characters(config: Path) -> None:
    _, points = expand_grid(config, ["model.backbone=timm:vit_small/16,resnet18"])
    assert [p.name for p in points] == ["model.backbone=timm_vit_small_16", "model.backbone=resnet18"]


def test_two_values_that_would_share_a_folder_are_refused_naming_them(config: Path) -> None:
    with pytest.raises(ConfigError, match=r"'a/b\.pt' and 'a_b\.pt' would share the run folder"):
        expand_grid(config, ["model.init_from=a/b.pt,a_b.pt", "loss.name=fastap,pnp"])


def test_equal_images_scales_the_learning_rate_milestones(config: Path) -> None:
    """Milestones at the same images seen; one the base run never reaches (150 of 100 steps) is dropped."""
    _, points = expand_grid(
        config,
        ["data.global_batch_size=32,128,512,1024", "optim.schedule=step", "optim.step_milestones=50,80,150"],
        equal="images",
    )
    assert [p.config.optim.step_milestones for p in points] == [[200, 320], [50, 80], [12, 20], [6, 10]]
    _, points = expand_grid(
        config, ["data.global_batch_size=128,25600", "optim.step_milestones=50,80"], "images"
    )
    assert points[1].config.train.steps == 1 and points[1].config.optim.step_milestones == [
        1,
        1,
    ]  # at least 1


def test_equal_images_scales_the_steps_and_the_intervals_with_the_batch(config: Path) -> None:
    _, points = expand_grid(config, ["data.global_batch_size=32,128,512,1024"], equal="images")
    steps = [p.config.train.steps for p in points]
    assert steps == [400, 100, 25, 12]  # round(100 * 128 / B); 12.5 rounds to even
    assert [p.config.train.steps * p.config.data.global_batch_size for p in points][:3] == [12_800] * 3
    assert [p.config.train.log_every for p in points] == [40, 10, 2, 1]  # never below 1
    assert [p.config.train.eval_every for p in points] == [200, 50, 12, 6]
    assert [p.config.train.checkpoint_every for p in points] == [0] * 4  # 0 (off) stays off
    assert [p.config.optim.warmup_steps for p in points] == [12, 3, 1, 0]  # warm-up may shrink to none
    assert points[0].overrides[0] == "data.global_batch_size=32" and "train.steps=400" in points[0].overrides


def test_equal_images_needs_the_batch_axis_and_leaves_epochs_alone(config: Path) -> None:
    with pytest.raises(ConfigError, match=r"sweep data\.global_batch_size"):
        expand_grid(config, ["loss.name=fastap,pnp"], equal="images")
    with pytest.raises(ConfigError, match=r"do not sweep train\.steps too"):
        expand_grid(config, ["data.global_batch_size=32,64", "train.steps=5,10"], equal="images")
    _, points = expand_grid(config, ["data.global_batch_size=32,64", "train.steps=0"], equal="images")
    assert all(p.derived == () for p in points)  # epochs: the images seen are equal already


def test_a_bad_key_or_value_fails_before_anything_runs_naming_it(config: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'data.global_bach_size'.*Did you mean 'global_batch_size'"
    ):
        expand_grid(config, ["data.global_bach_size=64,128"])
    with pytest.raises(ConfigError, match=r"sweep point loss.name=fastapp: .*'fastapp'"):
        expand_grid(config, ["loss.name=fastap,fastapp"])
    with pytest.raises(ConfigError, match="nothing to sweep"):
        expand_grid(config, ["loss.name=pnp"])

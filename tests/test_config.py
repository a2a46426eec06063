"""The typed config: defaults <- YAML <- key=value overrides, type coercion, clear rejections, saved YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddp_rank.config import Config, ConfigError, describe, load_config, parse_overrides, save_config, to_dict


def test_defaults_follow_the_fastap_paper() -> None:
    cfg = load_config()
    assert cfg.optim.name == "adam" and cfg.optim.lr == 1e-5 and cfg.optim.weight_decay == 0.0
    assert cfg.optim.head_lr_mult == 10.0 and cfg.model.embedding_dim == 512 and cfg.loss.num_bins == 10


def test_file_then_overrides_win(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.001\ntrain:\n  steps: 5\neval:\n  ks: [1, 5]\n")
    cfg = load_config(f, ["train.steps=7", "eval.ks=1,2,4", "train.progress=no", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.lr == 0.001  # from the file
    assert cfg.train.steps == 7  # override beats file
    assert cfg.eval.ks == [1, 2, 4] and cfg.train.progress is False and cfg.optim.betas == [0.8, 0.9]


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["optim.lrr=1"], ["unknown key 'optim.lrr'", "valid keys of 'optim'", "Did you mean 'lr'"]),
        (["optm.lr=1"], ["unknown section 'optm'", "Did you mean 'optim'"]),
        (["loss.name=fastapp"], ["loss.name='fastapp'", "valid choices: fastap, pnp, smoothap", "'fastap'"]),
        (["train.steps=ten"], ["train.steps='ten' must be an integer"]),
        (["train.steps=-3"], ["train.steps=-3 must be >= 0"]),
        (["train.progress=maybe"], ["must be a boolean"]),
        (["lr=1"], ["no section", "'optim.lr'"]),
        (["--lr"], ["not of the form section.key=value"]),
        (["eval.vehicleid_sizes=small,huge"], ["'huge' is not a valid choice"]),
        (
            ["data.image_size=300", "data.resize_size=256"],
            ["resize_size=256 is smaller than data.image_size=300"],
        ),
        (["loss.tau=0"], ["loss.tau=0.0 must be > 0"]),
        (["loss.alpha=0"], ["loss.alpha=0.0 must be > 0"]),
        (["loss.name=pnp", "loss.pnp_variant=Dq", "loss.b=0"], ["loss.b=0.0 must be > 0 with loss.name=pnp"]),
        (["loss.b=-1"], ["loss.b=-1.0 must be >= 0"]),
        (["train.seed=-1"], ["train.seed=-1 must be >= 0"]),
        (["optim.lr=nan"], ["optim.lr=nan must be a finite number"]),
        (["optim.grad_clip=inf"], ["optim.grad_clip=inf must be a finite number"]),
        (["optim.head_lr_mult=-inf"], ["optim.head_lr_mult=-inf must be a finite number"]),
        (["loss.tau=nan"], ["loss.tau=nan must be a finite number"]),
        (["optim.betas=nan,0.999"], ["optim.betas=nan must be a finite number"]),
        (["train.resume="], ["train.resume is empty", "'auto'", "'never'", "path"]),
        (["train.resume= "], ["train.resume is empty"]),
        (["optim.betas=1.5,0.999"], ["optim.betas=[1.5, 0.999] must be two values in [0, 1)"]),
        (["optim.betas=0.9,1"], ["must be two values in [0, 1)"]),
        (["optim.min_lr_ratio=5"], ["optim.min_lr_ratio=5.0 must be <= 1.0"]),
        (["optim.step_milestones=-5"], ["optim.step_milestones=-5 must be >= 1"]),
        (["eval.ks=1,1"], ["eval.ks=[1, 1] lists a cut-off twice"]),
    ],
)
def test_bad_values_are_rejected_with_the_fix(overrides: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_values_only_a_loss_that_uses_them_checks() -> None:
    """loss.b belongs to PNP (whose loss refuses b <= 0 for every variant): other losses ignore it."""
    assert load_config(None, ["loss.name=fastap", "loss.b=0"]).loss.b == 0.0
    assert load_config(None, ["loss.name=smoothap", "loss.b=0"]).loss.b == 0.0


def test_empty_resume_in_a_file_is_rejected(tmp_path: Path) -> None:
    """``resume:`` with no value (YAML null) would be Path(""): the checkpoints/ of the current directory."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  resume:\n")
    with pytest.raises(ConfigError, match=r"train\.resume is empty; set it to 'auto'.*'never'.*path"):
        load_config(f)


def test_unknown_key_in_file_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  backbon: resnet18\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'model.backbon'.*Did you mean 'backbone'"):
        load_config(f)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "broken.yaml"
    f.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(f)


def test_saved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["loss.name=pnp", "loss.alpha=4", "train.output_dir=x"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert yaml.safe_load(text)["loss"]["alpha"] == 4.0
    assert load_config(tmp_path / "run" / "config.yaml") == cfg


def test_every_field_is_documented() -> None:
    for section in Config.model_fields:
        for name, f in type(getattr(Config(), section)).model_fields.items():
            assert f.description, f"{section}.{name} has no documentation"
    text = describe()
    assert "loss.pnp_variant" in text and "choices: O, Iu, Ib, Ds, Dq" in text


def test_parse_overrides_and_to_dict() -> None:
    assert parse_overrides(["a.b=c=d"]) == {"a": {"b": "c=d"}}
    assert set(to_dict(Config())) == {"data", "model", "loss", "optim", "train", "eval", "distributed"}


def test_a_section_built_in_python_refuses_a_float_for_an_integer() -> None:
    """The loader refuses ``model.output_stride=16.0`` from a file or an override; a section built in Python
    must too: 16.0 == 16 passes the choices, then travels on as a float (a feature record keeps it)."""
    from ddp_rank.config import DataConfig, ModelConfig

    with pytest.raises(ConfigError, match=r"model.output_stride=16.0 must be an integer"):
        ModelConfig(output_stride=16.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"data.global_batch_size=64.0 must be an integer"):
        DataConfig(global_batch_size=64.0)  # type: ignore[arg-type]
    assert ModelConfig(output_stride=16).output_stride == 16


def test_an_error_names_where_the_value_came_from(tmp_path: Path) -> None:
    """The file for a value read from it, ``command line`` for an override of it, the key as a dotted path."""
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  image_size: 4\noptim:\n  lr: 1e-3\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: data\.image_size=4 must be >= 8$"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"^command line: optim\.lr=-1\.0 must be >= 0\.0$"):
        load_config(f, ["data.image_size=16", "optim.lr=-1"])
    f.write_text("train:\n  log_with: [tensorbord]\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml: train\.log_with='tensorbord' is not a valid choice.*'tensorb"
    ):
        load_config(f)


def test_yaml_values_are_read_as_the_key_types(tmp_path: Path) -> None:
    """A number where a key is text (a split named 2024), ``1_000`` and ``yes`` from the command line; never a
    boolean as a number."""
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_split: 2024\n  test_split:\ndistributed:\n  chunk_size: 64\n")
    cfg = load_config(f, ["eval.max_positive_pairs=1_000", "data.augment=yes"])
    assert cfg.data.train_split == "2024" and cfg.data.test_split == "" and cfg.distributed.chunk_size == "64"
    assert cfg.eval.max_positive_pairs == 1000 and cfg.data.augment is True
    f.write_text("train:\n  steps: true\n")
    with pytest.raises(ConfigError, match=r"train\.steps=True must be an integer"):
        load_config(f)
    # A whole float in a file is the integer it equals, as the loader always read it (not in Python: above).
    f.write_text("data:\n  image_size: 64.0\nmodel:\n  output_stride: 16.0\n")
    cfg = load_config(f)
    assert type(cfg.data.image_size) is int and cfg.data.image_size == 64 and cfg.model.output_stride == 16
    f.write_text("data:\n  image_size: 64.5\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: data\.image_size=64\.5 must be an integer"):
        load_config(f)


def test_replaced_checks_the_new_values_again() -> None:
    """What ``dataclasses.replace`` did for the dataclass sections: a copy with a bad value is refused."""
    from ddp_rank.config import ModelConfig

    assert ModelConfig().replaced(weights="none").weights == "none"
    with pytest.raises(ConfigError, match=r"model\.bn_group_size=1 would normalise"):
        ModelConfig().replaced(bn_group_size=1)
    with pytest.raises(ConfigError, match=r"smaller than data\.image_size"):
        Config().replaced(data=Config().data.replaced(image_size=300))


def test_the_json_schema_documents_every_key() -> None:
    """The documentation's config reference is generated from it: each key with its doc, default, choices, bounds."""
    import json

    from ddp_rank.config import config_json_schema

    schema = json.loads(json.dumps(config_json_schema()))
    sections = schema["$defs"]
    assert set(schema["properties"]) == set(to_dict(Config()))
    for section, values in to_dict(Config()).items():
        props = sections[type(getattr(Config(), section)).__name__]["properties"]
        assert set(props) == set(values), section
        assert all(p.get("description") for p in props.values()), section
    data = sections["DataConfig"]["properties"]
    assert data["sampler"]["enum"] == ["auto", "hard", "hard_unlabelled", "random", "pk"]
    assert data["image_size"]["minimum"] == 8 and data["image_size"]["default"] == 224
    assert sections["EvalConfig"]["properties"]["ks"]["items"]["minimum"] == 1
    assert sections["EvalConfig"]["additionalProperties"] is False

"""Each part gets its own: only the modules listed here read the experiment config as a whole.

At start-up each command hands each part its own section of the :class:`~ddp_rank.config.Config` as it is
(``cfg.data``, ``cfg.model``, ...), or the settings the translation modules below still make where a part reads
several sections (the evaluation's ``EvalSettings``, the step's, the report's); every other module of ``ddp_rank/`` receives its part and never
sees the whole config. A module that
imports ``Config``, takes a parameter typed ``Config``, or reads a section of one (``cfg.data``,
``self.cfg.train``, ``config.eval``, ...) fails here unless it is listed, the way ``tests/test_layers.py`` keeps
the imports going down.

The check is syntactic, as the layer check is: a section read is an attribute named after a section
(``data``, ``model``, ``loss``, ``optim``, ``train``, ``eval``, ``distributed``) of a name or attribute called
``cfg`` / ``config`` / ``*_cfg`` / ``*_config``, so ``tensor.data`` or ``model.train()`` never count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ddp_rank"

SECTIONS = {"data", "model", "loss", "optim", "train", "eval", "distributed"}

READS_CONFIG: dict[str, str] = {
    # The translation modules: Config -> the parts' settings, one per layer where the layering forces it.
    "eval/settings.py": "Config -> the evaluation's settings (they cannot be built below the eval layer)",
    "train/settings.py": "Config -> the training parts' sections and settings (the step's, the report's)",
    # The commands' tops: they take the config a user wrote and translate it at start-up.
    "train/trainer.py": "the trainer's top: Trainer(cfg), run_training(cfg)",
    "eval/workflow.py": "the top of `ddp-rank eval` / `export`: translates the run's config at its start",
    "train/chunking/plan_report.py::describe_plan": "the top of `ddp-rank plan`: translates the config at its start",
    "train/trackers.py::tracker_arguments": "public: make_accelerator(cfg, tracker_arguments(cfg))",
    "runtime/accelerator.py::make_accelerator": "a command's accelerator, made at its start from two sections",
    "cli": "the command line: loads the config files and overrides",
    "experiments": "sweeps and comparisons edit and compare whole configs",
    "config": "the config itself",
}
"""Module (path under ``ddp_rank/``, or a whole package), or one top-level function of a module
(``path::name``), -> why it may read the whole config."""


def _allowed(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    return rel in READS_CONFIG or rel.split("/")[0] in READS_CONFIG


def _allowed_functions(path: Path) -> set[str]:
    rel = path.relative_to(PACKAGE).as_posix()
    return {key.split("::")[1] for key in READS_CONFIG if key.startswith(f"{rel}::")}


def _outside(source: str, reads: list[str], functions: set[str]) -> list[str]:
    """``reads`` less those inside the top-level ``functions`` (and the import of ``Config`` they need)."""
    if not functions:
        return reads
    spans = [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in functions
    ]
    line = lambda read: int(read.split(":")[0].split()[1])  # noqa: E731
    return [
        r for r in reads if not r.endswith("imports Config") and not any(a <= line(r) <= b for a, b in spans)
    ]


def _is_config_name(node: ast.AST) -> bool:
    """``cfg``, ``config``, ``run_cfg``, ``self.cfg``, ``trainer.config``: what holds a whole config."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("cfg", "config") or name.endswith(("_cfg", "_config"))


def _names_config(annotation: ast.AST | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Config":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Config":
            return True
        quoted = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
        if "Config" in (part.strip() for part in quoted.split("|")):
            return True
    return False


def config_reads(source: str, filename: str = "<module>") -> list[str]:
    """Every place ``source`` reads the whole config: ``line N: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS and _is_config_name(node.value):
            found.append(f"line {node.lineno}: reads {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            ("ddp_rank.config", "config")
        ):
            if any(a.name == "Config" for a in node.names):
                found.append(f"line {node.lineno}: imports Config")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            found += [
                f"line {a.lineno}: {node.name}() takes {a.arg}: Config"
                for a in every
                if _names_config(a.annotation)
            ]
    return sorted(set(found), key=lambda s: int(s.split(":")[0].split()[1]))


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_translation_reads_the_config(path: Path) -> None:
    if _allowed(path):
        return
    source = path.read_text()
    reads = _outside(source, config_reads(source, str(path)), _allowed_functions(path))
    assert not reads, (
        f"{path.relative_to(PACKAGE)} reads the whole config ({'; '.join(reads)}): take the settings of its part "
        "instead: its section(s) of the config, or the settings made once at start-up (ddp_rank/train/settings.py, "
        "ddp_rank/eval/settings.py)"
    )


def test_the_allow_list_names_real_modules() -> None:
    """A listed module that was moved or removed would silently widen nothing; keep the list true."""
    for key in READS_CONFIG:
        rel, _, function = key.partition("::")
        assert (PACKAGE / rel).exists(), f"READS_CONFIG names {rel}, which is not under ddp_rank/"
        if function:
            defined = {n.name for n in ast.parse((PACKAGE / rel).read_text()).body if hasattr(n, "name")}
            assert function in defined, f"READS_CONFIG names {key}, but {rel} defines no {function}"


def test_the_checker_sees_every_way_of_reading_the_config() -> None:
    """The test itself: section reads through ``cfg``, ``self.cfg``, ``x.config`` and ``run_cfg``, the import of
    ``Config`` and a parameter typed ``Config`` (also in a union or a string) are found; tensor ``.data`` and
    ``model.train()`` are not."""
    probe = (
        "from ddp_rank.config import Config, ConfigError\n"  # 1
        "def f(cfg: Config, other: 'Config | None' = None):\n"  # 2
        "    a = cfg.data.shards\n"  # 3
        "    b = self.cfg.train.seed\n"  # 4
        "    c = trainer.config.eval\n"  # 5
        "    d = run_cfg.model\n"  # 6
        "    tensor.data.zero_()\n"  # 7
        "    model.train()\n"  # 8
        "def g(*, settings: int, x: Config | None = None): pass\n"  # 9
    )
    lines = {int(r.split(":")[0].split()[1]) for r in config_reads(probe)}
    assert lines == {1, 2, 3, 4, 5, 6, 9}
    assert len([r for r in config_reads(probe) if r.startswith("line 2:")]) == 2


def test_the_settings_carry_the_config_values() -> None:
    """Each part gets the sections it reads as they are (the very objects), and the resolved seeds: a section
    copied from the wrong place, or a seed resolved the wrong way, fails here."""

    from ddp_rank.config import load_config
    from ddp_rank.eval.settings import evaluation_settings
    from ddp_rank.train.settings import step_settings, train_settings

    cfg = load_config(
        None,
        [
            "data.shards=/somewhere", "data.image_size=96", "data.resize_size=128", "data.crop=paper",
            "data.num_workers=0", "data.sampler=pk", "data.images_per_class=3", "data.cache_max_gb=2",
            "model.backbone=resnet18", "model.embedding_dim=64", "model.pooling=gem", "model.freeze_bn=never",
            "loss.name=pnp", "loss.tau=0.05", "loss.pnp_variant=O", "optim.lr=0.001", "optim.betas=[0.8,0.9]",
            "optim.schedule=cosine", "eval.ks=[1,2]", "eval.protocol=inshop", "eval.batch_size=7",
            "train.keep_last=5", "train.best_metric=recall@2", "train.seed=11", "train.resume=never",
        ],
    )  # fmt: skip
    run = train_settings(cfg)
    parts = [run.data, run.model, run.loss, run.optim, run.train]
    assert parts == [cfg.data, cfg.model, cfg.loss, cfg.optim, cfg.train]  # the sections as they are
    assert all(part is section for part, section in zip(parts, [cfg.data, cfg.model, cfg.loss, cfg.optim, cfg.train]))
    assert run.evaluation.data is cfg.data
    assert run.data_seed == cfg.data_seed == 11  # data.seed=-1: train.seed
    assert cfg.replaced(data=cfg.data.replaced(seed=3)).data_seed == 3
    evaluation = evaluation_settings(cfg)
    assert (evaluation.eval, evaluation.data, evaluation.seed) == (cfg.eval, cfg.data, 11)
    assert evaluation.deployment.block_bytes == cfg.eval.block_mb << 20 and evaluation.deployment.seed == 11
    step = step_settings(cfg)
    assert (step.data, step.model, step.distributed, step.optim) == (cfg.data, cfg.model, cfg.distributed, cfg.optim)
    assert step.distributed.fixed_chunk is None  # distributed.chunk_size=auto

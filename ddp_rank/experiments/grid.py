"""A sweep's grid: ``key=v1,v2,...`` overrides expanded into one run per combination.

An override with several values (``data.global_batch_size=128,512,2048``) is an axis; one with a single value
applies to every point. A key whose value is itself a list (``eval.ks``) separates its alternatives with ``;``
(``eval.ks=1,10;1,2,4``). Commas inside parentheses belong to one value, so the pytorch-metric-learning losses
with their arguments sweep as written (``loss.name=pml:ContrastiveLoss(pos_margin=0.0, neg_margin=1.0),fastap``).
Every point's config is loaded before anything runs, so a typo in the fifth value
fails at once, naming the key.

``--equal images`` holds the images seen equal across batch sizes instead of the steps: a point with global
batch B trains ``round(S0 * B0 / B)`` steps (at least 1), where S0 and B0 are ``train.steps`` and
``data.global_batch_size`` of the config without the axes; the intervals counted in steps (``log_every``,
``eval_every``, ``checkpoint_every``, ``warmup_steps``, and each of ``step_milestones``) shrink or grow the same
way, so each run logs, evaluates and decays its learning rate at the same numbers of images. With
``train.steps=0`` (epochs) the images are equal already.

Replicates: ``--replicates K`` adds the axis ``train.seed=S,S+1,...,S+K-1`` (S: the config's ``train.seed``), and
an axis over ``train.seed`` or ``data.seed`` given by hand is a replicate axis too. A replicate axis stands last
in the folder names (``loss.name=pnp,train.seed=1``) and varies slowest in the order the points run, so a sweep
cut short has the whole grid at the first seed before any point has its second; ``compare`` pools the runs that
differ only in these keys into one point with a mean and a spread.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from ddp_rank.config import Config, ConfigError, load_config, to_dict

__all__ = ["EQUAL_CHOICES", "REPLICATE_KEYS", "SweepPoint", "expand_grid", "split_axes"]

EQUAL_CHOICES = ("steps", "images")
BATCH_KEY = "data.global_batch_size"
SCALED_INTERVALS = ("train.log_every", "train.eval_every", "train.checkpoint_every", "optim.warmup_steps")
MILESTONES_KEY = "optim.step_milestones"
REPLICATE_KEYS = ("train.seed", "data.seed")
"""Keys whose values make replicates of one point rather than points of their own (``ddp_rank.experiments.compare``
pools them)."""


@dataclass(frozen=True)
class SweepPoint:
    """One run of the grid: its swept values, the overrides derived from them, its folder name, its config."""

    swept: tuple[tuple[str, str], ...]
    derived: tuple[str, ...]
    config: Config

    @property
    def name(self) -> str:
        """``data.global_batch_size=512,loss.name=pnp``: the folder of the run under the sweep's output."""
        return ",".join(f"{key}={_safe(value)}" for key, value in self.swept)

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.swept] + list(self.derived)


def split_axes(items: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(fixed overrides, axes) from ``section.key=value[,value...]`` items. A lone empty value (``data.test_split=``,
    ``model.init_from=``) is a fixed override, as ``train`` takes it; an empty value among several is a typo."""
    list_keys = {
        f"{section}.{key}"
        for section, values in to_dict(Config()).items()
        for key, value in values.items()
        if isinstance(value, list)
    }
    fixed: list[str] = []
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"sweep value '{item}' is not of the form section.key=value[,value...]")
        key, raw = (part.strip() for part in item.split("=", 1))
        values = [v.strip() for v in _split_top_level(raw, ";" if key in list_keys else ",")]
        # A lone empty value is a setting's "none" (data.test_split=): a fixed override, as train takes it.
        if any(v.count("(") != v.count(")") for v in values):
            raise ConfigError(
                f"'{item}' has an unbalanced '(' or ')'; write e.g. {key}=pml:Loss(a=1, b=2),pml:Other()"
            )
        if len(values) > 1 and not all(values):
            raise ConfigError(
                f"'{item}' has an empty value; write {key}=a,b,c"
                + (" (this key takes a list: alternatives are separated by ';')" if key in list_keys else "")
            )
        if len(set(values)) != len(values):
            raise ConfigError(f"'{item}' names a value twice")
        if any(key == k for k, _ in axes) or any(f.split("=", 1)[0] == key for f in fixed):
            raise ConfigError(f"{key} is given twice; give all its values in one {key}=a,b,c")
        if len(values) == 1:
            fixed.append(f"{key}={values[0]}")
        else:
            axes.append((key, values))
    return fixed, axes


def _split_top_level(raw: str, separator: str) -> list[str]:
    """``raw`` cut at each ``separator`` outside parentheses: the commas of a call's arguments
    (``pml:ContrastiveLoss(pos_margin=0.0, neg_margin=1.0)``) stay inside its value."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(raw):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif char == separator and depth == 0:
            parts.append(raw[start:i])
            start = i + 1
    parts.append(raw[start:])
    return parts


def expand_grid(
    config_path: str | os.PathLike[str] | None,
    items: list[str],
    equal: str = "steps",
    replicates: int = 0,
) -> tuple[Config, list[SweepPoint]]:
    """(the config without the axes, every point of the grid with its loaded config); raises ConfigError.

    ``replicates`` > 0 adds the axis ``train.seed`` with that many seeds from the config's (module docstring)."""
    if equal not in EQUAL_CHOICES:
        raise ConfigError(f"--equal {equal!r} is not one of {', '.join(EQUAL_CHOICES)}")
    if replicates < 0:
        raise ConfigError(f"--replicates {replicates}: give a number of seeds per point, 1 or more")
    fixed, axes = split_axes(items)
    base = load_config(config_path, fixed)
    if replicates > 0:
        axes = _with_replicates(axes, replicates, base.train.seed)
    if not axes:
        raise ConfigError(
            "nothing to sweep: give at least one key with several values, e.g. loss.name=fastap,pnp"
        )
    # Replicate axes last in the names, first (slowest) in the running order.
    axes = [a for a in axes if a[0] not in REPLICATE_KEYS] + [a for a in axes if a[0] in REPLICATE_KEYS]
    settings = sum(key not in REPLICATE_KEYS for key, _ in axes)
    run_order = axes[settings:] + axes[:settings]
    if equal == "images" and BATCH_KEY not in dict(axes):
        raise ConfigError(f"--equal images holds images seen equal across batch sizes: sweep {BATCH_KEY}")
    _refuse_shared_folders(axes)
    points = []
    for combination in itertools.product(*(values for _, values in run_order)):
        chosen = {key: value for (key, _), value in zip(run_order, combination, strict=True)}
        swept = tuple((key, chosen[key]) for key, _ in axes)
        derived = _equal_images(base, dict(swept), {k for k, _ in axes}) if equal == "images" else ()
        overrides = [f"{key}={value}" for key, value in swept] + list(derived)
        try:
            config = load_config(config_path, [*fixed, *overrides])
        except ConfigError as exc:
            point = ",".join(f"{k}={v}" for k, v in swept)
            raise ConfigError(f"sweep point {point}: {exc}") from None
        points.append(SweepPoint(swept, derived, config))
    return base, points


def _with_replicates(
    axes: list[tuple[str, list[str]]], replicates: int, first_seed: int
) -> list[tuple[str, list[str]]]:
    """``axes`` plus ``train.seed`` over ``replicates`` seeds from ``first_seed``; refused beside a seed axis."""
    if any(key == "train.seed" for key, _ in axes):
        raise ConfigError(
            "--replicates and a train.seed axis both set the seeds: give --replicates K, or train.seed=0,1,2"
        )
    if replicates == 1:
        return axes
    return [*axes, ("train.seed", [str(first_seed + i) for i in range(replicates)])]


def _refuse_shared_folders(axes: list[tuple[str, list[str]]]) -> None:
    """Raise ConfigError when two values of an axis stand the same in a folder name (``a/b.pt`` and ``a_b.pt``):
    their points would train into one folder, the second resuming the first. Values of different axes cannot
    meet: each stands after its own ``key=``."""
    for key, values in axes:
        by_folder: dict[str, list[str]] = {}
        for value in values:
            by_folder.setdefault(_safe(value), []).append(value)
        for folder, same in by_folder.items():
            if len(same) > 1:
                raise ConfigError(
                    f"{key} values {' and '.join(repr(v) for v in same)} would share the run folder "
                    f"'{key}={folder}' (a folder name keeps letters, digits and -_.+@ only): sweep them "
                    "separately, each with its own train.output_dir"
                )


def _equal_images(base: Config, swept: dict[str, str], axes: set[str]) -> tuple[str, ...]:
    if "train.steps" in axes:
        raise ConfigError("--equal images sets train.steps from the batch size: do not sweep train.steps too")
    steps0, batch0 = base.train.steps, base.data.global_batch_size
    if steps0 == 0:
        return ()
    try:
        batch = int(swept[BATCH_KEY])
    except ValueError:
        raise ConfigError(f"{BATCH_KEY}={swept[BATCH_KEY]!r} is not a whole number") from None
    scale = batch0 / batch
    steps = max(1, round(steps0 * scale))
    derived = [f"train.steps={steps}"]
    flat = {f"{s}.{k}": v for s, values in to_dict(base).items() for k, v in values.items()}
    for key in SCALED_INTERVALS:
        if key in axes or not flat[key]:
            continue
        floor = 0 if key == "optim.warmup_steps" else 1
        derived.append(f"{key}={max(floor, round(flat[key] * scale))}")
    if MILESTONES_KEY not in axes and flat[MILESTONES_KEY]:
        milestones = _scaled_milestones(flat[MILESTONES_KEY], scale, steps)
        derived.append(f"{MILESTONES_KEY}={','.join(map(str, milestones))}")
    return tuple(derived)


def _scaled_milestones(milestones: list[int], scale: float, steps: int) -> list[int]:
    """``optim.step_milestones`` at the same images seen: each scaled and at least 1 (the config's minimum), those
    past the run's last step dropped (the base run never reaches them either). Two that round to one step stay
    two (the config takes repeats): the rate is multiplied by ``step_gamma`` once per milestone, so after that
    step it is what the base run's is after both."""
    return [m for m in (max(1, round(m * scale)) for m in milestones) if m <= steps]


def _safe(value: str) -> str:
    """A value as it may stand in a folder name."""
    return "".join(c if c.isalnum() or c in "-_.+@" else "_" for c in value)

"""The dry run behind ``ddp-rank plan``: what a config does on W ranks, read from the manifest alone.

Steps per epoch, categories used and left out, the batch layout (from ``BatchLayout``, as the trainer computes
it), the work space the loss's own chunk plan takes on the device the run will use, and a few steps planned and
dealt as a check. No process group, no images, no GPU.
"""

from __future__ import annotations

import time

import torch

from ddp_rank.config import Config, ConfigError, LossConfig, ModelConfig
from ddp_rank.data.format.fragmentation import fragmentation
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.sampling.dealing import deal
from ddp_rank.data.sampling.plan import Catalog, GlobalPlan, PlanError
from ddp_rank.losses.rows import DEFAULT_BUDGET_BYTES
from ddp_rank.model import build_model
from ddp_rank.runtime import TrainError
from ddp_rank.runtime.accelerator import precision_dtype, resolve_mixed_precision
from ddp_rank.runtime.data_setup import resolve_sampler, schedule_config
from ddp_rank.runtime.shards import model_input_dim, open_shards
from ddp_rank.train.chunking.choice import (
    auto_chunk,
    database_bytes,
    loss_work_space,
    measure_activation_bytes,
    most_positives,
    step_fixed_costs,
)
from ddp_rank.train.chunking.layout import BatchLayout
from ddp_rank.train.chunking.step_memory import format_size
from ddp_rank.train.pml_loss import GENERIC_MATRICES, PML_PREFIX
from ddp_rank.train.settings import train_settings
from ddp_rank.train.setup import build_loss
from ddp_rank.train.step_settings import StepSettings

__all__ = ["describe_plan"]

Facts = list[tuple[str, str]]


def describe_plan(
    cfg: Config, world_size: int, steps: int = 3, device: str | None = None
) -> tuple[Facts, list[str]]:
    """(facts, problems) of ``cfg`` on ``world_size`` ranks; an empty problem list means the run can start.
    ``device``: where the run will compute (``cuda`` / ``cpu``; default: a GPU if this machine has one)."""
    settings = train_settings(cfg)  # the config translated once, as the trainer does
    data = settings.data
    facts: Facts = [("shards", data.shards), ("split", data.train_split)]
    problems: list[str] = []
    if world_size < 1:
        return facts, [f"--world-size must be at least 1, got {world_size}"]
    layout: BatchLayout | None = None
    try:
        layout = BatchLayout.from_settings(settings.step, world_size)
    except ConfigError as exc:
        problems.append(str(exc))
    try:  # opened as the run opens them: the same refusals
        manifest = open_shards(data.shards, settings.model.backbone)
        catalog = Catalog.from_manifest(manifest, data.train_split)
    except (ConfigError, TrainError) as exc:
        return facts, [*problems, str(exc)]
    except (OSError, ValueError, KeyError) as exc:
        return facts, [*problems, f"data.shards: {exc}"]
    images = sum(catalog.class_sizes.values())
    facts.append(("usable classes / images", f"{len(catalog.class_sizes):,} / {images:,}"))
    if catalog.singletons:
        facts.append(("single-image classes", f"{catalog.singletons:,} (left out: no positive)"))
    strategy, why = resolve_sampler(data, manifest)
    sampler = strategy + (f", K={data.images_per_class}" if strategy == "pk" else "")
    facts.append(("sampler", sampler + (f" ({why})" if data.sampler == "auto" else "")))
    try:
        plan = GlobalPlan(
            catalog, schedule_config(data, manifest, settings.data_seed), data.global_batch_size
        )
    except PlanError as exc:
        return facts, [*problems, f"the sampler cannot be met: {exc}"]
    facts.append(("steps per epoch", f"{plan.steps_per_epoch:,}"))
    used = [catalog.category_names[c] for c in plan.schedule.categories]
    if plan.schedule.by_category or strategy == "hard_unlabelled":
        facts.append(
            ("categories used", f"{len(used)}: {', '.join(used[:12])}{' ...' if len(used) > 12 else ''}")
        )
    for left in plan.left_out:
        facts.append(("left out", str(left)))
    if layout is None:
        return facts, problems
    facts.append(("ranks / local batch", f"{world_size} / {layout.local_batch:,} images"))
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    largest_class = max(catalog.class_sizes.values(), default=1)
    max_positives = most_positives(data, largest_class)
    work_line, work_bytes = _work_space(cfg.loss, cfg.model.embedding_dim, layout, max_positives, where)
    try:  # the trainer's accelerator resolves it the same way: ``auto`` follows the launcher
        precision = resolve_mixed_precision(cfg.train.mixed_precision)
    except ConfigError as exc:
        problems.append(str(exc))
        precision = cfg.train.mixed_precision
    facts.append(("mixed precision", precision))
    step = _step_line(layout)
    if settings.step.distributed.fixed_chunk is None:
        try:
            chosen, why = _auto_chunk(
                settings.model,
                settings.step,
                layout,
                where,
                work_bytes,
                world_size,
                precision_dtype(precision),
                manifest,
            )
            step = (
                _step_line(chosen)
                if chosen
                else "chunked or direct, decided at start-up from the GPU's free memory"
            )
        except ValueError as exc:  # not even one image fits the budget
            problems.append(f"distributed.chunk_size=auto: {exc}")
            why, step = "no chunk fits (see below)", "none: the run cannot start"
        facts.append(("chunk (auto)", why))
    facts.append(("step", step))
    facts.append(("BatchNorm", layout.batchnorm.describe(layout.local_batch)))
    facts.append(("loss work space per rank", work_line))
    frag = fragmentation(manifest, data.train_split)
    facts.append(("spans", frag.summary()))
    try:
        t0 = time.perf_counter()
        checked = max(1, min(steps, plan.steps_per_epoch))
        requests = 0
        for s in range(min(steps, plan.steps_per_epoch)):
            parts = deal(plan.step(0, s), world_size, plan.config.seed)
            # Each rank reads every span of each class it holds (a class dealt to two ranks is read twice).
            requests += sum(frag.requests(p.class_id for p in part) for part in parts)
        per_step = (time.perf_counter() - t0) / checked
        facts.append(("plan + deal per step", f"{1000 * per_step:.1f} ms"))
        facts.append(
            ("reads per step", f"{requests / checked:,.0f} requests (all ranks, mean of {checked} step(s))")
        )
    except PlanError as exc:
        problems.append(str(exc))
    advice = frag.advice(data.shards)
    facts.append(("remote reads", advice or frag.bound()))
    return facts, problems


def _step_line(layout: BatchLayout) -> str:
    chunk = layout.chunk_size
    return f"chunked, {-(-layout.local_batch // chunk)} chunks of {chunk}" if chunk else "direct"


def _auto_chunk(
    model_cfg: ModelConfig,
    step: StepSettings,
    layout: BatchLayout,
    where: torch.device,
    work_bytes: int,
    world_size: int,
    dtype: torch.dtype | None,
    manifest: Manifest,
) -> tuple[BatchLayout | None, str]:
    """``distributed.chunk_size=auto`` as the trainer will decide it: (the layout with the chosen chunk, why), from
    the same probe of the network (built without its pretrained weights: activations do not depend on them) under
    the run's autocast ``dtype``. On a GPU the budget is that GPU's free memory at start-up, so planning for one
    from a machine without it gives the per-image figure only, and no layout. Raises ValueError when not even one
    image fits."""
    model = build_model(
        model_cfg.replaced(weights="none", init_from=""),
        step.data.image_size,
        model_input_dim(model_cfg.backbone, manifest),
    )
    confirm = "; one real step confirms it at start-up, backing off on an out-of-memory error"
    if where.type == "cuda" and not torch.cuda.is_available():
        probe = measure_activation_bytes(model, step.data.image_size, torch.device("cpu"), dtype)
        fixed = step_fixed_costs(
            model, step, layout.local_batch, layout.global_batch, where, work_bytes, world_size
        )
        return None, (
            f"{format_size(probe.per_image)} of activations per image ({probe.how}, on this CPU); fixed "
            f"{format_size(fixed.total)} per GPU: {fixed.describe()}, plus the workspaces measured there; the "
            f"chunk is chosen at start-up from the GPU's free memory (distributed.memory_fraction="
            f"{step.distributed.memory_fraction:g}){confirm}"
        )
    # On CPU, planned as one node: its processes share the node's memory.
    choice = auto_chunk(
        model.to(where),
        step,
        layout.local_batch,
        layout.global_batch,
        where,
        dtype,
        work_bytes,
        world_size,
        world_size=world_size,
    )
    chosen = BatchLayout.from_settings(
        step, world_size, chunk_size=choice.chunk or 0
    )  # whole BatchNorm groups
    return chosen, choice.describe() + chosen.rounding_note(choice.chunk) + confirm


def _work_space(
    loss_cfg: LossConfig, embedding_dim: int, layout: BatchLayout, max_positives: int, where: torch.device
) -> tuple[str, int]:
    """What the step's loss will hold on one rank: the gathered database and its gradient (float32), and the
    largest chunk of this rank's query rows as the loss's own chunk plan sizes it, beside the chunk budget."""
    pml = loss_cfg.name.startswith(PML_PREFIX)
    loss = None if pml else build_loss(loss_cfg)
    work, rows = loss_work_space(loss, layout.local_batch, layout.global_batch, max_positives, where)
    if loss is None:
        database = layout.global_batch * embedding_dim * 4
        line = (
            f"about {format_size(database + work)} on {where.type} (a pytorch-metric-learning loss: the whole "
            f"loss on the gathered {layout.global_batch:,} x {layout.global_batch:,} batch on every rank, "
            f"estimated as {GENERIC_MATRICES} float32 matrices of that size)"
        )
        return line, work
    budget = loss.memory_budget or DEFAULT_BUDGET_BYTES["cuda" if where.type == "cuda" else "cpu"]
    database = database_bytes(layout.global_batch, embedding_dim)
    chunks = -(-layout.local_batch // max(rows, 1))
    line = (
        f"{format_size(database + work)} on {where.type} (database {format_size(database)} + "
        f"{chunks} chunk(s) of {rows:,} query rows, {format_size(work)} each; budget "
        f"{format_size(budget)}, classes of up to {max_positives} images)"
    )
    return line, work

"""What a training run tells its user and leaves in its run directory: the start-up notes, the config of every
start, the metrics log, the progress bar or timestamped lines, each evaluation's table and the final summary.

Rank 0 writes; the other ranks keep the notes (so the summary can list them) and write nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.config import TrainConfig
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.batch import DataEvents
from ddp_rank.eval.curves import draw_curves, split_curves
from ddp_rank.eval.report import deployment_lines, format_table
from ddp_rank.eval.retrieval_record import RetrievalPicture
from ddp_rank.eval.runner import EvalSettings
from ddp_rank.train.chunking.layout import BatchLayout
from ddp_rank.train.console import StepLine, peak_memory
from ddp_rank.train.run_outputs import ConfigRecord, MetricsLogger, read_metrics, write_plots, write_summary
from ddp_rank.train.trackers import log_metrics, log_picture, start_trackers

log = logging.getLogger(__name__)

__all__ = ["CURVES_FILE", "ReportSettings", "RunReport", "StepResult", "read_curves", "steps_to_train"]

CURVES_FILE = "curves.json"
"""The verification / identification curves of each evaluation, ``{"step <s>": curves}`` in the order of the
steps (``ddp-rank compare --curve`` draws the last)."""


def read_curves(run_dir: Path) -> dict[str, Any]:
    """The curves a run saved, by step (empty without a readable ``curves.json``)."""
    try:
        saved = json.loads((run_dir / CURVES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


DATA_EVENTS = tuple(f.name for f in dataclasses.fields(DataEvents))
"""The data events every ``train`` record carries (as ``data_<event>``): counts since this start, all ranks."""


@dataclass
class StepResult:
    """What one optimizer step reports: the global loss, chunks used, timings."""

    loss: float
    chunks: int
    data_time: float
    step_time: float
    lr: float
    grad_norm: float | None = None


@dataclass(frozen=True)
class ReportSettings:
    """What the reporting of a run reads, made once at start-up by ``ddp_rank.train.settings``: the ``train``
    section as it is (``output_dir``, ``progress``, ``plots``, ``best_metric``, the trackers of ``log_with``),
    ``evaluation`` (``data.test_split``, the retrieval picture's settings) and ``config``, the whole config the
    run records (``config.yaml``, ``summary.md``, the trackers' hyper-parameters)."""

    train: TrainConfig
    evaluation: EvalSettings
    config: ConfigRecord


def steps_to_train(step: int, total_steps: int, how: str) -> str:
    """What a start trains, in words: ``training steps 5-8 <how>``, ``training step 8 <how>``, or, for a resumed
    run that had already finished, that there is nothing left and how to train further."""
    if step >= total_steps:
        return f"nothing to train: step {step} of {total_steps} is done (a larger train.steps trains further)"
    steps = f"step {total_steps}" if step + 1 == total_steps else f"steps {step + 1}-{total_steps}"
    return f"training {steps} {how}"


class RunReport:
    """The reporting of one training process (``is_main``: rank 0, which writes and prints)."""

    def __init__(
        self,
        settings: ReportSettings,
        layout: BatchLayout,
        device: torch.device,
        is_main: bool,
        accelerator: Any = None,
        manifest: Manifest | None = None,
    ) -> None:
        self.settings = settings
        self.accelerator = accelerator
        """Its trackers (``train.log_with``) receive the metrics and pictures; None: no tracker."""
        self.picture = RetrievalPicture(settings.evaluation, is_main, manifest)
        """Pass ``picture.capture`` to the evaluation: each evaluation then draws retrieval.png."""
        self.layout = layout
        self.device = device
        self.is_main = is_main
        self.out_dir = Path(settings.train.output_dir)
        self.notes: list[str] = []
        self.logger: MetricsLogger | None = None
        self._bar: Any = None
        self._show_lines = False  # timestamped lines instead of the bar (no terminal)
        self._clock = (0, time.perf_counter())  # (first step, start time) of this start, for the ETA

    def note(self, message: str) -> None:
        """Something the user must know about this start (printed by rank 0, kept for the summary)."""
        self.notes.append(message)
        if self.is_main:
            log.warning(message)

    def start(self, step: int, total_steps: int, resumed: Path | None, data_facts: dict[str, Any]) -> None:
        """Announce the start, write its config and open the metrics log (rank 0); start the clock (all)."""
        self._clock = (step, time.perf_counter())
        if not self.is_main:
            return
        if resumed is not None:
            log.info(f"resumed from {resumed} at step {step} of {total_steps}")
        how = (
            f"with {self.layout.world_size} process(es) on {self.device.type}, global batch "
            f"{self.layout.describe()} into {self.out_dir}"
        )
        log.info(steps_to_train(step, total_steps, how))
        self._write_config(step)
        acc = self.accelerator if self.settings.train.log_with else None
        if acc is not None:
            start_trackers(acc, self.settings.train, self.settings.config)
        self.logger = MetricsLogger(
            self.out_dir / "metrics.jsonl",
            None if acc is None else lambda kind, step, values: log_metrics(acc, kind, step, values),
        )
        # A resumed run drops what the killed one logged after its checkpoint; a fresh one starts empty.
        self.logger.truncate_after(step if resumed else -1)
        self.logger.log("data", step, data_facts)
        if self.settings.train.progress and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
        # Without a terminal (a SLURM log, a pipe) a bar is noise: timestamped lines instead.
        self._show_lines = self._bar is None

    def _write_config(self, step: int) -> None:
        """``config.yaml`` (what this start runs with), written only once the resume check has passed, and a copy
        per start in ``config-history/`` so the config of every earlier start stays readable."""
        history = self.out_dir / "config-history"
        current = self.out_dir / "config.yaml"
        if not history.is_dir() and current.is_file():  # a run started before the history existed
            history.mkdir(parents=True)
            atomic_write_text(history / "start-000-earlier.yaml", current.read_text())
        start = len(list(history.glob("start-*.yaml"))) + (
            0 if (history / "start-000-earlier.yaml").exists() else 1
        )
        self.settings.config.write(history / f"start-{start:03d}-step-{step:08d}.yaml")
        self.settings.config.write(current)

    def step_done(self, result: StepResult) -> None:
        """Advance the progress bar by one step."""
        if self._bar is not None:
            self._bar.update(1)
            ips = self.layout.global_batch / max(result.step_time, 1e-9)
            self._bar.set_postfix(loss=f"{result.loss:.4f}", img_s=f"{ips:.1f}", refresh=False)

    def log_train(
        self,
        step: int,
        total_steps: int,
        epoch: float,
        window: list[StepResult],
        lrs: dict[str, float],
        data: dict[str, Any],
    ) -> None:
        """One ``train`` record of the steps in ``window`` (and a timestamped line without a terminal)."""
        if self.logger is None or not window:
            return
        step_time = sum(r.step_time for r in window) / len(window)
        values: dict[str, Any] = {
            "loss": sum(r.loss for r in window) / len(window),
            "lr": window[-1].lr,
            "images_per_s": self.layout.global_batch / max(step_time, 1e-9),
            "step_time": step_time,
            "data_time": sum(r.data_time for r in window) / len(window),
            "chunks": window[-1].chunks,
            "epoch": epoch,
            # One per optimizer group of the model: lr_backbone and lr_head, or lr_head alone for a feature head.
            **{f"lr_{group}": lr for group, lr in lrs.items()},
        }
        if window[-1].grad_norm is not None:
            values["grad_norm"] = window[-1].grad_norm
        values.update({f"data_{event}": data[event] for event in DATA_EVENTS})
        self.logger.log("train", step, values)
        if self._show_lines:
            start_step, t_start = self._clock
            per_step = (time.perf_counter() - t_start) / max(step - start_step, 1)
            line = StepLine(
                step=step,
                total=total_steps,
                epoch=epoch,
                loss=values["loss"],
                images_per_s=values["images_per_s"],
                data_time=values["data_time"],
                lrs=list(lrs.values()),
                memory=peak_memory(self.device),
                eta_s=per_step * (total_steps - step),
            )
            log.info(str(line))

    def evaluation(self, step: int, metrics: dict[str, Any]) -> None:
        """Log an evaluation and print its table (rank 0); its curves (verification, identification) go to
        ``curves.json``, the last evaluation's, drawn at the end of the run."""
        metrics, curves = split_curves(metrics)
        if self.logger is not None:
            self.logger.log("eval", step, metrics)
        picture = self.picture.write(f"step {step}", self.out_dir, self.device) if self.is_main else None
        if picture is not None:
            self._log_picture("retrieval", picture, step)
        if self.is_main and curves:
            saved = read_curves(self.out_dir)
            saved[f"step {step}"] = curves
            atomic_write_text(self.out_dir / CURVES_FILE, json.dumps(saved) + "\n")
        if self.is_main:
            shown = {k: v for k, v in metrics.items() if not k.rsplit("/", 1)[-1].startswith("num_")}
            log.info(
                f"evaluation at step {step} ({self.settings.evaluation.data.test_split}):\n"
                + format_table({f"step {step}": shown})
            )

    def stopped(self, step: int, received: str | None, checkpoint: str) -> None:
        """A ``stop`` record: every rank stopped after ``step`` on a signal (``received`` by this rank, or None
        when another rank received it) with ``checkpoint``."""
        if self.logger is not None:
            self.logger.log("stop", step, {"signal": received or "another rank's", "checkpoint": checkpoint})

    def finish(self, summary: dict[str, Any], total_steps: int, processes: str) -> None:
        """Close the bar; rank 0 writes the plots and ``summary.md``."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.is_main:
            return
        records = read_metrics(self.out_dir / "metrics.jsonl")
        plots = write_plots(records, self.out_dir) if self.settings.train.plots else []
        plots += self._curve_plots()
        for plot in plots:
            self._log_picture(plot.stem, plot, summary["steps"])
        evals = [r for r in records if r.get("kind") == "eval"]
        tables = {}
        if evals:
            rows = {
                f"step {r['step']}": {k: v for k, v in r.items() if k not in ("kind", "step")} for r in evals
            }
            tables["Evaluation"] = format_table(rows)
        facts = {
            "processes": processes,
            "global batch": f"{self.layout.global_batch} ({self.layout.local_batch} per rank)",
            "step": f"chunked, chunk {self.layout.chunk_size}" if self.layout.chunked else "direct",
            "steps": f"{summary['steps']} of {total_steps} ({summary['steps_this_run']} in this run)",
            "time": f"{summary['seconds']:.1f} s, {summary['images_per_s']:.1f} images/s"
            if summary["steps_this_run"]
            else "none: the run had already finished",
        }
        if summary["resumed_from"]:
            facts["resumed from"] = summary["resumed_from"]
        data = summary["data"]
        facts["data"] = (
            f"{data['replaced_classes']} class(es) replaced, {data['decode_errors']} decode error(s), "
            f"{data['cache_fallbacks']} cache fallback(s), {data['read_retries']} read retr(ies), "
            f"bad shards: {', '.join(data['bad_shards']) or 'none'}"
        )
        if data["categories_left_out"]:
            facts["categories left out"] = "; ".join(data["categories_left_out"])
        if evals:
            facts.update(deployment_lines(evals[-1]))
        for i, note in enumerate(self.notes, start=1):
            facts[f"note {i}"] = note.replace("\n", " ")
        if summary["best_step"] is not None:
            facts["best"] = (
                f"{self.settings.train.best_metric} {100 * summary['best_value']:.2f} at step {summary['best_step']}"
            )
        write_summary(
            self.out_dir / "summary.md",
            title=f"Run {self.out_dir.name}",
            config=self.settings.config.values,
            records=records,
            facts=facts,
            tables=tables,
            plots=plots,
        )

    def _log_picture(self, name: str, path: Path, step: int) -> None:
        if self.accelerator is not None and self.settings.train.log_with:
            log_picture(self.accelerator, name, path, step)

    def _curve_plots(self) -> list[Path]:
        """roc.png, det.png, pr.png, cmc.png of the first and the last evaluation (``train.plots``)."""
        saved = read_curves(self.out_dir)
        if not self.settings.train.plots or not saved:
            return []
        names = list(saved)
        return draw_curves({name: saved[name] for name in dict.fromkeys([names[0], names[-1]])}, self.out_dir)

    def close(self) -> None:
        """Flush and close the metrics log (safe to call twice)."""
        if self.logger is not None:
            self.logger.close()
            self.logger = None

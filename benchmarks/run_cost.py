"""A run's fixed cost: what a one-process run pays besides its steps, as its own process and in a worker
process that trains runs in turn (``ddp_rank.experiments.in_process``, what ``benchmarks/study_features.py``
does).

    python -m benchmarks.run_cost                    # 10 and 20 steps, 3 rounds, writes benchmarks/results/
    python -m benchmarks.run_cost --steps 5 --rounds 1 --no-write

The fixed cost of a way of running is ``2 wall(N) - wall(2N)``: the steps cancel, what is paid once per run
stays. The runs have the word study's settings (``configs/words_features.yaml``, a linear head on feature
shards, ``model.backbone=features``, the study's overrides, evaluation off) on synthetic feature shards
(``data.features.synthetic``, so no feature build is needed), one torch thread each (the study's, two jobs
on two cores). Each round measures every way in turn, interleaved (on a shared machine the load drifts: a
comparison within a round is fair, one across rounds less so), and the table gives each round and the median.
Ways:

- ``own process``: ``python -m ddp_rank.cli train`` as the study ran it before (with its run pictures);
- ``own process, no pictures``: the same with ``train.plots=false``, as the study now sets (it draws its own);
- ``in a worker``: the run trained by a worker process that has already trained one run (its first run pays the
  imports, reported apart).

Beside them, the imports that make up most of an own process's cost: each a fresh ``python -c 'import ...'``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, markdown_table, write_result

IMPORTS = {
    "python": "pass",
    "torch": "import torch",
    "the trainer (torch, accelerate, ddp_rank)": "import ddp_rank.train.trainer",
    "torch._dynamo (the optimizer's first call)": "import torch._dynamo",
    "matplotlib.pyplot (the run pictures)": "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="N: runs of N and 2N steps (default 10)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--dim", type=int, default=1792, help="length of the stored vectors (the word study's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run (the study's: 1)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)

    from ddp_rank.data.features.synthetic import write_feature_shards
    from ddp_rank.experiments.in_process import worker_pool

    n = args.steps
    runs: dict[str, list[tuple[Cost, Cost]]] = {way: [] for way in WAYS}
    imports: dict[str, list[Cost]] = {name: [] for name in IMPORTS}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="ddp_rank-run-cost-") as tmp:
        classes = -(-int(args.batch * 1.5) // 8)  # whole classes to spare for the plan
        shards = write_feature_shards(Path(tmp) / "shards", [-(-classes // 8)] * 8, 8, args.dim, test_every=0)
        counter = iter(range(1_000_000))

        def overrides(steps: int, plots: bool) -> list[str]:
            return _study_overrides(shards, Path(tmp) / f"run{next(counter)}", steps, args.batch, plots)

        with worker_pool(1, args.threads, cwd=REPO) as pool:

            def in_worker(steps: int) -> Cost:
                t = time.perf_counter()
                code, cpu = pool.submit(_timed_in_worker, str(CONFIG), overrides(steps, False)).result()
                if code != 0:
                    raise SystemExit(f"a run in the worker failed with exit status {code}")
                return time.perf_counter() - t, cpu

            def own(steps: int, plots: bool) -> Cost:
                return _child(
                    ["-m", "ddp_rank.cli", "train", "--config", str(CONFIG), *overrides(steps, plots)], env
                )

            first = in_worker(n)  # pays the imports
            way_runs = {
                "own process": lambda s: own(s, True),
                "own process, no pictures": lambda s: own(s, False),
                "in a worker": in_worker,
            }
            for r in range(args.rounds):
                for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
                    runs[way].append((way_runs[way](n), way_runs[way](2 * n)))
                for name, code in IMPORTS.items():
                    imports[name].append(_child(["-c", code], env))
                print(f"round {r + 1}/{args.rounds} done", flush=True)

    body = _table(args, runs, imports, first)
    print(body)
    if not args.no_write:
        path = write_result("run-cost", "A run's fixed cost: own process and in a worker", body)
        print(f"written to {path}")
    return 0


Cost = tuple[float, float]
"""Wall and CPU seconds."""
CONFIG = REPO / "configs" / "words_features.yaml"
WAYS = ("own process", "own process, no pictures", "in a worker")


def _child(args: list[str], env: dict[str, str]) -> Cost:
    """Wall and CPU seconds (user and system, its threads together) of a child Python with ``args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, cwd=REPO, check=True, capture_output=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _timed_in_worker(config: str, overrides: list[str]) -> tuple[int, float]:
    """A run in the worker process (its exit status), with the CPU seconds the worker spent on it."""
    from ddp_rank.experiments.in_process import train_in_worker

    t = time.process_time()
    code = train_in_worker(config, overrides, os.devnull)
    return code, time.process_time() - t


def _study_overrides(shards: Path, run: Path, steps: int, batch: int, plots: bool) -> list[str]:
    """The word study's overrides of a run (``benchmarks.study_features``: ``Trainer.common``, a schedule, the
    run settings), with the evaluation off."""
    return [
        f"data.shards={shards}", "model.backbone=features", "model.weights=none", "data.train_split=train",
        "data.test_split=", "eval.metrics=[]", f"data.global_batch_size={batch}", "optim.lr=1e-3",
        f"train.steps={steps}", "train.eval_every=0", f"train.checkpoint_every={steps}",
        f"train.log_every={max(1, steps // 2)}", "optim.schedule=cosine", "optim.min_lr_ratio=0",
        "optim.warmup_steps=1", f"train.output_dir={run}", "train.keep_last=1", "train.progress=false",
        "train.resume=auto", f"train.plots={str(plots).lower()}",
    ]  # fmt: skip


def _fixed(pairs: list[tuple[Cost, Cost]], i: int) -> list[float]:
    """2 cost(N) - cost(2N) of each round (``i``: 0 wall, 1 CPU)."""
    return [2 * a[i] - b[i] for a, b in pairs]


def _table(
    args: argparse.Namespace,
    runs: dict[str, list[tuple[Cost, Cost]]],
    imports: dict[str, list[Cost]],
    first: Cost,
) -> str:
    n = args.steps
    med = statistics.median
    rows = [
        [
            way,
            f"{med(a[0] for a, _ in pairs):.2f}",
            f"{med(b[0] for _, b in pairs):.2f}",
            f"**{med(_fixed(pairs, 0)):.2f}**",
            ", ".join(f"{f:.2f}" for f in _fixed(pairs, 0)),
            f"**{med(_fixed(pairs, 1)):.2f}**",
            ", ".join(f"{f:.2f}" for f in _fixed(pairs, 1)),
        ]
        for way, pairs in runs.items()
    ]
    ratio = [
        med(_fixed(runs[way], i)) / max(med(_fixed(runs["in a worker"], i)), 1e-9)
        for way in ("own process", "own process, no pictures")
        for i in (0, 1)
    ]
    import_rows = [
        [name, f"{med(c[0] for c in costs):.2f}", f"{med(c[1] for c in costs):.2f}"]
        for name, costs in imports.items()
    ]
    return "\n".join(
        [
            f"Command: `python -m benchmarks.run_cost --steps {n} --rounds {args.rounds} --batch {args.batch} "
            f"--dim {args.dim} --threads {args.threads}`. Runs of N = {n} and 2N = {2 * n} steps with the word "
            f"study's settings (configs/words_features.yaml, model.backbone=features, evaluation off) on synthetic "
            f"feature shards of {args.dim} values, global batch {args.batch}, {args.threads} torch thread(s). "
            "Fixed cost = 2 cost(N) - cost(2N), in wall seconds and in CPU seconds (user + system: steadier than "
            "the wall on a loaded machine); the ways interleaved in each round; medians over the rounds. Load "
            f"average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
            "",
            markdown_table(
                [
                    "way",
                    f"wall(N={n}) s",
                    f"wall(2N={2 * n}) s",
                    "fixed wall s",
                    "per round",
                    "fixed CPU s",
                    "per round",
                ],
                rows,
            ),
            "",
            f"Fixed cost, own process / in a worker: {ratio[0]:.1f}x wall, {ratio[1]:.1f}x CPU (with the run "
            f"pictures); {ratio[2]:.1f}x wall, {ratio[3]:.1f}x CPU (without). The worker's first run (N = {n}, "
            f"paying the imports but torch's, made as the worker started): {first[0]:.2f} s wall, {first[1]:.2f} s "
            "CPU.",
            "",
            "What a fresh process pays to import (medians of `python -c 'import ...'`, in the same rounds):",
            "",
            markdown_table(["import", "wall s", "CPU s"], import_rows),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())

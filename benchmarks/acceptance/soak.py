"""Soak: days on a shared cluster in a few minutes. Two gloo processes train a tiny model for thousands of steps
over shards served on loopback HTTP through a node cache held at its cap, while faults arrive on a schedule:

- the file server stopped and restarted (twice): its port refuses connections for a few seconds, then it answers
  503 (a server warming up) until it has turned a read away, so every outage costs the run at least one read, which
  is retried (``read_retries``); a fixed down time alone could fall between two reads, the node cache serving the
  run meanwhile, and prove nothing;
- the job signalled and resumed (twice: SIGUSR1 to rank 1, SIGTERM to rank 0), each stop a checkpoint, exit 75
  and a relaunch of the same command (``stop`` records);
- a shard corrupted (one class's bytes flipped, on the server and in the node cache) while the job is stopped:
  the class is replaced from the plan's reserve from then on (``replaced_classes``, ``bad_shards``);
- the cache at its cap all along (``cache_fallbacks``: shards read by range when the cap is held by open ones).

The reference is the same training without any of these: local shards, no cache, one process group from start
to end, except that the same shard is corrupted at the step where the faulty run was stopped for it (a
corruption is part of the data's history, not a transient fault). The faulty run must end with the reference's
weights bit for bit and with the reference's replacements, every fault counted in ``metrics.jsonl``. The
resident memory of the ranks (summed) is sampled all along; the growth over the second half of the last,
longest start tells a leak from warm-up.

    python -m benchmarks.acceptance.soak                  # 2,000 steps, + a fault-free run over HTTP for the speed ratio
    python -m benchmarks.acceptance.soak --steps 20000    # the long form

tests/benchmarks/acceptance/test_soak.py runs the same schedule (2,000 steps, without the extra fault-free run). The table
is printed and written to benchmarks/results/soak-<YYYY-MM-DD>.md with the machine named.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.server
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks.common import accelerate_cpu_cmd, cpu_job_env, markdown_table, write_result
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.serve import RangeRequestHandler

REPO = Path(__file__).resolve().parents[2]
EXIT_REQUEUE = 75
OUTAGE_S = 2.0
"""How long the server's port is closed in an outage (shorter than the store's retry time, ``storage.RETRY_S``)."""
UNAVAILABLE_MAX_S = 90.0
"""Longest the restarted server answers 503 while no read has come (the run reads a shard every few seconds)."""

TINY_RUN = [
    "distributed.cpu=true", "model.backbone=tiny_cnn", "model.embedding_dim=16", "data.image_size=16",
    "data.resize_size=16", "data.global_batch_size=16", "data.sampler=hard", "data.batches_per_pair=1",
    "data.num_workers=0", "optim.lr=1e-3", "train.progress=false", "train.log_every=1", "train.eval_every=0",
    "eval.ks=1,2", "eval.batch_size=16", "train.checkpoint_every=250", "train.keep_last=2",
]  # fmt: skip


@dataclass
class Fault:
    """One fault of the schedule: ``kind`` (outage / signal) once the run has reached ``at`` (a share of the
    steps); a signal goes to ``rank`` and, with ``corrupt``, the stopped job's shard is corrupted before the
    relaunch."""

    kind: str
    at: float
    rank: int = 0
    signal: str = ""
    corrupt: bool = False
    sent: bool = False


SCHEDULE = [
    Fault("outage", 0.15),
    Fault("signal", 0.30, rank=1, signal="SIGUSR1", corrupt=True),
    Fault("outage", 0.45),
    Fault("signal", 0.60, rank=0, signal="SIGTERM"),
]


@dataclass
class Job:
    """What one training run (all its starts) did."""

    run_dir: Path
    wall_s: float = 0.0
    starts: int = 0
    stops: list[int] = field(default_factory=list)
    outages: int = 0
    turned_away: int = 0  # reads the restarting server answered 503
    memory: list[tuple[int, int, float]] = field(default_factory=list)  # (start, step, RSS MiB of the ranks)


class _RestartingHandler(RangeRequestHandler):
    """``ddp-rank shards serve``'s handler, answering 503 while its server says it is still starting."""

    server: _SoakServer

    def send_head(self) -> Any:
        if self.server.starting:
            with self.server.lock:
                self.server.turned_away += 1
            self.send_error(503, "Service Unavailable", "restarting")
            return None
        return super().send_head()


class _SoakServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server with the restart state its handlers share: ``starting`` (answer 503) and how many
    requests were answered so."""

    def __init__(self, address: tuple[str, int], handler: Callable[..., Any], starting: bool) -> None:
        super().__init__(address, handler)
        self.starting = starting
        self.turned_away = 0
        self.lock = threading.Lock()


class RestartableServer:
    """The shard directory on loopback HTTP, stopped and restarted on the same port as a file server's outage."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = 0
        self._server: _SoakServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, starting: bool = False) -> None:
        handler = partial(_RestartingHandler, directory=str(self.directory))
        self._server = _SoakServer(("127.0.0.1", self.port), handler, starting)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def outage(self) -> int:
        """Stop the server for ``OUTAGE_S``, restart it answering 503 until it has turned a read away (at most
        ``UNAVAILABLE_MAX_S``), then serve again; the reads it turned away."""
        self.stop()
        time.sleep(OUTAGE_S)
        self.start(starting=True)
        assert self._server is not None
        server, deadline = self._server, time.monotonic() + UNAVAILABLE_MAX_S
        while server.turned_away == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.starting = False
        return server.turned_away


def build_soak_shards(root: Path) -> Path:
    """4 categories x 8 classes x 6 images of 16 px in shards of about 20 samples (many shards for the cache to
    evict), a quarter of each category's classes held out for the test split."""
    write_image_folder(root / "images", [[6] * 8] * 4, image_size=16, seed=0)
    out = root / "shards"
    build_shards(
        read_image_folder(root / "images"),
        out,
        BuildOptions(test_fraction=0.25, max_samples=20, progress=False),
    )
    return out


def cache_cap_gb(shards: Path) -> float:
    """The cache's cap: about two and a half of the largest train shards (of many: the cache evicts all along)."""
    sizes = sorted(s.bytes for s in Manifest.load(shards).split("train").shards)
    return (sizes[-1] + sizes[-2] + sizes[-3] // 2) / 1e9


def corrupt_one_class(shards: Path, cache_dir: Path | None) -> str:
    """Flip the bytes in the middle of the second class of the first train shard, in ``shards`` and in the
    cache's copy of that shard if it holds one; the shard's path."""
    shard = Manifest.load(shards).split("train").shards[0]
    span = shard.classes[min(1, len(shard.classes) - 1)]
    copies = [shards / shard.path]
    if cache_dir is not None and (cache_dir / f"{shard.sha256}.tar").is_file():
        copies.append(cache_dir / f"{shard.sha256}.tar")
    for path in copies:
        with path.open("r+b") as f:
            f.seek(span.offset + span.length // 2)
            chunk = f.read(64)
            f.seek(span.offset + span.length // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
    return shard.path


def last_step(metrics: Path) -> int:
    """The step of the last ``train`` record of ``metrics.jsonl`` (0 before the first)."""
    try:
        with metrics.open("rb") as f:
            f.seek(0, 2)
            start = max(0, f.tell() - 8192)
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()[1 if start else 0 :]
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            return int(record["step"])
    return 0


def _ranks(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The launcher's rank processes by rank."""
    ranks = {}
    for child in launcher.children(recursive=True):
        try:
            environ = child.environ()
            if "RANK" in environ and "ddp_rank.cli" in " ".join(child.cmdline()):
                ranks[int(environ["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def run_start(
    job: Job,
    overrides: list[str],
    on_step: Callable[[int, dict[int, psutil.Process]], None],
    timeout_s: float,
) -> int:
    """One start of the job (a relaunch of the same command resumes it); its exit status."""
    cmd = accelerate_cpu_cmd(
        REPO, "-m", "ddp_rank.cli", "train", f"train.output_dir={job.run_dir}", *overrides
    )
    log = (job.run_dir.parent / f"{job.run_dir.name}-start{job.starts}.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_job_env(), stdout=log, stderr=subprocess.STDOUT)
    launcher = psutil.Process(proc.pid)
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"start {job.starts} of {job.run_dir} ran past {timeout_s:.0f} s")
            ranks = _ranks(launcher)
            step = last_step(job.run_dir / "metrics.jsonl")
            rss = 0
            for process in ranks.values():
                with contextlib.suppress(psutil.NoSuchProcess):
                    rss += process.memory_info().rss
            if step and rss:
                job.memory.append((job.starts, step, rss / 2**20))
            on_step(step, ranks)
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        job.wall_s += time.monotonic() - t0
        job.starts += 1
    return proc.returncode


def run_with_faults(
    shards: Path, work: Path, steps: int, schedule: list[Fault], timeout_s: float
) -> tuple[Job, list[int]]:
    """The faulty run; the steps after which the shard was corrupted (one at most, for the reference)."""
    served = work / "served"
    shutil.copytree(shards, served)
    cache, cap_gb = work / "cache", cache_cap_gb(served)
    server = RestartableServer(served)
    job = Job(work / "faults")
    pending = [dataclasses.replace(f) for f in sorted(schedule, key=lambda f: f.at)]
    corrupted_after: list[int] = []
    overrides = [*TINY_RUN, f"train.steps={steps}", f"data.shards={server.url}", f"data.cache_dir={cache}",
                 f"data.cache_max_gb={cap_gb}"]  # fmt: skip

    def on_step(step: int, ranks: dict[int, psutil.Process]) -> None:
        while pending and pending[0].kind == "outage" and step >= pending[0].at * steps:
            pending.pop(0)
            job.turned_away += server.outage()
            job.outages += 1
        if pending and pending[0].kind == "signal" and step >= pending[0].at * steps:
            fault = pending[0]
            if fault.rank in ranks and not fault.sent:
                ranks[fault.rank].send_signal(signal.Signals[fault.signal])
                fault.sent = True

    try:
        while True:
            code = run_start(job, overrides, on_step, timeout_s)
            if code == 0:
                break
            fault = pending.pop(0) if pending and pending[0].sent else None
            if fault is None:
                raise RuntimeError(
                    f"start {job.starts - 1} failed with status {code}: see {job.run_dir}-*.log"
                )
            job.stops.append(latest_checkpoint_step(job.run_dir))
            if fault.corrupt:
                corrupt_one_class(served, cache)
                corrupted_after.append(job.stops[-1])
    finally:
        server.stop()
    return job, corrupted_after


def latest_checkpoint_step(run_dir: Path) -> int:
    steps = [
        int(p.name.split("-")[1])
        for p in (run_dir / "checkpoints").glob("step-*")
        if (p / "meta.json").exists()
    ]
    return max(steps, default=0)


def run_reference(shards: Path, work: Path, steps: int, corrupted_after: list[int], timeout_s: float) -> Job:
    """The same training without faults: local shards, no cache; the shard corrupted after the same step."""
    local = work / "reference-shards"
    shutil.copytree(shards, local)
    job = Job(work / "reference")
    for until in [*corrupted_after, steps]:
        if job.starts:
            corrupt_one_class(local, None)
        code = run_start(
            job, [*TINY_RUN, f"train.steps={until}", f"data.shards={local}"], lambda *_: None, timeout_s
        )
        if code != 0:
            raise RuntimeError(f"the reference failed with status {code}: see {job.run_dir}-*.log")
    return job


def run_clean_over_http(shards: Path, work: Path, steps: int, timeout_s: float) -> Job:
    """The faulty run's setting (HTTP, the capped cache) with no fault: its speed is the baseline."""
    served = work / "clean-served"
    shutil.copytree(shards, served)
    server, cap_gb = RestartableServer(served), cache_cap_gb(served)
    job = Job(work / "clean-http")
    try:
        overrides = [*TINY_RUN, f"train.steps={steps}", f"data.shards={server.url}",
                     f"data.cache_dir={work / 'clean-cache'}", f"data.cache_max_gb={cap_gb}"]  # fmt: skip
        if run_start(job, overrides, lambda *_: None, timeout_s) != 0:
            raise RuntimeError(f"the fault-free run failed: see {job.run_dir}-*.log")
    finally:
        server.stop()
    return job


# ----------------------------------------------------------------------------------------- what the runs say
def fault_counts(run_dir: Path) -> dict[str, Any]:
    """The faults ``metrics.jsonl`` counted over every start: the data events (each start counts from zero, so
    the last ``train`` record of each start is summed), the bad shards and the ``stop`` records."""
    totals: dict[str, Any] = {"stops": 0, "bad_shards": set()}
    last: dict[str, Any] = {}

    def close_start() -> None:
        for key, value in last.items():
            if key == "data_bad_shards":
                totals["bad_shards"] |= set(value)
            elif key.startswith("data_"):
                totals[key[5:]] = totals.get(key[5:], 0) + int(value)
        last.clear()

    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "data":  # a start
            close_start()
        elif record["kind"] == "train":
            last = {k: v for k, v in record.items() if k.startswith("data_")} or last
        elif record["kind"] == "stop":
            totals["stops"] += 1
    close_start()
    totals["bad_shards"] = sorted(totals["bad_shards"])
    return totals


def memory_growth(job: Job) -> dict[str, float]:
    """RSS of the ranks (MiB, summed) at the start, middle and end of the last start, and the growth over its
    second half (medians of the samples in the first / middle / last 5% of its steps)."""
    last = [(step, rss) for start, step, rss in job.memory if start == job.starts - 1]
    if len(last) < 10:
        raise RuntimeError(f"too few memory samples of the last start ({len(last)}): the run was too short")
    first, final = last[0][0], last[-1][0]
    width = max(1, (final - first) // 20)
    mid = first + (final - first) // 2

    def around(lo: int) -> float:
        values = sorted(rss for step, rss in last if lo <= step <= lo + width)
        return values[len(values) // 2] if values else float("nan")

    start, middle, end = around(first), around(mid), around(final - width)
    return {"start_mib": start, "middle_mib": middle, "end_mib": end, "second_half_growth": end / middle - 1}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    step = latest_checkpoint_step(run_dir)
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    mine, reference = final_weights(a), final_weights(b)
    return mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in reference)


def soak(
    work: Path, steps: int, schedule: list[Fault] = SCHEDULE, clean_http: bool = False
) -> dict[str, Any]:
    """The faulty run, its reference (and the fault-free HTTP run): the figures the test and the table use."""
    timeout_s = 60 + steps * 0.5
    shards = build_soak_shards(work / "data")
    faulty, corrupted_after = run_with_faults(shards, work, steps, schedule, timeout_s)
    reference = run_reference(shards, work, steps, corrupted_after, timeout_s)
    result: dict[str, Any] = {
        "steps": steps,
        "faulty": faulty,
        "reference": reference,
        "corrupted_after": corrupted_after,
        "counts": fault_counts(faulty.run_dir),
        "reference_counts": fault_counts(reference.run_dir),
        "memory": memory_growth(faulty),
        "same_weights": same_weights(faulty.run_dir, reference.run_dir),
        "cache_cap_bytes": int(cache_cap_gb(work / "served") * 1e9),
        "cache_bytes": sum(p.stat().st_size for p in (work / "cache").glob("*.tar")),
    }
    if clean_http:
        result["clean"] = run_clean_over_http(shards, work, steps, timeout_s)
    return result


def report(result: dict[str, Any]) -> str:
    faulty, counts, memory = result["faulty"], result["counts"], result["memory"]
    rows = [
        ["with faults", str(faulty.starts), f"{result['steps'] / faulty.wall_s:.1f}", f"{faulty.wall_s:.0f}"],
        ["reference (local, no cache)", str(result["reference"].starts),
         f"{result['steps'] / result['reference'].wall_s:.1f}", f"{result['reference'].wall_s:.0f}"],
    ]  # fmt: skip
    if "clean" in result:
        clean = result["clean"]
        rows.append(
            [
                "no fault (HTTP, capped cache)",
                "1",
                f"{result['steps'] / clean.wall_s:.1f}",
                f"{clean.wall_s:.0f}",
            ]
        )
    speed = markdown_table(["run", "starts", "steps/s (launches included)", "wall s"], rows)
    faults = markdown_table(
        ["fault", "injected", "counted in metrics.jsonl"],
        [
            ["server outage", f"{faulty.outages} ({faulty.turned_away} reads answered 503)",
             f"{counts.get('read_retries', 0)} read retries"],
            ["signal, stop and resume", str(len(faulty.stops)), f"{counts['stops']} stop records, after steps {faulty.stops}"],
            ["class corrupted", f"after step {result['corrupted_after']}",
             f"{counts.get('replaced_classes', 0)} replaced (reference: {result['reference_counts'].get('replaced_classes', 0)}), "
             f"bad shards {counts['bad_shards']}"],
            ["cache at its cap", "all along", f"{counts.get('cache_fallbacks', 0)} cache fallbacks"],
        ],
    )  # fmt: skip
    mem = (
        f"Resident memory of the 2 ranks over the last start: {memory['start_mib']:.0f} MiB at its start, "
        f"{memory['middle_mib']:.0f} MiB in the middle, {memory['end_mib']:.0f} MiB at the end: "
        f"{100 * memory['second_half_growth']:+.1f}% over the second half."
    )
    verdict = "bit-identical to" if result["same_weights"] else "DIFFERENT from"
    return f"{result['steps']} steps, 2 gloo processes.\n\n{speed}\n\n{faults}\n\n{mem}\n\nFinal weights: {verdict} the reference.\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (default: a temporary one)"
    )
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ddp-rank-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        text = report(soak(work, args.steps, clean_http=True))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(text)
    print(f"written to {write_result('soak', 'Soak: faults over thousands of steps', text)}")


if __name__ == "__main__":
    main()

"""``distributed.chunk_size=auto``: the chosen chunk is the largest that fits the budget, never more; a batch that
fits is not chunked; the probe measures the real model without touching it, after a warm-up step; the budget
frees PyTorch's cache before reading a GPU's free memory, keeps a margin inside ``memory_budget_mb``, and heeds
a cgroup's memory limit; a global batch of 4,096 on one process starts without the user choosing anything."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddp_rank.config import ModelConfig, load_config
from ddp_rank.model import build_model
from ddp_rank.train.chunking import choice as chunk_choice
from ddp_rank.train.chunking.choice import choose_chunk, measure_activation_bytes, memory_budget, probe_sizes
from ddp_rank.train.chunking.host_memory import available_memory
from tests.helpers.training import TINY_OVERRIDES


@given(
    local=st.integers(1, 100_000),
    per_image=st.integers(1, 10**8),
    budget=st.integers(0, 10**12),
)
def test_the_chunk_is_the_largest_that_fits_and_a_batch_that_fits_is_not_chunked(
    local: int, per_image: int, budget: int
) -> None:
    """A fake memory model (activations = chunk x bytes per image) against the choice."""
    if per_image > budget:
        if local * per_image > budget:
            with pytest.raises(ValueError, match="exceed the memory budget"):
                choose_chunk(local, per_image, budget)
        return
    chunk = choose_chunk(local, per_image, budget)
    if local * per_image <= budget:
        assert chunk is None
        return
    assert chunk is not None and 1 <= chunk < local
    assert chunk * per_image <= budget < (chunk + 1) * per_image


def test_the_probe_measures_activations_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=16), 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    small = measure_activation_bytes(model, 16, torch.device("cpu"))
    large = measure_activation_bytes(model, 32, torch.device("cpu"))
    assert "saved for backward" in large.how and large.settled
    assert large.sizes == (1, 2, 4), "saved bytes grow linearly: settled at the CPU's smallest settled size"
    assert 3.0 < large.per_image / small.per_image < 5.0, "activations grow with the image area"
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_probe_warms_up_before_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake memory model: the first step of a fresh copy also sets up a one-time workspace (cuBLAS / cuDNN),
    which must not count in the small probe (it would make the growth per image look negative here). Since the
    probe grows until the growth per image settles, it runs 1 (warm-up), 1, 2, 4 on CPU (changed on purpose: it
    ran 2, 2, 4 when two probe sizes were all it measured)."""
    per_image, fixed, workspace = 1_000, 50_000, 10_000
    calls: list[int] = []

    def fake_step_bytes(model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype | None) -> int:
        calls.append(len(images))
        return (workspace if len(calls) == 1 else 0) + fixed + per_image * len(images)

    monkeypatch.setattr(chunk_choice, "_step_bytes", fake_step_bytes)
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8), 16)
    measured = measure_activation_bytes(model, 16, torch.device("cpu"))
    assert measured.per_image == per_image and measured.intercept == fixed and calls == [1, 1, 2, 4]


def _probe(
    step_bytes: Callable[[int], int], device: str, budget: int | None, largest: int | None
) -> list[int]:
    """The sizes the probe runs against a fake memory model (``probe_sizes`` drives it as the probe does)."""
    measured: dict[int, int] = {}
    n, _ = probe_sizes(measured, device, budget, largest)
    while n is not None:
        measured[n] = step_bytes(n)
        n, _ = probe_sizes(measured, device, budget, largest)
    return list(measured)


def test_the_probe_grows_until_the_growth_per_image_settles_where_real_chunks_run() -> None:
    """A cuDNN-like fake: the workspace changes with the shape below 32 images (another algorithm per shape), so
    the growth between small probes is wrong; on a GPU the probe doubles until the growth settles at 32 or more,
    on CPU from 4 (from 1 image). It stops at the local batch, at 256 images, and where the next size would pass
    the budget."""
    per_image = 3 * 2**20
    workspace = {2: 900 * 2**20, 4: 100 * 2**20, 8: 400 * 2**20, 16: 50 * 2**20}

    def gpu_step(n: int) -> int:
        return 200 * 2**20 + per_image * n + workspace.get(n, 64 * 2**20)

    sizes = _probe(gpu_step, "cuda", budget=None, largest=None)
    assert sizes == [2, 4, 8, 16, 32, 64, 128]
    growths = [(gpu_step(b) - gpu_step(a)) // (b - a) for a, b in itertools.pairwise(sizes)]
    assert growths[-2:] == [per_image, per_image] and growths[0] < 0, "only the large probes see the truth"
    assert _probe(lambda n: per_image * n, "cpu", None, None) == [1, 2, 4]
    assert _probe(gpu_step, "cuda", None, largest=20) == [2, 4, 8, 16], "no probe past the local batch"
    assert _probe(gpu_step, "cuda", None, largest=1) == [2, 4], "two sizes at least"
    assert _probe(lambda n: 2**20 * n * n, "cpu", None, None)[-1] == 256, "never settles: 256 at most"
    assert _probe(lambda n: per_image * n, "cuda", 20 * per_image, None) == [2, 4, 8, 16], "32 would pass it"


def test_the_gpu_budget_counts_the_probes_cached_blocks_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake caching allocator: the probe's blocks stay cached (used, for the driver) until empty_cache."""
    gib = 2**30
    allocator = {"used": 2 * gib, "cached": 6 * gib, "total": 80 * gib}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: allocator.update(cached=0))
    monkeypatch.setattr(
        torch.cuda,
        "mem_get_info",
        lambda device=None: (
            allocator["total"] - allocator["used"] - allocator["cached"],
            allocator["total"],
        ),
    )
    budget, how = memory_budget(torch.device("cuda", 0), 0.5, 0, fixed_bytes=gib)
    assert budget == int(0.5 * 78 * gib) - gib and "78.00 GiB free" in how


@given(per_image=st.integers(1_000, 10**8), budget_mb=st.integers(1, 10**5), local=st.integers(1, 10**5))
def test_a_chunk_chosen_from_memory_budget_mb_stays_inside_it(
    per_image: int, budget_mb: int, local: int
) -> None:
    """On CPU the counted bytes are low: a step's resident memory grows up to 11% more per image (measured on
    ResNet-18 and EfficientNet-Lite0). With the default memory_fraction the chunk's resident memory still fits."""
    budget, how = memory_budget(torch.device("cpu"), 0.8, budget_mb)
    assert "memory_fraction=0.8 of distributed.memory_budget_mb" in how
    try:
        chunk = choose_chunk(local, per_image, budget)
    except ValueError:
        return
    resident_per_image = 1.11 * per_image
    assert (chunk or local) * resident_per_image <= budget_mb * 2**20


def test_the_cpu_budget_is_the_setting_or_a_share_of_available_memory() -> None:
    budget, how = memory_budget(torch.device("cpu"), 0.8, 64, fixed_bytes=123)
    assert budget == int(0.8 * 64 * 2**20) and "memory_budget_mb=64" in how
    shared, how = memory_budget(torch.device("cpu"), 0.5, 0, fixed_bytes=0, local_processes=2)
    alone, _ = memory_budget(torch.device("cpu"), 0.5, 0, fixed_bytes=0, local_processes=1)
    assert 0 < shared <= alone // 2 + 2**20 and "2 process(es)" in how


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_available_memory_is_the_cgroup_headroom_where_that_is_less(tmp_path: Path) -> None:
    """A SLURM --mem job on cgroup v2: the limit sits on the job's cgroup, above the step's (no limit there); the
    job's usage counts, less its inactive page cache."""
    gib = 2**30
    meminfo = _write(tmp_path / "meminfo", "MemTotal: 100000000 kB\nMemAvailable:   67108864 kB\n")  # 64 GiB
    job = tmp_path / "cg2" / "system.slice" / "slurmstepd.scope" / "job_7"
    _write(job / "memory.max", f"{4 * gib}\n")
    _write(job / "memory.current", f"{gib}\n")
    _write(job / "memory.stat", f"anon 1\ninactive_file {gib // 4}\nactive_file 5\n")
    _write(job / "step_0" / "memory.max", "max\n")
    _write(job / "step_0" / "memory.current", "1000\n")
    proc_cgroup = _write(tmp_path / "cgroup", "0::/system.slice/slurmstepd.scope/job_7/step_0\n")
    mountinfo = _write(
        tmp_path / "mountinfo",
        f"30 23 0:26 / {tmp_path / 'cg2'} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n",
    )
    assert available_memory(meminfo, proc_cgroup, mountinfo) == (
        4 * gib - (gib - gib // 4),
        "the cgroup's memory limit less its usage",
    )
    _write(job / "memory.max", "max\n")  # no limit: the node's figure
    assert available_memory(meminfo, proc_cgroup, mountinfo) == (64 * gib, "MemAvailable")


def test_available_memory_reads_a_v1_container_and_survives_missing_files(tmp_path: Path) -> None:
    """cgroup v1 in a container without its own cgroup namespace: the mount's root is the container's cgroup."""
    gib = 2**30
    meminfo = _write(tmp_path / "meminfo", "MemAvailable:   67108864 kB\n")
    memory = tmp_path / "v1" / "memory"
    _write(memory / "memory.limit_in_bytes", f"{2 * gib}\n")
    _write(memory / "memory.usage_in_bytes", f"{gib // 2}\n")
    proc_cgroup = _write(tmp_path / "cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    mountinfo = _write(
        tmp_path / "mountinfo", f"35 31 0:32 /docker/abc {memory} rw,relatime - cgroup cgroup rw,memory\n"
    )
    assert available_memory(meminfo, proc_cgroup, mountinfo)[0] == 2 * gib - gib // 2
    _write(memory / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert available_memory(meminfo, proc_cgroup, mountinfo) == (64 * gib, "MemAvailable")
    missing = tmp_path / "missing"
    assert available_memory(meminfo, missing, missing) == (64 * gib, "MemAvailable")
    physical, source = available_memory(missing, missing, missing)
    assert physical > 0 and source == "physical memory"


def test_chunk_size_accepts_auto_or_a_number() -> None:
    from ddp_rank.config import ConfigError

    assert load_config(None, []).distributed.chunk_size == "auto"
    assert load_config(None, ["distributed.chunk_size=96"]).distributed.fixed_chunk == 96
    assert load_config(None, ["distributed.chunk_size=AUTO"]).distributed.fixed_chunk is None
    with pytest.raises(ConfigError, match="must be 'auto' or a number of images"):
        load_config(None, ["distributed.chunk_size=big"])


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 categories x 540 classes x 4 images of 16 px: enough for a hard-sampled global batch of 4,096."""
    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder

    root = tmp_path_factory.mktemp("big")
    write_image_folder(root / "images", [[4] * 540] * 2, image_size=16, seed=0)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


@pytest.mark.slow
@pytest.mark.parametrize(("budget_mb", "chunked"), [(0, False), (16, True)])
def test_a_global_batch_of_4096_on_one_process_starts_with_nothing_chosen(
    big_shards: Path, tmp_path: Path, ddp_rank_log: pytest.LogCaptureFixture, budget_mb: int, chunked: bool
) -> None:
    from ddp_rank.train.trainer import Trainer

    overrides = [o for o in TINY_OVERRIDES if not o.startswith("data.global_batch_size")]
    cfg = load_config(None, [*overrides, f"data.shards={big_shards}", f"train.output_dir={tmp_path / 'run'}",
                             "data.global_batch_size=4096", "data.test_split=", "train.steps=1",
                             f"distributed.memory_budget_mb={budget_mb}"])  # fmt: skip
    ddp_rank_log.set_level(logging.INFO, logger="ddp_rank")
    trainer = Trainer(cfg)
    try:
        assert trainer.layout.chunked is chunked
        said = [r.getMessage() for r in ddp_rank_log.records if "chunk_size=auto" in r.getMessage()]
        assert (
            said and ("runs in chunks of" in said[0]) is chunked and ("direct step" in said[0]) is not chunked
        )
        if chunked:
            assert trainer.layout.chunk_size is not None and trainer.layout.chunk_size < 4096
        result = trainer.train_step()
        assert result.chunks == (-(-4096 // trainer.layout.chunk_size) if chunked else 1)
        assert torch.isfinite(torch.tensor(result.loss))
    finally:
        trainer.close()


def test_a_probe_that_runs_out_of_memory_keeps_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake device that holds 8 images: the probe stops at 16 with the growth of 1, 2, 4, 8; one that cannot
    hold the first two sizes has nothing to keep and raises (the trainer tells every rank)."""
    per_image, most = 1_000, [8]
    calls: list[int] = []

    def fake_step_bytes(model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype | None) -> int:
        calls.append(len(images))
        if len(images) > most[0]:
            raise torch.OutOfMemoryError(f"{len(images)} images do not fit (simulated)")
        return 5_000 + per_image * len(images)

    monkeypatch.setattr(chunk_choice, "SETTLED_SIZE", {"cpu": 64})  # so that only the error stops it
    monkeypatch.setattr(chunk_choice, "_step_bytes", fake_step_bytes)
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8), 16)
    probe = measure_activation_bytes(model, 16, torch.device("cpu"))
    assert probe.sizes == (1, 2, 4, 8) and probe.per_image == per_image and calls[-1] == 16
    assert probe.stopped == "out of memory at 16 images" and "out of memory at 16" in probe.how
    most[0] = 1
    with pytest.raises(torch.OutOfMemoryError):
        measure_activation_bytes(model, 16, torch.device("cpu"))

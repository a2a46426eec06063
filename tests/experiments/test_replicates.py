"""Replicates: runs that differ only in their seeds pooled into points (mean, std, min-max, count of the final
metric) in markdown, CSV and JSON; the difference of two points one setting apart with a 95% paired t interval
checked against a hand computation; one-seed points shown as such; crashed replicates counted, not pooled; the
plot; the t quantile against printed tables."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config, save_config
from ddp_rank.experiments.compare import compare_runs
from ddp_rank.experiments.intervals import paired_t_interval, t_quantile
from ddp_rank.experiments.runs import read_run
from ddp_rank.train.run_state import RunState

T_975_DF2 = 4.3027  # Student's t, 97.5% quantile, 2 degrees of freedom (any printed table)


def make_run(
    root: Path, sampler: str, seed: int, final: float, status: str = "finished", *extra: str
) -> Path:
    """A run as the trainer leaves it: an early evaluation ABOVE the final one (so pooling the best would show),
    then the final one; ``status`` in run.json."""
    run = root / f"data.sampler={sampler},train.seed={seed}"
    cfg = load_config(None, [f"data.sampler={sampler}", f"train.seed={seed}", f"train.output_dir={run}",
                             "train.steps=10", *extra])  # fmt: skip
    save_config(cfg, run / "config.yaml")
    records = [
        {"kind": "eval", "step": 5, "recall@1": final + 0.2, "map@r": final / 2 + 0.2},
        {"kind": "eval", "step": 10, "recall@1": final, "map@r": final / 2},
    ]
    if status == "crashed":
        records = records[:1]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    state = RunState(run)
    state.start()
    if status == "finished":
        state.finished(10)
    elif status == "crashed":
        state.crashed(RuntimeError("CUDA out of memory"), 6)
    return run


def sweep(root: Path, finals: dict[str, list[float]], crashed: dict[str, list[int]] | None = None) -> list:
    for sampler, values in finals.items():
        for seed, value in enumerate(values):
            status = "crashed" if seed in (crashed or {}).get(sampler, []) else "finished"
            make_run(root, sampler, seed, value, status)
    return [read_run(p) for p in sorted(root.iterdir())]


def test_points_pool_their_seeds_final_metric_mean_std_min_max_count(tmp_path: Path) -> None:
    runs = sweep(tmp_path, {"hard": [0.50, 0.52, 0.54], "random": [0.48, 0.51, 0.50]})
    table = compare_runs(runs)
    assert table.replicates is not None
    rows = {row["point"]: row for row in json.loads(table.json())["points"]}
    hard = rows["data.sampler=hard"]
    assert hard["runs"] == 3 and hard["finished"] == 3 and hard["recall@1 count"] == 3
    assert hard["recall@1 mean"] == pytest.approx(0.52)  # the final evaluations, not the best (0.72 ...)
    assert hard["recall@1 std"] == pytest.approx(0.02)  # sample std of 0.50, 0.52, 0.54
    assert (hard["recall@1 min"], hard["recall@1 max"]) == pytest.approx((0.50, 0.54))
    assert hard["map@r mean"] == pytest.approx(0.26)
    text = table.markdown()
    assert "| data.sampler=hard | 3 of 3 | 52.00 ± 2.00 (n=3) | 50.00-54.00 | 26.00 ± 1.00 (n=3) |" in text
    points_csv = list(csv.DictReader(io.StringIO(table.points_csv())))
    assert [r["point"] for r in points_csv] == ["data.sampler=hard", "data.sampler=random"]
    assert float(points_csv[1]["recall@1 mean"]) == pytest.approx((0.48 + 0.51 + 0.50) / 3)


def test_the_difference_interval_matches_a_hand_computation(tmp_path: Path) -> None:
    runs = sweep(tmp_path, {"hard": [0.50, 0.52, 0.54], "random": [0.48, 0.51, 0.50]})
    (diff,) = json.loads(compare_runs(runs).json())["differences"]
    # By hand: per-seed differences 0.02, 0.01, 0.04; mean 0.07/3; sample sd sqrt(42e-4 / 9 / 2).
    mean = 0.07 / 3
    sd = math.sqrt(((0.02 - mean) ** 2 + (0.01 - mean) ** 2 + (0.04 - mean) ** 2) / 2)
    half = T_975_DF2 * sd / math.sqrt(3)
    assert diff["first"] == "data.sampler=hard" and diff["second"] == "data.sampler=random"
    assert diff["setting"] == "data.sampler" and diff["seeds"] == 3
    assert diff["difference"] == pytest.approx(mean)
    assert (diff["low"], diff["high"]) == pytest.approx((mean - half, mean + half), abs=1e-5)
    assert diff["low"] < 0 < diff["high"] and diff["verdict"] == "within noise"
    assert (
        "| data.sampler=hard | data.sampler=random | data.sampler | +2.33 | [-1.46, +6.13] | 3 | within noise |"
        in (compare_runs(runs).markdown())
    )


def test_a_difference_larger_than_its_noise_is_called_so(tmp_path: Path) -> None:
    runs = sweep(tmp_path, {"hard": [0.50, 0.52, 0.54], "random": [0.47, 0.489, 0.511]})
    (diff,) = json.loads(compare_runs(runs).json())["differences"]
    # Differences 0.03, 0.031, 0.029: mean 0.03, sd 0.001, half-width 4.3027 * 0.001 / sqrt(3).
    assert (diff["low"], diff["high"]) == pytest.approx((0.03 - 0.0024842, 0.03 + 0.0024842), abs=1e-6)
    assert diff["verdict"] == "beyond noise: first higher"


def test_one_seed_points_show_no_spread_and_no_interval(tmp_path: Path) -> None:
    runs = sweep(tmp_path, {"hard": [0.50, 0.52], "random": [0.45]})
    table = compare_runs(runs)
    rows = {row["point"]: row for row in json.loads(table.json())["points"]}
    single = rows["data.sampler=random"]
    assert single["recall@1 count"] == 1 and single["recall@1 std"] is None
    assert single["recall@1 min"] == single["recall@1 max"] == pytest.approx(0.45)
    text = table.markdown()
    assert "| data.sampler=random | 1 of 1 | 45.00 (one seed) | - |" in text
    (diff,) = json.loads(table.json())["differences"]
    assert diff["low"] is None and diff["high"] is None and diff["seeds"] == 1
    assert diff["verdict"] == "no interval: 1 seed(s) finished in both"
    assert diff["difference"] == pytest.approx(0.51 - 0.45)  # the means, shown without an interval
    assert "| +6.00 | - | 1 | no interval" in text


def test_crashed_replicates_are_counted_and_left_out_of_the_pool_and_the_pairs(tmp_path: Path) -> None:
    runs = sweep(tmp_path, {"hard": [0.50, 0.52, 0.90], "random": [0.48, 0.51, 0.50]}, crashed={"hard": [2]})
    table = compare_runs(runs)
    rows = {row["point"]: row for row in json.loads(table.json())["points"]}
    hard = rows["data.sampler=hard"]
    assert hard["runs"] == 3 and hard["finished"] == 2 and hard["not finished"] == "1 crashed"
    assert hard["recall@1 mean"] == pytest.approx(0.51) and hard["recall@1 count"] == 2
    assert "| data.sampler=hard | 2 of 3 (1 crashed) | 51.00 ± 1.41 (n=2) |" in table.markdown()
    (diff,) = json.loads(table.json())["differences"]
    assert diff["seeds"] == 2  # seed 2 crashed in one of the two points: only seeds 0 and 1 pair
    assert diff["difference"] == pytest.approx(((0.50 - 0.48) + (0.52 - 0.51)) / 2)


def test_runs_without_seeds_that_differ_keep_the_table_of_runs_alone(tmp_path: Path) -> None:
    make_run(tmp_path, "hard", 0, 0.5)
    make_run(tmp_path, "random", 0, 0.4)
    table = compare_runs([read_run(p) for p in sorted(tmp_path.iterdir())])
    assert table.replicates is None and "Replicates" not in table.markdown()
    assert "points" not in json.loads(table.json())


def test_keys_that_follow_a_setting_go_with_it(tmp_path: Path) -> None:
    """``sweep --equal images``: train.steps follows the batch, so two batch sizes are one setting apart."""
    for batch, steps, finals in ((16, 8, [0.5, 0.6]), (32, 4, [0.4, 0.45])):
        for seed, final in enumerate(finals):
            run = make_run(tmp_path / f"b{batch}", "hard", seed, final, "finished",
                           f"data.global_batch_size={batch}", f"train.steps={steps}")  # fmt: skip
            assert run.is_dir()
    runs = [read_run(p) for p in sorted(tmp_path.glob("b*/*"))]
    (diff,) = json.loads(compare_runs(runs).json())["differences"]
    assert diff["setting"] == "data.global_batch_size (with train.steps)"
    assert (diff["first"], diff["second"]) == ("data.global_batch_size=16", "data.global_batch_size=32")
    assert diff["difference"] == pytest.approx(0.125)


def test_the_command_prints_points_csv_and_draws_error_bars(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    sweep(tmp_path / "s", {"hard": [0.50, 0.52, 0.54], "random": [0.48]})
    png = tmp_path / "compare.png"
    assert main(["compare", str(tmp_path / "s"), "--csv", "--points", "--plot", str(png)]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["point"], r["finished"]) for r in rows] == [
        ("data.sampler=hard", "3"),
        ("data.sampler=random", "1"),
    ]
    assert png.is_file() and png.stat().st_size > 0
    assert main(["compare", str(tmp_path / "s"), "--points"]) == 2
    assert "--points goes with --csv" in capsys.readouterr().err


def test_the_t_quantile_matches_printed_tables() -> None:
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 9: 2.2622, 30: 2.0423, 120: 1.9799}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=1e-4), df
    assert t_quantile(0.95, 5) == pytest.approx(2.0150, abs=1e-4)
    assert paired_t_interval([0.1]) is None
    assert 4.3027 > t_quantile(0.975, 2.5) > 3.1824, "fractional degrees of freedom (Welch-Satterthwaite)"
    with pytest.raises(ValueError, match="df > 0"):
        t_quantile(0.975, 0)


def test_a_count_as_the_headline_metric_is_shown_as_a_count(tmp_path: Path) -> None:
    """``compare --metric gallery_size`` over replicates: a number of images, not a rate in percent."""
    for sampler, sizes in {"hard": (400, 400), "random": (380, 420)}.items():
        for seed, size in enumerate(sizes):
            run = make_run(tmp_path, sampler, seed, 0.5)
            records = [{"kind": "eval", "step": 10, "recall@1": 0.5, "gallery_size": size}]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = compare_runs([read_run(p) for p in sorted(tmp_path.iterdir())], metric="gallery_size")
    assert table.replicates is not None
    text = table.markdown()
    assert "| data.sampler=hard | 2 of 2 | 400 ± 0 (n=2) | 400-400 |" in text, text
    assert "| data.sampler=random | 2 of 2 | 400 ± 28.3 (n=2) | 380-420 |" in text, text
    assert "40000.00" not in text

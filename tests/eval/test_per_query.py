"""``ddp-rank eval --per-query``: each query's values, whose means are the reported metrics, named by class and
sample key in one order for every run on a split, in the file ``ddp_rank.experiments.query_pairs`` reads; refused
where a protocol has no per-query retrieval values; the same file from two processes as from one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.eval.per_query import PerQuery, per_query_refusal, write_per_query
from ddp_rank.eval.protocols import PROTOCOLS, EmbeddedSet, EvalError, evaluate
from ddp_rank.eval.runner import read_eval_batches
from ddp_rank.eval.settings import evaluation_settings
from ddp_rank.experiments.query_pairs import compare_points, load_query_values
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


def embedded(subsets: Sequence[str | None] | None = None) -> EmbeddedSet:
    """24 samples of 6 classes (4 each) and one lone sample of class 99, keyed ``s<i>``."""
    gen = torch.Generator().manual_seed(0)
    labels = [i // 4 for i in range(24)] + [99]
    e = torch.nn.functional.normalize(torch.randn(25, 8, generator=gen), dim=1)
    return EmbeddedSet.from_lists(e, labels, subsets or [None] * 25, [f"s{i}" for i in range(25)])


def test_sop_values_are_the_metrics_query_by_query() -> None:
    data = embedded()
    out = evaluate("sop", data, [1, 3], backend="torch", per_query=True)
    table: PerQuery = out["per_query"]
    assert set(table.values) == {"recall@1", "recall@3", "map@r"}
    for name, values in table.values.items():
        assert values.dtype == np.float64 and values.mean() == pytest.approx(out[name], abs=1e-12)
    # Every image queries the rest; the lone one (class 99) is left out, as the metrics leave it out.
    assert table.num_queries == out["num_queries"] == 24 and out["num_lone_queries"] == 1
    np.testing.assert_array_equal(table.keys, [f"s{i}" for i in range(24)])
    np.testing.assert_array_equal(table.labels, np.arange(24) // 4)
    assert "per_query" not in evaluate("sop", data, [1], backend="torch")
    without_map = evaluate("sop", data, [1], backend="torch", map_at_r=False, per_query=True)["per_query"]
    assert set(without_map.values) == {"recall@1"}


def test_inshop_names_its_queries_not_its_gallery() -> None:
    subsets = ["query" if i % 2 else "gallery" for i in range(24)] + ["query"]
    out = evaluate("inshop", embedded(subsets), [1, 2], backend="torch", per_query=True)
    table = out["per_query"]
    odd = np.arange(1, 24, 2)  # the query rows; s24 queries a gallery without its class: left out
    np.testing.assert_array_equal(table.keys, [f"s{i}" for i in odd])
    np.testing.assert_array_equal(table.labels, odd // 4)
    for name, values in table.values.items():
        assert values.mean() == pytest.approx(out[name], abs=1e-12)


def test_protocols_without_query_values_are_refused_by_name() -> None:
    data = embedded()
    for protocol in PROTOCOLS:
        refusal = per_query_refusal(protocol)
        if protocol in ("sop", "inshop"):
            assert refusal is None
            continue
        assert (
            refusal is not None
            and f"eval.protocol={protocol}" in refusal
            and "leave out --per-query" in refusal
        )
        with pytest.raises(EvalError, match=f"eval.protocol={protocol}"):
            evaluate(protocol, data, per_query=True)
    keyless = EmbeddedSet(data.embeddings, data.labels, data.subset_bits)
    with pytest.raises(EvalError, match="carries none"):
        evaluate("sop", keyless, per_query=True)


def test_the_file_is_what_the_study_reads(tmp_path: Path) -> None:
    table = evaluate("sop", embedded(), [1, 3], backend="torch", per_query=True)["per_query"]
    path = write_per_query(table, tmp_path / "runs" / "queries")  # the name as given: no .npz added
    assert path == tmp_path / "runs" / "queries" and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["queries"]  # no temporary file left beside it
    with np.load(path, allow_pickle=False) as raw:
        assert sorted(raw.files) == ["key", "label", "map@r", "recall@1", "recall@3"]
        assert raw["label"].dtype == np.int64 and raw["key"].dtype.kind == "U"
    loaded = load_query_values(path)
    assert set(loaded.values) == set(table.values)
    np.testing.assert_array_equal(loaded.labels, table.labels)
    np.testing.assert_array_equal(loaded.keys, table.keys)
    with pytest.raises(ValueError, match="other lengths"):
        PerQuery({"recall@1": np.zeros(3)}, np.zeros(2, dtype=np.int64), np.array(["a", "b"]))


def split_samples(shards: Path, split: str) -> dict[str, int]:
    """``{key: class}`` of a split, read as the evaluation reads it."""
    settings = evaluation_settings(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}"]))
    return {k: int(y) for b in read_eval_batches(settings, split, 0, 0, 1) for k, y in zip(b.keys, b.labels)}


@pytest.mark.slow
def test_eval_per_query_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddp_rank.train.trainer import run_training

    shards = build_tiny_shards(tmp_path)
    common = [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path}"]
    run = tmp_path / "run"
    run_training(load_config(None, [*common, f"train.output_dir={run}", "train.steps=2"]))
    results = tmp_path / "eval.json"
    files = {"raw pixels": tmp_path / "raw.npz", "untrained": tmp_path / "untrained.npz",
             "trained": tmp_path / "trained.npz"}  # fmt: skip
    ways = {"raw pixels": ["--baseline", "raw-pixels"], "untrained": ["--baseline", "untrained", "--split", "test"],
            "trained": ["--checkpoint", str(run)]}  # fmt: skip
    for name, way in ways.items():
        argv = [
            "eval",
            *way,
            "--name",
            name,
            "--output",
            str(results),
            "--per-query",
            str(files[name]),
            *common,
        ]
        assert main(argv) == 0
        assert f"per-query values: {files[name]}" in capsys.readouterr().out
    recorded = json.loads(results.read_text())
    samples = split_samples(shards, "test")
    loaded = {name: load_query_values(path) for name, path in files.items()}
    for name, values in loaded.items():
        metrics = recorded[name]["metrics"]
        assert set(values.values) == {"recall@1", "recall@2", "map@r"}  # eval.ks of the tiny config, MAP@R
        for metric, per_query in values.values.items():
            assert per_query.mean() == pytest.approx(metrics[metric], abs=1e-12), (name, metric)
        assert len(values.labels) == metrics["num_queries"] == len(samples) - metrics["num_lone_queries"]
        assert values.keys is not None and set(values.keys) <= set(samples)
        assert values.labels.tolist() == [samples[k] for k in values.keys]
        # One split, one order: query i is the same image whatever was evaluated.
        np.testing.assert_array_equal(values.keys, loaded["raw pixels"].keys)
    difference = compare_points([loaded["trained"]], [loaded["untrained"]], "recall@1")
    assert difference.mean == pytest.approx(
        recorded["trained"]["metrics"]["recall@1"] - recorded["untrained"]["metrics"]["recall@1"], abs=1e-12
    )


@pytest.mark.slow
def test_refused_before_embedding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = build_tiny_shards(tmp_path)
    out, written = tmp_path / "eval.json", tmp_path / "q.npz"
    base = [
        "eval",
        "--baseline",
        "raw-pixels",
        *TINY_OVERRIDES,
        f"data.shards={shards}",
        "--output",
        str(out),
    ]
    for protocol in ("verification", "identification", "vehicleid"):
        assert main([*base, f"eval.protocol={protocol}", "--per-query", str(written)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("ddp-rank eval: error: --per-query") and f"eval.protocol={protocol}" in err
        assert "\n" not in err
    assert main([*base, "--per-query", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not out.exists() and not written.exists()  # nothing was evaluated


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_write_the_file_of_one(tmp_path: Path) -> None:
    """The values are scored on the gathered split: two ranks' file holds every query, in the same order."""
    from tests.helpers.training import launch

    shards = build_tiny_shards(tmp_path)
    common = ["--baseline", "raw-pixels", *TINY_OVERRIDES, f"data.shards={shards}"]
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    assert main(["eval", *common, "--output", str(tmp_path / "one.json"), "--per-query", str(one)]) == 0
    result = launch("eval", *common, "--output", str(tmp_path / "two.json"), "--per-query", str(two))
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(one, allow_pickle=False) as a, np.load(two, allow_pickle=False) as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        assert (
            len(a["key"])
            == len(split_samples(shards, "test"))
            - json.loads((tmp_path / "one.json").read_text())["raw pixels"]["metrics"]["num_lone_queries"]
        )

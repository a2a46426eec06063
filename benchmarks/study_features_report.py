"""The word study's record -> its intervals, table, conclusions and plot (``benchmarks/study_features.py``).

The per-query values of every final run's test evaluation are gathered into one compressed file beside the record
(``save_queries``), so that ``add_intervals`` can compute the intervals again from the record and that file alone;
everything else here reads the record only.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from ddp_rank.experiments.intervals import CONFIDENCE
from ddp_rank.experiments.query_pairs import QueryValues, compare_points, load_query_values, point_interval

COMPARED = ("recall@1", "map@r")
NAMES = {"recall@1": "R@1", "recall@10": "R@10", "map@r": "MAP@R"}


def _key(point: dict[str, Any], seed: int, metric: str) -> str:
    return f"batch={point['batch']},seed={seed},{metric}"


def save_queries(record: dict[str, Any], out: Path, path: Path) -> None:
    """Every final run's per-query test values (float32; the queries' classes and keys once, checked the same for
    every run) into ``path`` (compressed numpy)."""
    arrays: dict[str, np.ndarray] = {}
    for point in record["points"]:
        for run in point["runs"]:
            values = load_query_values(out / run["queries"])
            if "label" not in arrays:
                arrays["label"] = values.labels
                if values.keys is not None:
                    arrays["key"] = values.keys
            elif not np.array_equal(arrays["label"], values.labels) or (
                "key" in arrays and (values.keys is None or not np.array_equal(arrays["key"], values.keys))
            ):
                raise SystemExit(
                    f"{run['queries']}: other test queries than the first run's, or in another order"
                )
            for metric, v in values.values.items():
                arrays[_key(point, run["seed"], metric)] = v.astype(np.float32)
    np.savez_compressed(path, **arrays)


def _point_runs(data: dict[str, np.ndarray], point: dict[str, Any]) -> list[QueryValues]:
    runs = []
    for run in point["runs"]:
        prefix = _key(point, run["seed"], "")
        values = {k[len(prefix) :]: v.astype(np.float64) for k, v in data.items() if k.startswith(prefix)}
        runs.append(QueryValues(values, data["label"], data.get("key")))
    return runs


def _pairs(record: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The differences the study reports: each batch against the one below it, each batch against the best one."""
    batch = sorted(record["points"], key=lambda p: p["batch"])
    best = next(p for p in batch if p["batch"] == record["best_batch"])
    pairs = list(zip(batch[1:], batch[:-1], strict=False))
    paired = [{x["batch"], y["batch"]} for x, y in pairs]
    pairs += [(p, best) for p in batch if p is not best and {p["batch"], best["batch"]} not in paired]
    return pairs


def add_intervals(record: dict[str, Any], queries: Path) -> None:
    """Each point's own interval and every reported difference's (in points), from the per-query file: the 95%
    intervals, and the Bonferroni verdict over the differences of each metric (``record['multiplicity']``)."""
    if not queries.is_file():
        raise SystemExit(
            f"{queries}: no per-query file beside the record, so its intervals cannot be computed"
        )
    with np.load(queries, allow_pickle=False) as npz:
        data = {name: npz[name] for name in npz.files}
    runs = {p["batch"]: _point_runs(data, p) for p in record["points"]}
    for point in record["points"]:
        point["interval"] = {}
        for metric in COMPARED:
            own = point_interval(runs[point["batch"]], metric)
            point["interval"][metric] = None if own is None else [100 * own.low, 100 * own.high, own.df]
    pairs = _pairs(record)
    family = 1 - (1 - CONFIDENCE) / max(1, len(pairs))
    rows = []
    for a, b in pairs:
        row: dict[str, Any] = {"a": a["batch"], "b": b["batch"]}
        for metric in COMPARED:
            d = compare_points(runs[a["batch"]], runs[b["batch"]], metric)
            combined, wide = d.combined, d.interval(family)
            row[metric] = {
                "mean": 100 * d.mean,
                "classes": [100 * d.queries.low, 100 * d.queries.high],
                "seeds": None if d.seeds is None else [100 * d.seeds.low, 100 * d.seeds.high],
                "combined": None
                if combined is None
                else [100 * combined.low, 100 * combined.high, combined.df],
                "verdict": d.verdict,
                "bonferroni": None if wide is None else _verdict(wide.low, wide.high),
            }
        rows.append(row)
    record["differences"] = rows
    record["multiplicity"] = {"differences": len(pairs), "per_metric_confidence": family}


def _verdict(low: float, high: float) -> str:
    return "within noise" if low <= 0 <= high else ("higher" if low > 0 else "lower")


def _cell(values: list[float]) -> str:
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.2f}"
    return f"{statistics.fmean(pct):.2f} ± {statistics.stdev(pct):.2f}"


def _interval(bounds: list[float] | None) -> str:
    return "-" if bounds is None else f"[{bounds[0]:+.2f}, {bounds[1]:+.2f}]"


def _test(point: dict[str, Any], metric: str) -> str:
    mean = statistics.fmean(100 * r["test"][metric] for r in point["runs"])
    bounds = point.get("interval", {}).get(metric)
    return f"{mean:.2f}" + ("" if bounds is None else f" [{bounds[0]:.2f}, {bounds[1]:.2f}]")


def markdown(record: dict[str, Any]) -> str:
    rule, splits = record["rule"], record["splits"]
    wall = record["wall_seconds"]
    largest = max(p["batch"] for p in record["points"])
    lines = [
        f"# The word study: the global batch at one length from a probe, every choice on validation words, {record['date']}",
        "",
        f"<!-- summary: {summary(record)} -->",
        "",
        f"{record['machine']}, {record['jobs']} runs at a time; {wall // 60} min {wall % 60} s for the whole study, "
        f"the length probe included (the feature shards built beforehand); {record['runs_trained']} runs trained. "
        f"Training: {splits['train']['classes']:,} words ({splits['train']['images']:,} images: the largest batch, "
        f"{largest:,}, is {largest / splits['train']['images']:.0%} of them); validation: "
        f"{splits['val']['classes']:,} words carved from the training words (`shards build --val-fraction "
        f"{record['validation']['val_fraction']}`, seed {record['validation']['split_seed']}); test: "
        f"{splits['test']['classes']:,} held-out words ({splits['test']['images']:,} images, each querying all the "
        "others).",
        "",
        "## The length probe",
        "",
        f"Seeds 0 to {rule['probe_seeds'] - 1} of batches {', '.join(f'{b:,}' for b in rule['probe_batches'])}, at "
        f"{rule['probe_factor']:g} x {rule['lr0']:g} x sqrt(B / 1024), from {rule['probe_epochs']:g} epochs, "
        "doubling until validation R@1 at the end gains less than the larger of the seeds' spread (at the longer "
        f"length) and {rule['min_gain']:g} points. Every run: a linear warm-up over {rule['warmup']:.0%} of its "
        "steps, then a cosine decay to zero.",
        "",
        "| batch | rate | epochs | validation R@1 (seeds) | doubled | validation R@1 (seeds) | gain | spread | "
        "threshold | stopped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["probe"]:
        lines.append(
            f"| {row['batch']:,} | {row['lr']:.3g} | {row['epochs']:g} | {', '.join(f'{v:.2f}' for v in row['val'])} "
            f"| {row['next']:g} | {', '.join(f'{v:.2f}' for v in row['val_next'])} | {row['gain']:+.2f} | "
            f"{row['spread']:.2f} | {row['threshold']:.2f} | {'yes' if row['stopped'] else 'no'} |"
        )
    lines += [
        "",
        f"**Every final run trains {rule['epochs']:g} epochs.**",
        "",
        "## The batches",
        "",
        f"Each batch's rate is swept at that length (seed 0; candidates a factor {rule['rate_step']:g} apart around "
        "the probe's rate, the grid grown past a winning end until the winner is interior, at most "
        f"{rule['max_rates']}); the chosen rate trains {rule['seeds']} seeds (seed 0 is the sweep's run). The best "
        f"batch ({record['best_batch']:,}) has the highest mean validation R@1. The test split is evaluated once, on "
        "each final run's last checkpoint.",
        "",
        "| batch | rates tried (validation R@1 at the end) | chosen | steps (epochs) | validation R@1 | test R@1 "
        "[95%] | test R@10 | test MAP@R [95%] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(record["points"], key=lambda p: p["batch"]):
        sweep = ", ".join(f"{lr}: {v:.2f}" for lr, v in p["sweep"].items())
        lines.append(
            f"| {p['batch']:,} | {sweep} | {p['lr']:.3g}{' (edge)' if p['at_edge'] else ''} | {p['steps']:,} "
            f"({p['epochs']:g}) | {_cell([r['val']['recall@1'] for r in p['runs']])} | {_test(p, 'recall@1')} | "
            f"{_cell([r['test']['recall@10'] for r in p['runs']])} | {_test(p, 'map@r')} |"
        )
    m = record.get("multiplicity", {})
    lines += [
        "",
        "Figures in %; validation: mean ± std over the seeds; test: the mean over the seeds and its 95% interval "
        "(the seeds' and the test classes' noise combined, Welch-Satterthwaite). (edge): the chosen rate is the "
        f"smallest or largest tried. The record is `study-features-{record['date']}.json` and the test queries' "
        f"values `study-features-{record['date']}-queries.npz`: `python -m benchmarks.study_features --from-record "
        "RECORD` computes the intervals, this table and the plot again.",
        "",
        "Differences on the test words (points, first minus second): the mean over the seeds; a 95% paired bootstrap "
        "over the test classes (the same draw of classes for both points and every seed: the test set's noise); a "
        "95% paired t interval over the seeds (the training's noise); and the two combined (their variances summed, "
        "the t quantile at the Welch-Satterthwaite degrees of freedom, shown as df; slightly conservative: the "
        "seeds' interaction with the test classes enters both variances). "
        f"{m.get('differences', 0)} differences are reported per metric: each verdict is at 95% on its own, so about "
        f"{0.05 * m.get('differences', 0):.1f} of them may be called by chance; the Bonferroni column holds each "
        f"metric's family at 95% ({m.get('per_metric_confidence', 0):.2%} each; the two metrics together, at up to "
        "10%). Where the optimum lies is read from the Bonferroni column.",
        "",
        "| difference | R@1 | over classes | over seeds | combined (df) | verdict | Bonferroni | MAP@R | over classes | "
        "over seeds | combined (df) | verdict | Bonferroni |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record.get("differences", []):
        cells = []
        for metric in COMPARED:
            d = row[metric]
            combined = d["combined"]
            both = "-" if combined is None else f"{_interval(combined[:2])} ({combined[2]:.1f})"
            cells += [
                f"{d['mean']:+.2f}",
                _interval(d["classes"]),
                _interval(d["seeds"]),
                both,
                d["verdict"],
                d["bonferroni"] or "-",
            ]
        lines.append(f"| {row['a']:,} - {row['b']:,} | " + " | ".join(cells) + " |")
    lines += ["", "## Conclusions (written from the record)", ""]
    lines += [f"- {line}" for line in conclusions(record)]
    return "\n".join(lines) + "\n"


_FLIPPED = {"lower": "higher", "higher": "lower", "within noise": "within noise", None: None}


def difference(record: dict[str, Any], a: int, b: int, metric: str = "recall@1") -> dict[str, Any]:
    """The reported difference ``a - b`` of ``metric`` (its mean, verdict and Bonferroni verdict), whichever way
    round the record holds it."""
    for row in record["differences"]:
        if (row["a"], row["b"]) == (a, b):
            return row[metric]
        if (row["a"], row["b"]) == (b, a):
            d = row[metric]
            return {
                **d,
                "mean": -d["mean"],
                "verdict": _FLIPPED[d["verdict"]],
                "bonferroni": _FLIPPED[d["bonferroni"]],
            }
    raise KeyError(f"no difference {a} - {b} in the record")


def _test_means(record: dict[str, Any]) -> dict[int, float]:
    return {
        p["batch"]: statistics.fmean(100 * r["test"]["recall@1"] for r in p["runs"]) for p in record["points"]
    }


def optimum(record: dict[str, Any]) -> str:
    """Where the optimum lies on test R@1, from the reported steps between neighbouring batches and their
    Bonferroni verdicts (the family of differences at 95%): from the batch of the highest test mean, the region
    grows to a neighbour until the step to it falls beyond noise (up on the left, down on the right). Bounded on
    both sides, the optimum lies between the two batches outside it; where the region reaches an end of the range,
    it cannot be located on that side."""
    means = _test_means(record)
    batches = sorted(means)
    top = max(batches, key=lambda b: means[b])
    i = j = batches.index(top)
    while i > 0 and difference(record, batches[i], batches[i - 1])["bonferroni"] != "higher":
        i -= 1
    while j < len(batches) - 1 and difference(record, batches[j + 1], batches[j])["bonferroni"] != "lower":
        j += 1
    region = f"{batches[i]:,}" if i == j else f"{batches[i]:,} to {batches[j]:,}"
    if i > 0 and j < len(batches) - 1:
        return (
            f"the optimum lies between {batches[i - 1]:,} and {batches[j + 1]:,} exclusive (test R@1 is highest at "
            f"{top:,}; {region} cannot be told apart step by step)"
        )
    ends = [e for e, at_end in (("smallest", i == 0), ("largest", j == len(batches) - 1)) if at_end]
    return (
        f"the optimum cannot be located: the batches that cannot be told apart from the highest test R@1 ({top:,}) "
        f"step by step, {region}, reach the {' and the '.join(ends)} batch of the range"
    )


def summary(record: dict[str, Any]) -> str:
    means = _test_means(record)
    batches = sorted(means)
    chosen, top = record["best_batch"], max(batches, key=lambda b: means[b])
    shown = sorted({batches[0], chosen, top, batches[-1]})
    tags = {chosen: "chosen on validation", top: "highest"}
    figures = ", ".join(
        f"{means[b]:.1f} at {b:,}"
        + (f" ({', '.join(t for k, t in tags.items() if k == b)})" if b in tags else "")
        for b in shown
    )
    return (
        f"The word study at one equal length ({record['rule']['epochs']:g} epochs, from its length probe), every "
        f"choice on validation words: test R@1 {figures}; by the family-wise verdicts, {optimum(record)}."
    )


def conclusions(record: dict[str, Any]) -> list[str]:
    """What the record supports, each claim only where its combined interval excludes zero, in sentences."""
    points = sorted(record["points"], key=lambda p: p["batch"])
    best = next(p for p in points if p["batch"] == record["best_batch"])
    rule = record["rule"]
    probe = record["probe"]
    unstopped = sorted({r["batch"] for r in probe} - {r["batch"] for r in probe if r["stopped"]})
    out = [
        f"Length: every run trains {rule['epochs']:g} epochs, the longest any probed batch needed before a doubling "
        f"gained less than its threshold"
        + (
            f"; {'batches' if len(unstopped) > 1 else 'batch'} {', '.join(f'{b:,}' for b in unstopped)} still "
            "gained at the probe's longest run, so the length is the probe's cap, not one at which every curve has "
            "stopped rising"
            if unstopped
            else ""
        )
        + ".",
        f"Chosen on the validation words: batch {best['batch']:,} (validation R@1 "
        f"{_cell([r['val']['recall@1'] for r in best['runs']])}); on the test words it has R@1 {_test(best, 'recall@1')}.",
    ]
    sides: dict[str, list[str]] = {"lower": [], "within noise": [], "higher": []}
    for p in points:
        if p is not best:
            d = difference(record, p["batch"], best["batch"])
            sides[d["verdict"]].append(f"{p['batch']:,} ({d['mean']:+.2f}; Bonferroni: {d['bonferroni']})")
    for verdict, text in (
        ("lower", "Beyond noise below the chosen batch"),
        ("within noise", "Within noise of the chosen batch"),
        ("higher", "Beyond noise ABOVE the chosen batch (validation and test disagree)"),
    ):
        if sides[verdict]:
            out.append(f"{text} on test R@1 (points): {', '.join(sides[verdict])}.")
    steps = [(a["batch"], b["batch"]) for a, b in zip(points[1:], points[:-1], strict=False)]
    moves = [
        f"{a:,} - {b:,}: {d['mean']:+.2f} ({d['verdict']}; Bonferroni: {d['bonferroni']})"
        for (a, b), d in ((step, difference(record, *step)) for step in steps)
    ]
    out.append("Each step up the batch axis, test R@1 points: " + "; ".join(moves) + ".")
    out.append(
        f"On test R@1, with the Bonferroni verdicts (the family of differences at 95%), {optimum(record)}."
    )
    edges = [f"{p['batch']:,}" for p in points if p["at_edge"]]
    if edges:
        out.append(f"The chosen rate is still at an end of the grown grid for batches {', '.join(edges)}.")
    else:
        out.append("The chosen rate is interior to its grid at every batch.")
    return out


def plots(record: dict[str, Any], out: Path) -> list[Path]:
    """Test R@1 and MAP@R against the batch with their 95% intervals (each seed a dot), the length probe, and each
    batch's validation curve (seed 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(record["points"], key=lambda p: p["batch"])
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.4))
    xs = [p["batch"] for p in points]
    # One axis each: the two metrics differ by some 30 points, which would flatten both curves on one.
    right_axis = left.twinx()
    for axis, metric, marker, color in ((left, "recall@1", "o-", "C0"), (right_axis, "map@r", "s--", "C1")):
        means = [statistics.fmean(100 * r["test"][metric] for r in p["runs"]) for p in points]
        bounds = [p.get("interval", {}).get(metric) for p in points]
        errors = [
            [m - b[0] if b else 0 for m, b in zip(means, bounds, strict=True)],
            [b[1] - m if b else 0 for m, b in zip(means, bounds, strict=True)],
        ]
        axis.errorbar(
            xs, means, yerr=errors, fmt=marker, color=color, capsize=3, label=f"test {NAMES[metric]} (95%)"
        )
        for p in points:
            axis.scatter(
                [p["batch"]] * len(p["runs"]),
                [100 * r["test"][metric] for r in p["runs"]],
                s=8,
                color="gray",
                zorder=3,
            )
        axis.set_ylabel(f"test {NAMES[metric]} (%)", color=color)
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [f"{x:,}" for x in xs])
    left.set_xlabel("global batch (rate chosen per batch on validation)")
    left.grid(alpha=0.3)
    handles = [h for axis in (left, right_axis) for h in axis.get_legend_handles_labels()[0]]
    left.legend(handles, [h.get_label() for h in handles], fontsize=8)
    for batch in sorted({r["batch"] for r in record["probe"]}):
        rows = [r for r in record["probe"] if r["batch"] == batch]
        lengths = [rows[0]["epochs"], *[r["next"] for r in rows]]
        values = [rows[0]["val"], *[r["val_next"] for r in rows]]
        line = middle.plot(lengths, [statistics.fmean(v) for v in values], "o-", label=f"{batch:,}")[0]
        for e, v in zip(lengths, values, strict=True):
            middle.scatter([e] * len(v), v, s=8, color=line.get_color(), alpha=0.5)
    middle.axvline(record["rule"]["epochs"], color="gray", ls=":", label="chosen length")
    middle.set_xscale("log", base=2)
    middle.set_xlabel("epochs (the length probe; each length its own schedule)")
    middle.set_ylabel("validation R@1 at the end (%)")
    middle.grid(alpha=0.3)
    middle.legend(title="batch", fontsize=7)
    train_images = record["splits"]["train"]["images"]
    for p in points:
        steps, r1 = zip(*p["runs"][0]["val_curve"], strict=True)
        right.plot(
            [s * p["batch"] / train_images for s in steps],
            [100 * v for v in r1],
            "o-",
            ms=3,
            label=f"{p['batch']:,}",
        )
    right.set_xlabel("epochs (warm-up, then cosine decay to zero)")
    right.set_ylabel("validation R@1 (%), seed 0")
    right.grid(alpha=0.3)
    right.legend(title="batch", fontsize=7)
    fig.tight_layout()
    path = out / "study-features-batch.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

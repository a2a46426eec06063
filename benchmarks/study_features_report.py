"""The word study's record -> its differences, table, conclusions and plot (``benchmarks/study_features.py``).

Everything here reads the record (``study.json``) only, except ``differences``, which reads the per-query files
of the test evaluations once, when the study ends, and stores its intervals in the record: ``--from-record``
then rewrites the table, the conclusions and the plot from the record alone.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ddp_rank.experiments.query_pairs import compare_points, load_query_values

COMPARED = ("recall@1", "map@r")
NAMES = {"recall@1": "R@1", "recall@10": "R@10", "map@r": "MAP@R"}


def _label(point: dict[str, Any]) -> str:
    return f"batch {point['batch']:,}" if point["axis"] == "batch" else point["name"]


def _pairs(record: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The differences the study reports: each batch against the one below it, each batch against the best one
    (chosen on validation), each sampler or loss against FastAP random at the best batch."""
    batch = sorted((p for p in record["points"] if p["axis"] == "batch"), key=lambda p: p["batch"])
    best = next(p for p in batch if p["batch"] == record["best_batch"])
    pairs = list(zip(batch[1:], batch[:-1], strict=False))
    pairs += [(p, best) for p in batch if p is not best and not any(x is p and y is best for x, y in pairs)]
    pairs += [(p, best) for p in record["points"] if p["axis"] != "batch"]
    return pairs


def differences(record: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Every reported difference, both intervals of each compared metric (in points), and its verdict."""
    rows = []
    for a, b in _pairs(record):
        runs_a = [load_query_values(out / r["queries"]) for r in a["runs"]]
        runs_b = [load_query_values(out / r["queries"]) for r in b["runs"]]
        row: dict[str, Any] = {"a": _label(a), "b": _label(b)}
        for metric in COMPARED:
            d = compare_points(runs_a, runs_b, metric)
            row[metric] = {
                "mean": 100 * d.mean,
                "classes": [100 * d.queries.low, 100 * d.queries.high],
                "seeds": None if d.seeds is None else [100 * d.seeds.low, 100 * d.seeds.high],
                "combined": None if d.combined is None else [100 * d.combined.low, 100 * d.combined.high],
                "verdict": d.verdict,
            }
        rows.append(row)
    return rows


def _cell(values: list[float]) -> str:
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.2f}"
    return f"{statistics.fmean(pct):.2f} ± {statistics.stdev(pct):.2f}"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def _interval(bounds: list[float] | None) -> str:
    return "-" if bounds is None else f"[{bounds[0]:+.2f}, {bounds[1]:+.2f}]"


def markdown(record: dict[str, Any]) -> str:
    rule, splits = record["rule"], record["splits"]
    factors = ", ".join(f"{f:.3g}" for f in rule["rate_factors"])
    wall = record["wall_seconds"]
    lines = [
        f"# The word study: the global batch, chosen on validation words, {record['date']}",
        "",
        f"{record['machine']}, {record['jobs']} runs at a time; {wall // 60} min {wall % 60} s for the whole study "
        "(the feature shards built beforehand). "
        f"Training: {splits['train']['classes']:,} words ({splits['train']['images']:,} images); validation: "
        f"{splits['val']['classes']:,} words carved from the training words (`shards build --val-fraction "
        f"{record['validation']['val_fraction']}`, seed {record['validation']['split_seed']}); test: "
        f"{splits['test']['classes']:,} held-out words ({splits['test']['images']:,} images, each querying all the "
        "others).",
        "",
        f"Rule: every final run trains {rule['epochs']:g} epochs, a linear warm-up over {rule['warmup']:.0%} of its "
        f"steps, then a cosine decay to zero; validation is evaluated {rule['evals']} times along it. Each batch B "
        f"tries the same {len(rule['rate_factors'])} rates, {factors} x {rule['lr0']:g} x sqrt(B / 1024), each for "
        f"{rule['sweep_epochs']:g} epoch(s) on the same schedule shape (shorter than the final runs); the best "
        f"validation R@1 at its end wins. {rule['seeds']} seeds a point. The best batch ({record['best_batch']:,}) "
        "is the one of the highest mean validation R@1"
        + (
            "; the sampler and loss points run there, each with its own rate sweep over that batch's candidates"
            if any(p["axis"] != "batch" for p in record["points"])
            else ""
        )
        + ". The test split is evaluated once, on each final run's last checkpoint."
        + (f" Time: {record['wall_note']}" if record.get("wall_note") else ""),
        "",
        "| axis | point | batch | rates tried (validation R@1 at the end) | chosen | steps (epochs) | validation "
        "R@1 | gain over the last quarter | test R@1 | test R@10 | test MAP@R |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in record["points"]:
        sweep = ", ".join(f"{lr}: {100 * v:.1f}" for lr, v in p["sweep"].items())
        gains = [r["val_gain"] for r in p["runs"] if r["val_gain"] is not None]
        gain = f"{_mean(gains):+.2f}" if gains else "-"
        test = {m: [r["test"][m] for r in p["runs"]] for m in NAMES}
        lines.append(
            f"| {p['axis']} | {p['name']} | {p['batch']:,} | {sweep} | {p['lr']:.3g}"
            f"{' (edge)' if p['at_edge'] else ''} | {p['steps']:,} ({p['epochs']:g}) | "
            f"{_cell([r['val']['recall@1'] for r in p['runs']])} | {gain} | {_cell(test['recall@1'])} | "
            f"{_cell(test['recall@10'])} | {_cell(test['map@r'])} |"
        )
    lines += [
        "",
        "Figures in %, mean ± std over the seeds. (edge): the chosen rate is the smallest or largest tried. The "
        f"record is `study-features-{record['date']}.json` beside this table: `python -m benchmarks.study_features "
        "--from-record RECORD` writes this table, its conclusions and the plot again.",
        "",
        "Differences on the test words (points, first minus second): the mean over the seeds; a 95% paired "
        "bootstrap over the test classes (the same draw of classes, each with all its queries, for both points "
        "and every seed, on the seed-averaged per-query difference: the test set's noise); a 95% paired t "
        "interval over the seeds (the training's noise); and the two combined (their half-widths added in "
        "quadrature, `ddp_rank.experiments.query_pairs`). Beyond noise only where the combined interval excludes "
        "zero.",
        "",
        "| difference | R@1 | over classes | over seeds | combined | | MAP@R | over classes | over seeds | combined "
        "| |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record.get("differences", []):
        cells = []
        for metric in COMPARED:
            d = row[metric]
            cells += [f"{d['mean']:+.2f}", _interval(d["classes"]), _interval(d["seeds"]),
                      _interval(d.get("combined")), d["verdict"]]  # fmt: skip
        lines.append(f"| {row['a']} - {row['b']} | " + " | ".join(cells) + " |")
    lines += ["", "## Conclusions (written from the record)", ""]
    lines += [f"- {line}" for line in conclusions(record)]
    return "\n".join(lines) + "\n"


def conclusions(record: dict[str, Any]) -> list[str]:
    """What the record supports, each claim only where both intervals exclude zero, in sentences."""
    flat = record["rule"]["flat_points"]
    points = record["points"]
    batch = sorted((p for p in points if p["axis"] == "batch"), key=lambda p: p["batch"])
    best = next(p for p in batch if p["batch"] == record["best_batch"])
    rows = {(r["a"], r["b"]): r for r in record.get("differences", [])}
    out = [
        f"Chosen on the validation words: batch {best['batch']:,} (validation R@1 "
        f"{_cell([r['val']['recall@1'] for r in best['runs']])}); on the test words it has R@1 "
        f"{_cell([r['test']['recall@1'] for r in best['runs']])}."
    ]
    sides: dict[str, list[str]] = {"lower": [], "within noise": [], "higher": []}
    for p in batch:
        if p is not best:
            r1 = rows[(_label(p), _label(best))]["recall@1"]
            sides[r1["verdict"]].append(f"{p['batch']:,} ({r1['mean']:+.2f})")
    for verdict, text in (("lower", "Beyond noise below the chosen batch"), ("within noise", "Within noise of the "
                          "chosen batch"), ("higher", "Beyond noise ABOVE the chosen batch (validation and test "
                          "disagree)")):  # fmt: skip
        if sides[verdict]:
            out.append(f"{text} on test R@1 (points): {', '.join(sides[verdict])}.")
    steps = [rows[(_label(a), _label(b))] for a, b in zip(batch[1:], batch[:-1], strict=False)]
    moves = [f"{r['a'].split()[-1]} - {r['b'].split()[-1]}: {r['recall@1']['mean']:+.2f} ({r['recall@1']['verdict']})"
             for r in steps]  # fmt: skip
    if moves:
        out.append("Each doubling of the batch, test R@1 points: " + "; ".join(moves) + ".")
    for p in points:
        if p["axis"] != "batch":
            r1 = rows[(_label(p), _label(best))]["recall@1"]
            out.append(f"{p['name']} - FastAP random at {best['batch']:,}: test R@1 {r1['mean']:+.2f} points, "
                       f"{r1['verdict']}.")  # fmt: skip
    gains = {_label(p): [r["val_gain"] for r in p["runs"]] for p in points}
    unknown = [name for name, g in gains.items() if any(v is None for v in g)]
    rising = [
        f"{name} ({_mean(g):+.2f})" for name, g in gains.items() if name not in unknown and _mean(g) >= flat
    ]
    if rising:
        out.append(
            f"Validation R@1 still rose by {flat:g} points or more over the last quarter of: {', '.join(rising)}."
        )
    else:
        out.append(f"The mean validation R@1 of every point{' but ' + ', '.join(unknown) if unknown else ''} rose by "
                   f"less than {flat:g} points over the last quarter of its runs (a decaying rate flattens a curve "
                   "by itself: the budget check below is the test of the length).")  # fmt: skip
    out.extend(_budget_lines(record, flat))
    edges = [_label(p) for p in points if p["at_edge"]]
    if edges:
        out.append(f"The chosen rate is at an end of the candidates for: {', '.join(edges)}.")
    return out


def _budget_lines(record: dict[str, Any], flat: float) -> list[str]:
    """One sentence per batch of the budget check: validation R@1 (seed 0) at the end of each length, and what each
    longer length added to the one before it."""
    epochs = record["rule"]["epochs"]
    by_batch: dict[int, list[dict[str, Any]]] = {}
    for check in record.get("budget_check", []):
        by_batch.setdefault(check["batch"], []).append(check)
    lines = []
    for batch in by_batch:
        checks = sorted(by_batch[batch], key=lambda c: c["epochs"])
        lengths, before = [], 0.0
        for check in checks:
            added = check["gain"] - before
            at = f"{100 * check['val']:.2f}, " if "val" in check else ""
            lengths.append(f"{check['epochs']:g} epochs {at}{added:+.2f} "
                           f"({'within' if abs(added) < flat else 'beyond'} the {flat:g}-point flatness threshold)")  # fmt: skip
            before = check["gain"]
        lines.append(f"Budget check, batch {batch:,}, seed 0: validation R@1 at the end of each longer schedule, "
                     f"against the one before ({epochs:g} epochs first): {'; '.join(lengths)}.")  # fmt: skip
    return lines


def plots(record: dict[str, Any], out: Path) -> list[Path]:
    """Test R@1 and MAP@R against the batch (each seed a dot) and each batch's validation curve (seed 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = [p for p in record["points"] if p["axis"] == "batch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [p["batch"] for p in batch]
    for metric, marker in (("recall@1", "o-"), ("map@r", "s--")):
        values = [[100 * r["test"][metric] for r in p["runs"]] for p in batch]
        left.plot(xs, [statistics.fmean(v) for v in values], marker, label=f"test {NAMES[metric]}")
        for x, v in zip(xs, values, strict=True):
            left.scatter([x] * len(v), v, s=10, color="gray", zorder=3)
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [f"{x:,}" for x in xs])
    left.set_xlabel("global batch (FastAP, random sampler, rate chosen per batch on validation)")
    left.set_ylabel("test words (%)")
    left.grid(alpha=0.3)
    left.legend()
    train_images = record["splits"]["train"]["images"]
    for p in batch:
        steps, r1 = zip(*p["runs"][0]["val_curve"], strict=True)
        right.plot([s * p["batch"] / train_images for s in steps], [100 * v for v in r1], "o-", ms=3,
                   label=f"{p['batch']:,}")  # fmt: skip
    right.set_xlabel("epochs (warm-up, then cosine decay to zero at the end)")
    right.set_ylabel("validation R@1 (%), seed 0")
    right.grid(alpha=0.3)
    right.legend(title="batch", fontsize=7)
    fig.tight_layout()
    path = out / "study-features-batch.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]

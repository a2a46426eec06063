"""No option goes silent: every option of ``eval``, ``compare``, ``export`` and ``search``, in every situation it
can meet (each ``eval.protocol`` for ``eval`` and the runs ``compare`` reads; the sources of ``export``; an
index for ``search``), is either honoured (an effect the user can see in the output) or refused in one line.

The options come from the argument parsers themselves (``parser._actions``): an option added without a row
in :data:`CASES` for each of its command's situations fails :func:`test_every_option_has_a_row_per_situation`.
To add one: a :class:`Case` naming the command, the option as ``--help`` spells it (a positional by its dest),
the situations, what it adds to the situation's base command (:func:`base_command`) and what is expected:
``Honoured(how, check)`` or ``Refused(message)``.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddp_rank.cli import build_parser, main
from ddp_rank.config import load_config, save_config
from ddp_rank.eval.protocols import PROTOCOLS
from tests.helpers.recipe_datasets import recipe_shards
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

pytestmark = pytest.mark.slow

SITUATIONS: dict[str, tuple[str, ...]] = {
    "eval": PROTOCOLS,  # eval.protocol
    "compare": PROTOCOLS,  # runs evaluated with that protocol
    "export": ("split", "images"),  # export takes no protocol: its situations are its sources
    "search": ("index",),
}
HEADLINE = {"sop": "recall@1", "inshop": "recall@1", "vehicleid": "recall@1", "verification": "roc_auc",
            "identification": "cmc@1"}  # fmt: skip
"""The train.best_metric of the runs ``compare`` reads in each situation."""


@dataclass
class World:
    """What the commands run on, built once for the module (see :func:`world`)."""

    root: Path
    run: Path  # a 2-step tiny_cnn run with a checkpoint after each step
    shards: dict[str, Path]  # eval.protocol -> shards to evaluate it on
    images: Path  # a small folder of images
    bad_images: Path  # the same with one unreadable file
    runs: dict[
        str, Path
    ]  # eval.protocol -> three runs evaluated with it: two seeds of lr=1e-4, one of lr=1e-3
    index: Path | None = None


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str
    tmp: Path  # the case's own folder: what it writes goes here
    situation: str
    xlabels: list[str]  # x-axis labels matplotlib was given (compare --x)

    def results(self, name: str = "eval.json") -> dict[str, Any]:
        return json.loads((self.tmp / name).read_text())

    def entry(self, name: str = "eval.json") -> dict[str, Any]:
        return next(iter(self.results(name).values()))


@dataclass(frozen=True)
class Honoured:
    how: str
    check: Callable[[Outcome, World], bool]


@dataclass(frozen=True)
class Refused:
    message: str  # part of the one line on stderr


@dataclass(frozen=True)
class Case:
    command: str
    option: str  # the longest option string, or a positional's dest
    situations: tuple[str, ...]
    args: Callable[[World, Path], list[str]]  # added to the base command
    expect: Honoured | Refused


def nothing(world: World, tmp: Path) -> list[str]:
    return []


def given(*args: str) -> Callable[[World, Path], list[str]]:
    return lambda world, tmp: list(args)


RETRIEVAL, DEPLOYMENT = ("sop", "inshop"), ("verification", "identification")
EVERY = PROTOCOLS
SPLIT_OF = {"sop": "train", "inshop": "train", "vehicleid": "test_medium", "verification": "train",
            "identification": "train"}  # fmt: skip


def _bootstrapped(o: Outcome, w: World) -> bool:
    spread = o.entry()["metrics"]["bootstrap"]
    return " ± " in o.out and spread["resamples"] == 20 and len(spread["metrics"]) >= 2


def _per_query(o: Outcome, w: World) -> bool:
    from ddp_rank.experiments.query_pairs import load_query_values

    values, metrics = load_query_values(o.tmp / "q.npz"), o.entry()["metrics"]
    return (
        f"per-query values: {o.tmp / 'q.npz'}" in o.out
        and len(values.labels) == metrics["num_queries"]
        and all(abs(v.mean() - metrics[name]) < 1e-12 for name, v in values.values.items())
    )


def _points(o: Outcome, w: World) -> bool:
    rows = list(csv.DictReader(io.StringIO(o.out)))
    return [row["runs"] for row in rows] == ["2", "1"] and "point" in rows[0]


CASES: list[Case] = [
    # eval: the base command evaluates the untrained tiny_cnn of --config with eval.protocol=<situation>.
    Case("eval", "--config", EVERY, nothing,
         Honoured("the config's network is evaluated: the row is named after its backbone",
                  lambda o, w: "tiny_cnn before training" in o.results())),
    Case("eval", "overrides", EVERY, nothing,
         Honoured("eval.protocol=<p> is the protocol recorded and printed",
                  lambda o, w: o.entry()["protocol"] == o.situation and o.out.split()[0] == o.situation)),
    Case("eval", "--checkpoint", EVERY, lambda w, t: ["--checkpoint", str(w.run)],
         Honoured("the row names the checkpoint", lambda o, w: "trained (step-" in next(iter(o.results())))),
    Case("eval", "--baseline", EVERY, given("--baseline", "raw-pixels"),
         Honoured("raw pixels are evaluated", lambda o, w: list(o.results()) == ["raw pixels"])),
    # In-Shop's recipe shards hold query and gallery images in their test split only: a split it lacks is named.
    Case("eval", "--split", ("inshop",), given("--split", "no-such"), Refused("no-such")),
    Case("eval", "--name", EVERY, given("--name", "mine"),
         Honoured("the row and the JSON entry carry the name", lambda o, w: list(o.results()) == ["mine"]
                  and "| mine" in o.out)),
    Case("eval", "--output", EVERY, lambda w, t: ["--output", str(t / "other.json")],
         Honoured("the results go to that file", lambda o, w: (o.tmp / "other.json").is_file()
                  and not (o.tmp / "eval.json").exists())),
    Case("eval", "--bootstrap", (*RETRIEVAL, *DEPLOYMENT), given("--bootstrap", "20"),
         Honoured("value ± standard error in the table, the intervals in the JSON", _bootstrapped)),
    Case("eval", "--bootstrap", ("vehicleid",), given("--bootstrap", "20"), Refused("leave out --bootstrap")),
    Case("eval", "--bootstrap-seed", (*RETRIEVAL, *DEPLOYMENT), given("--bootstrap", "20", "--bootstrap-seed", "3"),
         Honoured("the seed is recorded and printed", lambda o, w: o.entry()["metrics"]["bootstrap"]["seed"] == 3
                  and "(seed 3)" in o.out)),
    Case("eval", "--bootstrap-seed", EVERY, given("--bootstrap-seed", "3"),
         Refused("--bootstrap-seed seeds --bootstrap N")),
    Case("eval", "--per-query", RETRIEVAL, lambda w, t: ["--per-query", str(t / "q.npz")],
         Honoured("each query's values, whose means are the JSON's metrics", _per_query)),
    Case("eval", "--per-query", ("vehicleid", *DEPLOYMENT), lambda w, t: ["--per-query", str(t / "q.npz")],
         Refused("leave out --per-query")),
    # compare: the base command compares three finished runs evaluated with <situation>: two seeds of one
    # learning rate, one seed of another.
    Case("compare", "runs", EVERY, nothing,
         Honoured("one row per run", lambda o, w: all(f"| {n} |" in o.out for n in ("a0", "a1", "b0")))),
    Case("compare", "--csv", EVERY, given("--csv"),
         Honoured("CSV, one row per run", lambda o, w: len(list(csv.DictReader(io.StringIO(o.out)))) == 3)),
    Case("compare", "--json", EVERY, given("--json"),
         Honoured("JSON, one row per run", lambda o, w: len(json.loads(o.out)["runs"]) == 3)),
    Case("compare", "--points", EVERY, given("--points"), Refused("--points goes with --csv")),
    Case("compare", "--points", EVERY, given("--points", "--csv"), Honoured("one CSV row per point", _points)),
    Case("compare", "--plot", EVERY, lambda w, t: ["--plot", str(t / "c.png")],
         Honoured("the picture is drawn", lambda o, w: (o.tmp / "c.png").stat().st_size > 1000)),
    Case("compare", "--x", EVERY, given("--x", "optim.lr"), Refused("--x goes with --plot")),
    Case("compare", "--x", EVERY, lambda w, t: ["--plot", str(t / "c.png"), "--x", "train.seed"],
         Refused("--x train.seed: the points do not differ in it; they differ in: optim.lr")),
    Case("compare", "--x", EVERY, lambda w, t: ["--plot", str(t / "c.png"), "--x", "optim.lr"],
         Honoured("the plot's x axis is that key", lambda o, w: o.xlabels == ["optim.lr"])),
    Case("compare", "--curve", ("sop", "inshop", "vehicleid", "identification"), given("--curve", "roc"),
         Refused("no run has a roc curve")),
    Case("compare", "--curve", ("verification",), given("--curve", "roc"),
         Honoured("both runs' ROC curves drawn", lambda o, w: "roc curve:" in o.err and "left out" not in o.err)),
    Case("compare", "--curve", ("identification",), given("--curve", "cmc"),
         Honoured("both runs' CMC curves drawn", lambda o, w: "cmc curve:" in o.err and "left out" not in o.err)),
    Case("compare", "--curve-output", EVERY, lambda w, t: ["--curve-output", str(t / "r.png")],
         Refused("--curve-output goes with --curve")),
    Case("compare", "--curve-output", ("verification",),
         lambda w, t: ["--curve", "det", "--curve-output", str(t / "r.png")],
         Honoured("the curve goes to that file", lambda o, w: (o.tmp / "r.png").stat().st_size > 1000)),
    # The walk's runs are fake (no evaluation drew a picture); the drawn grid is tested in test_retrieval_pictures_cli.
    Case("compare", "--grid", EVERY, lambda w, t: ["--grid", str(t / "g.png")],
         Refused("no run has a retrieval picture to draw")),
    # export: the base command exports the run's test split, or (images) the image folder with --images.
    Case("export", "--checkpoint", ("split", "images"), nothing,
         Honoured("export.json records the checkpoint",
                  lambda o, w: "step-00000002" in o.results("out/export.json")["checkpoint"])),
    Case("export", "--config", ("split", "images"), lambda w, t: ["--config", str(_config_with(w, t, batch_size=5))],
         Honoured("the export is made with that config",
                  lambda o, w: o.results("out/export.json")["config"]["eval"]["batch_size"] == 5)),
    Case("export", "overrides", ("split", "images"), given("eval.batch_size=7"),
         Honoured("the export is made with the override",
                  lambda o, w: o.results("out/export.json")["config"]["eval"]["batch_size"] == 7)),
    Case("export", "--split", ("split",), given("--split", "train"),
         Honoured("that split is exported", lambda o, w: o.results("out/export.json")["source"]["split"] == "train")),
    Case("export", "--images", ("images",), nothing,
         Honoured("the folder is exported", lambda o, w: o.results("out/export.json")["source"]["kind"] == "images")),
    Case("export", "--shards-url", ("split",), lambda w, t: ["--shards-url", _test_shards_url(w)],
         Honoured("the shards at the URL are exported",
                  lambda o, w: o.results("out/export.json")["source"]["kind"] == "shards_url")),
    Case("export", "--split", ("images",), given("--split", "train"), Refused("not allowed with argument --images")),
    Case("export", "--shards-url", ("images",), given("--shards-url", "x.tar"),
         Refused("not allowed with argument --images")),
    Case("export", "--images", ("split",), lambda w, t: ["--split", "test", "--images", str(w.images)],
         Refused("not allowed with argument --split")),
    Case("export", "--output", ("split", "images"), nothing,
         Honoured("the export is written there", lambda o, w: (o.tmp / "out" / "export.json").is_file())),
    Case("export", "--on-bad", ("split",), given("--on-bad", "error"),
         Refused("--on-bad error applies to --images and --shards-url")),
    Case("export", "--on-bad", ("images",), lambda w, t: ["--images", str(w.bad_images), "--on-bad", "error"],
         Refused("broken.png does not decode")),
    # The walk's images are 16 x 16: 256 pixels pass, and the limit is the export's (and its search's) own;
    # 255 refuses every image, one line each, then the error (tests/eval/test_export_search.py).
    Case("export", "--max-image-pixels", ("split", "images"), given("--max-image-pixels", "256"),
         Honoured("every image within the limit is exported, the limit recorded in the export's config",
                  lambda o, w: o.results("out/export.json")["config"]["data"]["max_image_pixels"] == 256
                  and not o.results("out/export.json").get("skipped"))),
    Case("export", "--on-bad", ("images",), lambda w, t: ["--images", str(w.bad_images), "--on-bad", "skip"],
         Honoured("the unreadable file is left out and listed",
                  lambda o, w: len(o.results("out/export.json")["skipped"]) == 1)),
    # search: the base command searches the index for one query image.
    Case("search", "index", ("index",), nothing,
         Honoured("the query's hits are the indexed keys", lambda o, w: o.out.splitlines()[1].split()[2]
                  in _exported_keys(w))),
    Case("search", "images", ("index",), lambda w, t: [str(_query(w, 1))],
         Honoured("every query is answered", lambda o, w: str(_query(w, 1)) in o.out and str(_query(w, 0)) in o.out)),
    Case("search", "-k", ("index",), given("-k", "0"), Refused("-k 0: give the number of results per query")),
    Case("search", "-k", ("index",), given("-k", "2"),
         Honoured("k hits per query", lambda o, w: len(o.out.splitlines()) == 3)),
    Case("search", "--checkpoint", ("index",),
         lambda w, t: ["--checkpoint", str(w.run / "checkpoints" / "step-00000001")],
         Honoured("the query is embedded by that checkpoint: other scores", lambda o, w: o.out != _default_search(w))),
    Case("search", "--config", ("index",), lambda w, t: ["--config", str(_config_with(w, t, image_size=12))],
         Honoured("the query is embedded as that config says (12 px): other scores",
                  lambda o, w: o.out != _default_search(w))),
    Case("search", "--on-bad", ("index",), given("--on-bad", "error", "--max-image-pixels", "1"),
         Refused("pass --on-bad skip")),
    Case("search", "--max-image-pixels", ("index",), given("--max-image-pixels", "1", "--on-bad", "error"),
         Refused("is over the limit of 1")),
    Case("search", "--grid", ("index",), lambda w, t: ["--grid", str(t / "g.png")],
         Honoured("the picture of the hits is drawn", lambda o, w: (o.tmp / "g.png").stat().st_size > 1000
                  and f"grid: {o.tmp / 'g.png'}" in o.out)),
]  # fmt: skip


def _eval_split_case(situation: str) -> Case:
    split = SPLIT_OF[situation]
    return Case("eval", "--split", (situation,), given("--split", split),
                Honoured(f"split '{split}' is evaluated", lambda o, w: o.entry()["split"] == split
                         and f"split '{split}'" in o.out))  # fmt: skip


def _compare_metric_case(situation: str) -> Case:
    metric = {"verification": "eer", "identification": "fnir@fpir=1e-1", "vehicleid": "recall@5"}.get(
        situation, "map@r"
    )
    return Case("compare", "--metric", (situation,), given("--metric", metric),
                Honoured(f"best {metric} gets the column", lambda o, w: f"best {metric}" in o.out))  # fmt: skip


CASES += [_eval_split_case(s) for s in ("sop", "vehicleid", "verification", "identification")]
CASES += [_compare_metric_case(s) for s in EVERY]


def _config_with(world: World, tmp: Path, batch_size: int = 16, image_size: int = 16) -> Path:
    path = tmp / "other.yaml"
    cfg = load_config(world.run / "config.yaml", [f"eval.batch_size={batch_size}", f"data.image_size={image_size}",
                                                  f"data.resize_size={image_size}"])  # fmt: skip
    save_config(cfg, path)
    return path


def _test_shards_url(world: World) -> str:
    tars = sorted((world.shards["sop"] / "test").glob("*.tar")) or sorted(
        world.shards["sop"].glob("test*.tar")
    )
    assert tars, "no test shard"
    return str(tars[0])


def _query(world: World, n: int) -> Path:
    return sorted((world.images).rglob("*.png"))[n]


def _exported_keys(world: World) -> set[str]:
    from ddp_rank.eval.export import load_export

    return set(load_export(world.root / "export").keys.tolist())


_DEFAULT_SEARCH: dict[Path, str] = {}


def _default_search(world: World) -> str:
    """What the base search prints with the export's own checkpoint."""
    assert world.index is not None
    if world.index not in _DEFAULT_SEARCH:
        _DEFAULT_SEARCH[world.index] = _run(["search", str(world.index), str(_query(world, 0))])[1]
    return _DEFAULT_SEARCH[world.index]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stderr, redirect_stdout

    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def base_command(world: World, command: str, situation: str, tmp: Path) -> list[str]:
    if command == "eval":
        extra = ["data.test_split=test_large"] if situation == "vehicleid" else []
        return ["eval", "--config", str(world.run / "config.yaml"), f"data.shards={world.shards[situation]}",
                f"eval.protocol={situation}", *extra, "--output", str(tmp / "eval.json")]  # fmt: skip
    if command == "compare":
        return ["compare", str(world.runs[situation])]
    if command == "export":
        source = ["--images", str(world.images)] if situation == "images" else []
        return ["export", "--checkpoint", str(world.run), *source, "--output", str(tmp / "out")]
    assert command == "search" and world.index is not None
    return ["search", str(world.index), str(_query(world, 0))]


def _fake_run(folder: Path, protocol: str, seed: int, lr: float) -> None:
    """A finished run evaluated with ``protocol`` at steps 5 and 10 (metrics.jsonl, curves.json, run.json)."""
    import numpy as np

    from ddp_rank.eval.deployment import DeploymentSettings, deployment_metrics
    from ddp_rank.eval.protocols import metric_names
    from ddp_rank.train.run_state import RunState

    cfg = load_config(None, [f"eval.protocol={protocol}", f"train.best_metric={HEADLINE[protocol]}",
                             f"train.seed={seed}", f"optim.lr={lr}", "train.steps=10",
                             f"train.output_dir={folder}"])  # fmt: skip
    save_config(cfg, folder / "config.yaml")
    rng = np.random.default_rng([seed, int(lr * 1e4)])
    records = []
    for step in (5, 10):
        names = metric_names(protocol)
        metrics = {n: int(rng.integers(4, 40)) if n.rsplit("/")[-1].startswith(("num_", "gallery_"))
                   else float(rng.uniform(0.2, 0.9)) for n in names}  # fmt: skip
        records += [{"kind": "train", "step": step, "loss": 0.5, "images_per_s": 10.0},
                    {"kind": "eval", "step": step, **metrics}]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if protocol in DEPLOYMENT:
        import torch

        e = torch.nn.functional.normalize(
            torch.randn(24, 4, generator=torch.Generator().manual_seed(seed)), dim=1
        )
        drawn = deployment_metrics([protocol], e, torch.arange(24) // 4, DeploymentSettings())["curves"]
        (folder / "curves.json").write_text(json.dumps({"step 10": drawn}))
    state = RunState(folder)
    state.start()
    state.finished(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    from ddp_rank.train.trainer import run_training

    root = tmp_path_factory.mktemp("walk")
    shards = build_tiny_shards(root)
    run = root / "run"
    run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={run}",
                                    "train.steps=2", "train.checkpoint_every=1"]))  # fmt: skip
    images = root / "queries"
    shutil.copytree(root / "images" / "cat0" / "cls0_0", images)
    bad_images = root / "bad-queries"
    shutil.copytree(images, bad_images)
    (bad_images / "broken.png").write_bytes(b"not a png")
    by_protocol = {p: shards for p in ("sop", "verification", "identification")}
    by_protocol.update({p: recipe_shards(p, root) for p in ("inshop", "vehicleid")})
    runs = {}
    for protocol in PROTOCOLS:
        for name, seed, lr in (("a0", 0, 1e-4), ("a1", 1, 1e-4), ("b0", 0, 1e-3)):
            _fake_run(root / "runs" / protocol / name, protocol, seed, lr)
        runs[protocol] = root / "runs" / protocol
    w = World(root, run, by_protocol, images, bad_images, runs)
    try:
        import faiss  # noqa: F401
    except ImportError:
        return w
    export, index = root / "export", root / "index"
    assert _run(["export", "--checkpoint", str(run), "--output", str(export)])[0] == 0
    assert _run(["index", str(export), "--output", str(index)])[0] == 0
    w.index = index
    return w


def _parsers() -> dict[str, Any]:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return {name: commands.choices[name] for name in SITUATIONS}


def _option_name(action: Any) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def test_every_option_has_a_row_per_situation() -> None:
    """The parsers' options against the table: one without a row (a new option) or a row without an option
    (a renamed one) fails, so no option can go silent unnoticed."""
    missing, stale = [], []
    for command, parser in _parsers().items():
        options = {_option_name(a) for a in parser._actions if a.dest != "help"}
        for option in sorted(options):
            for situation in SITUATIONS[command]:
                if not any(
                    c.command == command and c.option == option and situation in c.situations for c in CASES
                ):
                    missing.append(f"{command} {option} [{situation}]")
        stale += [
            f"{c.command} {c.option}" for c in CASES if c.command == command and c.option not in options
        ]
    assert not missing, "options without a row in CASES (honoured how, or refused with what): " + ", ".join(
        missing
    )
    assert not stale, "rows of options the parser no longer has: " + ", ".join(stale)


def _expanded() -> list[Any]:
    return [
        pytest.param(case, situation, id=f"{case.command} {case.option} [{situation}] "
                     f"{'refused' if isinstance(case.expect, Refused) else 'honoured'} {i}")
        for i, case in enumerate(CASES)
        for situation in case.situations
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "situation"), _expanded())
def test_the_option_is_honoured_or_refused_in_one_line(
    case: Case, situation: str, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if case.command == "search" and world.index is None:
        pytest.skip("search needs faiss")
    if case.command == "compare":
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(
        tmp_path
    )  # what a command writes by default (compare-roc.png) stays out of the repository
    xlabels: list[str] = []
    if case.command == "compare":
        from matplotlib.axes import Axes

        set_xlabel = Axes.set_xlabel
        monkeypatch.setattr(Axes, "set_xlabel", lambda ax, label, *a, **k: (xlabels.append(label),
                                                                          set_xlabel(ax, label, *a, **k))[1])  # fmt: skip
    argv = [*base_command(world, case.command, situation, tmp_path), *case.args(world, tmp_path)]
    code, out, err = _run(argv)
    outcome = Outcome(code, out, err, tmp_path, situation, xlabels)
    if isinstance(case.expect, Refused):
        lines = [line for line in err.splitlines() if line.strip()]
        if lines and lines[0].startswith("usage:"):  # argparse's refusal: the usage, then one error line
            lines = lines[-1:]
        assert code == 2, f"{' '.join(argv)}: exit {code}, expected a refusal\n{out}\n{err}"
        assert len(lines) == 1 and case.expect.message in lines[0], lines
        assert "Traceback" not in err
    else:
        assert code == 0, f"{' '.join(argv)}: exit {code}\n{err}"
        assert case.expect.check(outcome, world), f"{case.expect.how}: not seen in\n{out}\n{err}"

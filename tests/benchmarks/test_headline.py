"""The headline table of README.md and docs/index.md: equal to what benchmarks/headline.py reads from
benchmarks/results/, and an error, never a blank, when a figure is missing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from benchmarks import headline
from benchmarks.common import RESULTS_DIR


def test_the_readme_and_site_tables_are_what_the_script_writes_from_the_results() -> None:
    for path, link in headline.TARGETS:
        text = path.read_text(encoding="utf-8")
        assert headline.with_table(text, headline.table(link=link)) == text, (
            f"{path.name}'s headline table is out of date: run python -m benchmarks.headline"
        )
    assert "](results/gpu-" in headline.table(link=headline.site_link)  # the site links its own pages


def test_every_row_links_the_file_its_figure_was_read_from() -> None:
    lines = headline.table().splitlines()[2:]
    assert len(lines) == len(headline.ROWS)
    for line in lines:
        name = line.rsplit("](benchmarks/results/", 1)[1].rstrip(" |)")
        assert (RESULTS_DIR / name).is_file()


def _results_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "repo" / "benchmarks" / "results"
    folder.mkdir(parents=True)
    for topic in ("loss", "loss-floor", "gpu", "features"):
        shutil.copy(headline.newest(topic, RESULTS_DIR), folder)
    return folder


def test_the_newest_file_of_a_topic_is_read_and_a_longer_topic_is_not_taken_for_it(tmp_path: Path) -> None:
    folder = _results_copy(tmp_path)
    floor = headline.newest("loss-floor", folder)
    later = folder / "loss-floor-2099-01-01.md"
    later.write_text(re.sub(r"(\| fastap \| \d+ \| \d+ \| )[\d.]+ \|", r"\g<1>9.99 |", floor.read_text()))
    (folder / "loss-2099-02-02-h100.md").write_text("# a tagged file is not the topic's newest\n")
    assert (
        headline.newest("loss", folder).name.startswith("loss-20")
        and "floor" not in headline.newest("loss", folder).name
    )
    assert "FastAP 9.99x" in headline.against_floor_cpu(folder).figure
    assert headline.against_floor_cpu(folder).source == later


def test_a_figure_the_script_cannot_find_is_an_error_naming_the_file(tmp_path: Path) -> None:
    folder = _results_copy(tmp_path)
    gpu = headline.newest("gpu", folder)
    gpu.write_text(gpu.read_text().replace("trainer direct", "trainer straight"))
    with pytest.raises(headline.MissingFigure, match=r"benchmarks/results/gpu-.*'trainer direct' check line"):
        headline.table(folder)
    for path in folder.glob("features-*.md"):
        path.unlink()
    with pytest.raises(headline.MissingFigure, match=r"no features-<date>\.md"):
        headline.largest_batch_cpu(folder)


def test_the_command_rewrites_only_between_its_markers_and_checks(tmp_path: Path) -> None:
    readme, home = tmp_path / "README.md", tmp_path / "index.md"
    for path in (readme, home):
        path.write_text(f"# Title\n\nbefore\n\n{headline.START}\nstale\n{headline.END}\n\nafter\n")
    paths = ["--readme", str(readme), "--site-home", str(home)]
    assert headline.main([*paths, "--check"]) == 1
    assert "stale" in readme.read_text()  # --check writes nothing
    assert headline.main(paths) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{headline.END}\n\nafter\n")
    assert "stale" not in text and headline.table() in text
    assert headline.table(link=headline.site_link) in home.read_text()
    assert headline.main([*paths, "--check"]) == 0


def test_a_readme_without_the_markers_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n")
    assert headline.main(["--readme", str(readme), "--site-home", str(readme)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the markers" in err

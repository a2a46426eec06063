"""An index or export folder is checked file by file before faiss or numpy reads it: a missing, cut, changed or
garbled file is refused in one line that names it and says how to rebuild (``ddp-rank index`` / ``search``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ddp_rank.cli import main
from ddp_rank.eval.export import Embeddings, ExportError, load_export, save_export
from ddp_rank.eval.vector_index import IndexSpec, SearchIndex

pytest.importorskip("faiss")

N, DIM = 64, 8


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of 64 random unit vectors and a flat index over it (pristine: tests damage copies)."""
    root = tmp_path_factory.mktemp("built")
    rng = np.random.default_rng(0)
    e = rng.normal(size=(N, DIM)).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    data = Embeddings(e, np.array([f"k{i}" for i in range(N)]), np.arange(N) % 8, np.array(["c"] * N),
                      np.array(["test"] * N), meta={"source": {"kind": "test"}})  # fmt: skip
    save_export(data, root / "export")
    SearchIndex.build(load_export(root / "export"), IndexSpec("flat"), 5, 16).save(root / "index")
    return root


@pytest.fixture()
def copy(built: Path, tmp_path: Path) -> Path:
    shutil.copytree(built, tmp_path / "c")
    return tmp_path / "c"


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def unrecord_index(root: Path) -> None:
    """Make the index look like one of an older version: no record of index.faiss, none of the parts."""
    info = json.loads((root / "index.json").read_text())
    del info["files"]
    (root / "index.json").write_text(json.dumps(info))
    manifest = json.loads((root / "items" / "export.json").read_text())
    for part in manifest["parts"]:
        del part["bytes"], part["sha256"]
    (root / "items" / "export.json").write_text(json.dumps(manifest))


PART = "part-00000-of-00001.npz"
EXPORT_DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "part missing": (lambda r: (r / PART).unlink(), f"{PART} is missing"),
    "part cut": (lambda r: cut(r / PART), f"{PART} has"),
    "part flipped": (lambda r: flip(r / PART), f"{PART} does not match the SHA-256"),
    "export.json outside": (
        lambda r: (r / "export.json").write_text('{"parts": [{"file": "../../x.npz", "rows": 1}]}'),
        "export.json is damaged",
    ),
    "export.json garbled": (lambda r: (r / "export.json").write_text("[1,"), "export.json is damaged"),
}
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "index.faiss missing": (lambda r: (r / "index.faiss").unlink(), "index.faiss is missing"),
    "index.faiss cut": (lambda r: cut(r / "index.faiss"), "index.faiss has"),
    "index.faiss flipped": (lambda r: flip(r / "index.faiss"), "index.faiss does not match the SHA-256"),
    "index.json garbled": (lambda r: (r / "index.json").write_text("{"), "index.json is damaged"),
    "index.json without spec": (lambda r: (r / "index.json").write_text("{}"), "index.json is damaged"),
    "old index.faiss cut": (lambda r: (unrecord_index(r), cut(r / "index.faiss")), "cannot be read by faiss"),
    "old part cut": (lambda r: (unrecord_index(r), cut(r / "items" / PART)), f"{PART} cannot be read"),
    "old part missing": (lambda r: (unrecord_index(r), (r / "items" / PART).unlink()), f"{PART} is missing"),
    **{
        f"items {name}": (lambda r, f=f: f(r / "items"), said)  # type: ignore[misc]
        for name, (f, said) in EXPORT_DAMAGES.items()
    },
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_search_names_the_damaged_file_of_an_index(
    copy: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    apply, said = DAMAGES[damage]
    apply(copy / "index")
    query = copy / "query.png"
    query.write_bytes(b"not read: the index is refused first")
    assert main(["search", str(copy / "index"), str(query)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert "ddp-rank index" in err[0] and "Traceback" not in err[0] and "0x" not in err[0]


@pytest.mark.parametrize("damage", list(EXPORT_DAMAGES))
def test_index_names_the_damaged_file_of_an_export(
    copy: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    apply, said = EXPORT_DAMAGES[damage]
    export = copy / "export"
    apply(export)
    assert main(["index", str(export), "--output", str(copy / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "ddp-rank export" in err[0], err
    assert not (copy / "new").exists()


def test_an_intact_index_loads_and_answers_like_exact_search(built: Path) -> None:
    index = SearchIndex.load(built / "index")
    e = load_export(built / "export").embeddings
    scores, rows = index.search(e[:4], k=1)
    assert rows[:, 0].tolist() == [0, 1, 2, 3] and np.allclose(scores[:, 0], 1.0, atol=1e-5)
    info = json.loads((built / "index" / "index.json").read_text())
    assert info["files"]["index.faiss"]["bytes"] == (built / "index" / "index.faiss").stat().st_size
    with pytest.raises(ExportError, match="from different builds"):
        other = built / "other"
        shutil.copytree(built / "index", other)
        shutil.copytree(built / "export", other / "items", dirs_exist_ok=True)
        small = Embeddings(e[:3], np.array(["a", "b", "c"]), np.zeros(3, int), np.array(["c"] * 3),
                           np.array(["t"] * 3))  # fmt: skip
        shutil.rmtree(other / "items")
        save_export(small, other / "items")
        SearchIndex.load(other)

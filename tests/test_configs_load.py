"""Every experiment file in configs/ loads, validates, and starts with its launch command and hardware."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddp_rank.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
NOT_PAPERS = {"demo", "words_features"}
"""This project's own experiments, not reproductions of a paper: their preprocessing and weights are their own."""


def test_there_are_configs() -> None:
    names = {p.stem for p in CONFIGS}
    assert "demo" in names and len(CONFIGS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads(path: Path) -> None:
    load_config(path)
    head = path.read_text().splitlines()[:12]
    assert head[0].startswith("# Launch"), f"{path.name}: first line must be the command"
    launch = "\n".join(line for line in head if not line.startswith("# Hardware"))
    assert f"configs/{path.name}" in launch, f"{path.name}: its launch command must name the file itself"
    for launcher in re.findall(r"launch/[\w.-]+", launch):
        assert (REPO / launcher).is_file(), f"{path.name}: its launch command names {launcher}, which does not exist"
    assert any("Hardware" in line for line in head), f"{path.name}: say which hardware it expects"


def test_paper_setups() -> None:
    by = {p.stem: load_config(p) for p in CONFIGS}
    r18 = by["sop_fastap_resnet18_m256"]
    assert (r18.model.backbone, r18.data.global_batch_size, r18.loss.name) == ("resnet18", 256, "fastap")
    chunked = by["sop_fastap_resnet50_m256_chunked"]
    assert chunked.distributed.chunk_size and chunked.data.global_batch_size == 256
    pnp = by["sop_pnp_dq_resnet50_m384"]
    assert (pnp.loss.name, pnp.loss.pnp_variant, pnp.loss.alpha, pnp.data.global_batch_size) == (
        "pnp",
        "Dq",
        4.0,
        384,
    )
    assert by["inat_fastap_resnet50_global65536"].data.global_batch_size == 65536
    assert by["inshop_fastap_resnet50_m256"].eval.protocol == "inshop"
    assert by["vehicleid_fastap_resnet50_m256"].eval.protocol == "vehicleid"


def test_paper_configs_use_the_papers_preprocessing_and_weights() -> None:
    """The papers resize to 256 x 256 and crop 224, from torchvision's original ResNet weights (V1, not V2)."""
    papers = [load_config(p) for p in CONFIGS if p.stem not in NOT_PAPERS]
    assert papers and all(c.data.crop == "paper" for c in papers)
    assert all(c.model.weights == "IMAGENET1K_V1" for c in papers if c.model.backbone.startswith("resnet"))

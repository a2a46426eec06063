"""The ``eval`` section: the retrieval evaluation, its protocols and metrics."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import model_validator

from ddp_rank.config.checks import (
    Bool,
    ConfigError,
    Float,
    Int,
    ListOf,
    Positive,
    Rate,
    _field,
    _Section,
)


class EvalConfig(_Section):
    """Retrieval evaluation (Recall@k, MAP@R) with the datasets' protocols."""

    protocol: Literal["sop", "inshop", "vehicleid", "verification", "identification"] = _field(
        "sop",
        "'sop': each test image queries all the others (also the demo); 'inshop': query set vs gallery set; "
        "'vehicleid': small / medium / large test lists, one random gallery image per vehicle; 'verification': "
        "every pair of the test split, TPR@FPR, ROC AUC, EER, AP; 'identification': a seeded enrolled / "
        "non-enrolled split of the test identities, CMC and FNIR@FPIR.",
    )
    ks: Annotated[list[Positive], ListOf] = _field(
        [],
        "Recall@k cut-offs; empty = the protocol's (SOP 1,10,100,1000; In-Shop 1,10,20,30,40,50; "
        "VehicleID 1,5).",
    )
    batch_size: Int = _field(128, "Images per rank per forward pass while embedding the test set.", minimum=1)
    search: Literal["auto", "faiss", "torch"] = _field(
        "auto",
        "Exact inner-product search: 'torch' = chunked top-k on the GPU when there is one (else the CPU), "
        "'faiss' = faiss IndexFlatIP on the CPU, 'auto' = torch on a GPU, else faiss if installed, else torch.",
    )
    map_at_r: Bool = _field(
        True,
        "Also report MAP@R (Musgrave et al. 2020); never for VehicleID, where every query has one relevant "
        "image and MAP@R equals Recall@1.",
    )
    vehicleid_sizes: Annotated[list[Literal["small", "medium", "large"]], ListOf] = _field(
        ["small", "medium", "large"],
        "VehicleID test lists to evaluate.",
    )
    vehicleid_repeats: Int = _field(
        1, "VehicleID: gallery draws averaged (one random image per vehicle each).", minimum=1
    )
    metrics: Annotated[list[Literal["verification", "identification"]], ListOf] = _field(
        [],
        "Deployment figures reported beside eval.protocol's (sop, inshop): 'verification' (TPR@FPR, ROC AUC, "
        "EER, AP over every pair of the test split) and/or 'identification' (CMC, FNIR@FPIR); their curves "
        "are drawn as roc.png, det.png, pr.png, cmc.png.",
    )
    fprs: Annotated[list[Rate], ListOf] = _field(
        [1e-2, 1e-3, 1e-4],
        "Verification: the false positive rates of the reported TPR@FPR (exact, no interpolation; a rate "
        "needing more negative pairs than the split has is reported as not measurable).",
    )
    max_positive_pairs: Int = _field(
        1 << 24,
        "Verification: most positive (same-class) pairs kept in memory, about 28 bytes each; the negative pairs "
        "are counted in blocks and never kept. A split with more positive pairs is refused.",
        minimum=1,
    )
    block_mb: Int = _field(
        256, "Verification and identification: MiB of work space for one block of pair scores.", minimum=1
    )
    enrolled_fraction: Float = _field(
        0.5,
        "Identification: share of the test identities enrolled in the gallery (drawn with train.seed); the "
        "others' images are the open-set (non-mated) probes. 1 = closed set only.",
        above=0.0,
        maximum=1.0,
    )
    gallery_per_identity: Int = _field(
        1,
        "Identification: gallery images per enrolled identity, drawn at random (the rest are its probes); "
        "0 = all of its images but one.",
        minimum=0,
    )
    fpirs: Annotated[list[Rate], ListOf] = _field(
        [1e-1, 1e-2],
        "Identification: the false positive identification rates of the reported FNIR@FPIR.",
    )
    grid_queries: Int = _field(
        8,
        "The retrieval picture (a run's retrieval.png at each evaluation; <results>-retrieval-<row>.png beside "
        "the results of ddp-rank eval): this many test queries, one row each, with their grid_k nearest "
        "neighbours framed green (the query's class) or red (another), captioned with the class names; 0 = no "
        "picture. Feature shards hold no image: no picture.",
        minimum=0,
    )
    grid_k: Int = _field(5, "The retrieval picture: neighbours shown per query.", minimum=1)
    grid_seed: Int = _field(
        0,
        "The retrieval picture: seed of the query sample (not train.seed, so runs that differ in their seed show "
        "the same queries and `ddp-rank compare --grid` can set them side by side).",
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.metrics and self.protocol == "vehicleid":
            raise ConfigError(
                f"eval.metrics={','.join(self.metrics)} is not available with eval.protocol=vehicleid (its test "
                "lists are evaluated one by one): use eval.protocol=verification or identification on one list"
            )
        return self

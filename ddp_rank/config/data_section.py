"""The ``data`` section: where the images come from and how a global batch is formed."""

from __future__ import annotations

from typing import Literal

from ddp_rank.config.checks import Bool, Float, Int, Text, _field, _Section


class DataConfig(_Section):
    """Where the images come from and how a global batch is formed (the data layer's stream)."""

    shards: Text = _field(
        "",
        "Shard directory or URL (http(s)://, s3://, gs://, ... : any fsspec protocol) holding manifest.json and "
        "the splits' tars (built by `ddp-rank shards build`, or indexed by `ddp-rank shards index`).",
    )
    cache_dir: Text = _field(
        "",
        "Node-local directory that keeps whole shards fetched from a URL (each is re-read every epoch), checked "
        "against the manifest's sha256; empty = read each class by range every time. Unused for local shards. "
        "A local disk of one user's: its locks (flock) do not hold on NFS or Lustre, nor across users.",
    )
    cache_max_gb: Float = _field(
        0.0,
        "Cap of data.cache_dir in GB (1e9 bytes), shared by every job and worker using that directory: the least "
        "recently used shards are evicted, never one a reader holds open. 0 = automatic: half of the free space "
        "of the cache's file system (plus what it already holds) when the run starts. A shard that does not fit, "
        "or a full disk, is read by range from the source instead (counted as data_cache_fallbacks).",
        minimum=0.0,
    )
    train_split: Text = _field("train", "Split of data.shards to train on.")
    test_split: Text = _field(
        "test",
        "Split of data.shards evaluated during and after training (held-out classes); empty = no evaluation.",
    )
    image_size: Int = _field(
        224, "Side of the square crop fed to the network, in pixels (papers: 224).", minimum=8
    )
    resize_size: Int = _field(
        256, "Side the images are resized to before cropping (papers: 256); must be >= image_size.", minimum=8
    )
    crop_scale_min: Float = _field(
        0.08,
        "Training random-resized-crop: smallest crop area as a fraction of the image.",
        minimum=0.0,
        maximum=1.0,
    )
    global_batch_size: Int = _field(
        256,
        "M in the papers: images per optimizer step summed over all ranks; must be divisible by the world size.",
        minimum=2,
    )
    sampler: Literal["auto", "hard", "hard_unlabelled", "random", "pk"] = _field(
        "auto",
        "Batch construction, one global plan per step whatever the number of GPUs: 'auto' is 'hard' when the "
        "training split's classes span at least max(2, categories_per_batch) categories and 'random' otherwise "
        "(shards without categories; `ddp-rank plan` and the run's log say which and why); 'hard' gives each batch "
        "categories_per_batch categories (FastAP sec. 4.2: pairs for SOP, In-Shop), classes drawn at random from "
        "the whole category until each has its share; 'hard_unlabelled' half one labelled category and half "
        "unlabelled classes (VehicleID); 'random' classes from the whole split; 'pk' images_per_class images of "
        "each class (PNP and most metric-learning code).",
    )
    images_per_class: Int = _field(
        4, "pk sampler: K, images taken from each class (all of a smaller class).", minimum=2
    )
    category_aware: Bool = _field(
        False, "pk sampler: take the classes from the hard schedule's categories instead of the whole split."
    )
    categories_per_batch: Int = _field(
        2, "Hard sampler: categories per batch (the FastAP paper found 2 best).", minimum=1
    )
    batches_per_pair: Int = _field(
        5, "Hard sampler: batches per set of categories per epoch (FastAP: SOP 5, In-Shop 2).", minimum=1
    )
    steps_per_epoch: Int = _field(
        0,
        "Override the epoch length (hard sampler: then a fresh random category set per step); 0 = the schedule's.",
        minimum=0,
    )
    num_workers: Int = _field(
        2,
        "DataLoader worker processes per rank (0 = load in the training process); they only split the decoding, "
        "never what is drawn.",
        minimum=0,
    )
    augment: Bool = _field(
        True, "Random crop + horizontal flip for training (papers); off = the test-time centre crop."
    )
    seed: Int = _field(
        -1,
        "Seed of the data alone: which classes and images each step draws, how they are dealt to the ranks, and "
        "each image's crop and flip; -1 = train.seed. Sweep it with train.seed fixed to vary the data order with "
        "the same initial weights, or fix it and sweep train.seed to vary only the initialisation.",
        minimum=-1,
    )
    crop: Literal["random_resized", "paper"] = _field(
        "random_resized",
        "Image preprocessing. 'paper' = the FastAP / PNP papers' exactly: resize to resize_size x resize_size "
        "(aspect not kept), random image_size crop and flip for training, centre crop for testing. "
        "'random_resized' = resize the shorter side to resize_size, random-resized crop (area crop_scale_min..1, "
        "aspect 3/4..4/3) and flip for training, centre crop for testing.",
    )
    max_image_pixels: Int = _field(
        89_478_485,
        "Largest image decoded, in pixels (width x height, read from the file's header before any pixel is "
        "decoded): a larger one is a decompression bomb or a mistake and counts as undecodable (its class is "
        "replaced in training; `shards verify`, `search` and `export` name it). Default: PIL's own warning "
        "threshold, 9,459 x 9,459, about 270 MB decoded.",
        minimum=1,
    )

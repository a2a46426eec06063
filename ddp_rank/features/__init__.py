"""Feature shards, end to end: samples that are one backbone output (a float16 vector) each instead of image bytes.

A vertical slice; each module keeps the layer of what it does (ARCHITECTURE.md):

- ``records`` (data): the vector sample format and its reading;
- ``synthetic`` (data): clustered synthetic feature shards for tests and benchmarks;
- ``whitening`` (data): the PCA whitening fitted on a split and stored beside the vectors;
- ``head`` (model): the network trained on vectors (and the same head on a backbone, for images);
- ``build`` (eval): ``ddp-rank shards features``, embedding a shard set once with a frozen backbone;
- ``images`` (eval): the model that embeds images with a backbone and a feature-trained head;
- ``whiten`` (eval): ``ddp-rank shards whiten``.

This ``__init__`` imports nothing, so importing a data-layer module of the slice does not import the eval layer.
"""

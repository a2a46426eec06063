"""Feature shards in the data layer: samples that are one backbone output (a float16 vector) instead of image bytes.

- ``records``: the vector sample format and its reading;
- ``whitening``: the PCA whitening fitted on a split and stored beside the vectors;
- ``synthetic``: clustered synthetic feature shards for tests and benchmarks.

The head trained on the vectors is the model layer's (``ddp_rank.model.feature_head``); making feature shards
with a frozen backbone and whitening them are the evaluation layer's (``ddp_rank.eval.features``).
"""

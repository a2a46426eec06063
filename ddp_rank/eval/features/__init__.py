"""Feature shards made and used with a backbone: what embeds images, the way the evaluation does.

- ``build``: ``ddp-rank shards features``, a shard set embedded once with a frozen backbone;
- ``whiten``: ``ddp-rank shards whiten``, the stored vectors mapped by a whitening fitted on a split;
- ``images``: the model that embeds images with that backbone and a head trained on the vectors.

The format of the vectors is the data layer's (``ddp_rank.data.features``), the head the model layer's
(``ddp_rank.model.feature_head``).
"""

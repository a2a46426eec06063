"""The distributed layer: uneven-row collectives, the global-batch loss, process-group helpers.

The only place that calls ``torch.distributed`` for training math. It knows the listwise losses only through
their ``prepare``/``rows`` interface, any other loss only as ``loss(embeddings, labels)``, and knows nothing of
images or data.
"""

from ddp_rank.distributed.any_loss import average_gradients
from ddp_rank.distributed.collectives import (
    CommCounter,
    all_gather_ints,
    all_reduce_sum,
    padded_all_gather,
    padded_reduce_scatter,
)
from ddp_rank.distributed.global_loss import (
    GlobalBatchLoss,
    GlobalBatchLossFunction,
    GlobalLayout,
    GradReduction,
    global_batch_loss,
)
from ddp_rank.distributed.process_group import (
    collective_device,
    end_process_group,
    is_distributed,
    max_over_ranks,
    min_over_ranks,
    rank,
    world_size,
)

__all__ = [
    "CommCounter",
    "GlobalBatchLoss",
    "GlobalBatchLossFunction",
    "GlobalLayout",
    "GradReduction",
    "all_gather_ints",
    "all_reduce_sum",
    "average_gradients",
    "collective_device",
    "end_process_group",
    "global_batch_loss",
    "is_distributed",
    "max_over_ranks",
    "min_over_ranks",
    "padded_all_gather",
    "padded_reduce_scatter",
    "rank",
    "world_size",
]

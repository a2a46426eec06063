"""The row interface shared by every listwise loss: query rows against a database, in memory-bounded chunks.

All the losses here are means over queries of a per-query term, so they shard by query rows. A caller (a single
process, or one rank of a job) hands over some query rows ``Q [q, d]`` that are themselves rows ``query_index``
of the database ``E [N, d]``; the driver below walks the queries in chunks of ``c`` rows, forms the similarity
block ``S_cn = Q_c E^T`` and lets the loss family turn it into per-query losses and ``G_cn = dl/dS_cn``. The
gradients then need only two matmuls per chunk:

    dl/dQ_c = G_cn E          dl/dE += G_cn^T Q_c

so no tensor larger than ``c x N`` (or ``c x P x N`` for rank-based losses, P = positives per query) ever
exists, and the chunk size follows from a memory budget.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Work space a chunk may use when the caller gives no budget. On CPU small chunks stay in cache and lose
# nothing; on a GPU large chunks amortise the kernel launches of the per-chunk maths.
DEFAULT_BUDGET_BYTES = {"cpu": 32 * 2**20, "cuda": 1 * 2**30}
# On CPU, the work space the torch path's passes over a block take at a time: they walk its rows in sub-blocks
# this size, which stay in cache from one pass to the next (a core's L2 of 0.5-2 MiB, or its share of L3)
# instead of going to memory for each: each pass is a few instructions per element. Smaller sub-blocks pay
# more eager-op overheads (several microseconds each); 1 and 4 MiB measured alike here, and 4 MiB makes a
# quarter of the ops (benchmarks/results/loss-floor-*.md). On CUDA a pass takes a whole chunk.
CPU_PASS_BYTES = 4 * 2**20
# A chunk's rows are padded to its widest class: at most this many times their own class size (``plan_chunks``).
PADDING_GROWTH = 1.5


@dataclass
class RowsOutput:
    """What a loss returns for a set of query rows.

    Gradients are those of ``sum over valid queries of losses`` (not of the mean): the caller knows the
    global number of valid queries and divides once. They are in the compute dtype (float32, or float64
    for float64 inputs) and are ``None`` when no gradient was asked for.
    """

    losses: Tensor  # [q] per-query loss, 0 where the query is not valid
    valid: Tensor  # [q] bool: the query has a positive and counts in the mean
    grad_queries: Tensor | None  # [q, d]
    grad_database: Tensor | None  # [N, d]

    @property
    def n_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def loss_sum(self) -> Tensor:
        return self.losses.sum()


class Workspace:
    """Buffers reused by every chunk of one ``rows`` call.

    The per-chunk tensors are tens of MB; allocating them afresh for each chunk costs more than the maths on
    CPU (the allocator hands big blocks back to the kernel, and every new one is page-faulted in again: a
    38 MB subtraction took 39 ms into a new tensor and 4 ms into a reused one). A buffer grows to the
    largest size any chunk asks of it and is viewed at the size of each later one.

    Each chunk's buffers fit the memory budget, but each buffer keeps its own largest size: where chunks of
    many rows and few same-class columns come before chunks of few rows and many (the rank losses' torch
    path: the block, then the ``[c, P, N]`` sigmoids), the work space held reaches up to twice the budget
    until the call returns.
    """

    def __init__(self, device: torch.device, pass_bytes: int | None = None, native: bool = False) -> None:
        self.device = device
        self.pass_bytes = pass_bytes  # the passes' sub-blocks (``pass_row_blocks``); None: whole blocks
        self.native = native  # the torch path's passes run compiled for the CPU where a family has them
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised ``[*shape]`` tensor; valid until ``take`` is called with the same name."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


def pass_row_blocks(n_rows: int, bytes_per_row: int, workspace: Workspace) -> list[slice]:
    """The row slices a pass over ``n_rows`` rows walks: as many rows as ``workspace.pass_bytes`` holds at
    ``bytes_per_row`` (at least one), or all of them when it is None."""
    if workspace.pass_bytes is None or n_rows == 0:
        return [slice(0, n_rows)]
    step = max(1, workspace.pass_bytes // max(1, bytes_per_row))
    return [slice(start, min(n_rows, start + step)) for start in range(0, n_rows, step)]


@dataclass
class ChunkInputs:
    """Everything a loss family needs about one chunk of c query rows besides the similarity block."""

    query_labels: Tensor  # [c] int64
    self_columns: Tensor  # [c] int64: the column of each query in the database
    labels: LabelIndex
    max_class_size: int  # P: the largest class among the chunk's queries
    workspace: Workspace
    fused: bool = False  # the block passes run as fused Triton kernels (decided once per call)

    def same_class(self) -> tuple[Tensor, Tensor]:
        """``(index [c, P], mask [c, P])``: the columns sharing each query's label, the query included."""
        return self.labels.same_class(self.query_labels, self.self_columns, self.max_class_size)


class LabelIndex:
    """The database grouped by label, so that the positives of any query are a contiguous slice.

    Built once per ``rows`` call in O(N log N). Losses then reach a chunk's same-class columns through a
    padded ``[c, P]`` index (P the largest class involved) instead of comparing labels over ``[c, N]``.
    """

    def __init__(self, database_labels: Tensor) -> None:
        self.order = torch.argsort(database_labels, stable=True)
        self.classes, self.class_sizes = torch.unique_consecutive(
            database_labels[self.order], return_counts=True
        )
        self.class_starts = torch.cumsum(self.class_sizes, 0) - self.class_sizes

    def class_sizes_of(self, labels: Tensor) -> Tensor:
        """[c] number of database items with each label (the query itself included)."""
        return self.class_sizes[torch.searchsorted(self.classes, labels)]

    def same_class(self, query_labels: Tensor, self_columns: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """Columns sharing each query's label, padded to ``width``: ``(index [c, P], mask [c, P])``.

        ``width`` must be at least the largest class of these queries (known once per call, so no device
        sync per chunk). Padding entries repeat the query's own column (always a same-class column), so that
        writing a value to every indexed column never touches another class; weights must still be
        multiplied by the mask.
        """
        group = torch.searchsorted(self.classes, query_labels)
        sizes = self.class_sizes[group]
        offsets = torch.arange(width, device=query_labels.device)
        mask = offsets[None, :] < sizes[:, None]
        slots = (self.class_starts[group][:, None] + offsets[None, :]).clamp_(max=self.order.numel() - 1)
        index = torch.where(mask, self.order[slots], self_columns[:, None])
        return index, mask


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32 (fp16 sigmoid ranks overflow)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def plan_chunks(
    class_sizes: Sequence[int],
    bytes_per_row: Callable[[int], int],
    budget: int | None,
    device: torch.device,
    override: int | None = None,
) -> list[tuple[int, int, int]]:
    """Chunks over queries sorted by their class size: ``(start, stop, P)`` with ``P`` the largest class in
    the chunk, the width its ``[c, P, N]`` work is padded to.

    Why sorted: a rank-based loss pays ``c x P x N`` per chunk, so one big class among small ones would make
    every chunk pay for it if chunks followed the query order. Sorted, the small-class queries share chunks of
    a small ``P`` (and many rows), the big class's queries chunks of their own. Each chunk holds as many rows
    as fit ``budget`` at its own ``P`` (``override``: a fixed number of rows), and no row whose class is
    narrower than ``P / PADDING_GROWTH``: where the budget alone decides, the chunk at the seam between classes
    of 4 and one of 256 held hundreds of rows of 4 padded to 256 (on CPU a row's budget leaves out the
    ``[P, N]`` passes, which walk sub-blocks), which doubled PNP's time against uniform classes.
    """
    if budget is None:
        budget = DEFAULT_BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    n = len(class_sizes)
    chunks = []
    start = 0
    while start < n:
        if override is not None:
            stop = min(n, start + max(1, int(override)))
        else:
            # Largest stop whose rows fit at the chunk's widest class (sorted: the last row's); at least one.
            # Rows within PADDING_GROWTH of the chunk's narrowest class (sorted: the first row's).
            low, high = (
                start + 1,
                bisect.bisect_right(class_sizes, PADDING_GROWTH * class_sizes[start], lo=start + 1),
            )
            while low < high:
                mid = (low + high + 1) // 2
                if (mid - start) * bytes_per_row(int(class_sizes[mid - 1])) <= budget:
                    low = mid
                else:
                    high = mid - 1
            stop = low
        chunks.append((start, stop, int(class_sizes[stop - 1])))
        start = stop
    return chunks

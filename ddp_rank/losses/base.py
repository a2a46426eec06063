"""``ListwiseLoss``: input checks, the chunked row driver and the single-process autograd wrapper.

A loss family subclasses ``ListwiseLoss`` and implements:

- ``_similarity_affine()``: ``(scale, shift)``; the driver hands the family ``B = shift + scale * S`` straight
  out of one matmul (FastAP wants distances in bin units, the rank losses want ``S / tau``), which saves one
  or two passes over every ``[c, N]`` block, and multiplies the gradient matmuls by ``scale`` in return;
- ``_score_chunk(B_cn, chunk, need_grad)`` turns that block into per-query losses, validity and
  ``G_cn = d(sum of losses)/dB_cn`` (it may overwrite ``B_cn``);
- ``_bytes_per_query_row(n_database, max_positives, itemsize, fused)``: the work space one query row costs
  (on the torch path, or with the fused kernels), so the driver can size chunks from the memory budget.

Everything else (validation (``checks``), normalisation, chunking, the two gradient matmuls, autograd) lives here.
"""

from __future__ import annotations

import abc
import functools
import logging
import warnings
from collections.abc import Callable
from typing import TypedDict, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddp_rank.autocast_off import outside_autocast
from ddp_rank.losses.checks import (
    check_embeddings,
    check_labels,
    check_norms_fit,
    check_rows_inputs,
    check_unit_rows,
)
from ddp_rank.losses.cpu_kernels import native_kernels_run
from ddp_rank.losses.matmul import MATMUL_PRECISIONS, affine_operands, bf16_mm, matmuls_in
from ddp_rank.losses.rows import (
    CPU_PASS_BYTES,
    DEFAULT_BUDGET_BYTES,
    ChunkInputs,
    LabelIndex,
    RowsOutput,
    Workspace,
    compute_dtype,
    plan_chunks,
)
from ddp_rank.losses.triton_kernels import fused_kernels_run, jit_kernels

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


def without_autocast(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a loss method with autocast off on its first tensor's device.

    A user's loop often computes the loss inside the ``torch.autocast`` block of the model's forward. Autocast
    would then run the loss's matmuls in half precision behind its back, and their results would not fit the
    float32 buffers the gradients are written into. The loss has its own precision instead: the compute dtype
    of its inputs and ``matmul_precision``, so its value and gradient are those of the same embeddings outside
    autocast."""

    @functools.wraps(method)
    def outside(self: object, first: Tensor, *args: object, **kwargs: object) -> _T:
        with outside_autocast(first.device):
            return method(self, first, *args, **kwargs)

    return outside


class ListwiseOptions(TypedDict, total=False):
    """The keyword arguments every listwise loss takes, declared once: each loss's ``__init__`` takes its own
    hyper-parameters and ``**options: Unpack[ListwiseOptions]``, which it hands to :class:`ListwiseLoss` (where
    the defaults and their meaning are)."""

    normalize: bool
    memory_budget: int | None
    chunk_rows: int | None
    matmul_precision: str
    kernel: str


class ListwiseLoss(nn.Module, abc.ABC):
    """Base of the listwise losses: ``loss(embeddings [N, d], labels [N]) -> 0-d tensor``.

    Args:
        normalize: L2-normalise the embeddings inside (the gradient flows through the normalisation). With
            ``False`` the rows must already be unit vectors; this is checked.
        memory_budget: bytes of work space one chunk of query rows may use. ``None`` picks 32 MiB on CPU and
            1 GiB on CUDA. Results do not depend on it. The buffers are reused from chunk to chunk, each at its
            largest size, which can hold up to twice the budget at once (``rows.Workspace``).
        chunk_rows: force a number of query rows per chunk (tests, tuning); overrides ``memory_budget``.
        matmul_precision: the similarity matmul ``Q E^T`` of every chunk. ``"highest"``: float32 (or float64);
            ``"tf32"``: TF32 tensor cores on CUDA (10-bit mantissa; float32 on CPU); ``"bf16"``: bfloat16
            operands (8-bit mantissa). Everything after the matmul stays in the compute dtype. A similarity
            moves by a few 1e-3 at most, a small part of a FastAP bin but not of PNP's and Smooth-AP's ``S / tau``;
            averaged over a batch the loss value moves far less, while the gradient moves more, most for FastAP,
            whose distances cross bin edges. ``benchmarks/loss_precision.py`` measures it (value, gradient and
            time; figures in ``benchmarks/results/loss-precision-*.md``); ``tests/losses/test_precision.py``
            bounds it. ``"tf32"`` takes the two gradient matmuls (``G E`` and ``G^T Q``) to TF32 too, as
            ``torch.backends.cuda.matmul.allow_tf32`` would: all three matmuls are the floor of a step, so TF32 on
            one only could not buy more than a third of its speed. ``"bf16"`` leaves them in the compute dtype (a
            bfloat16 gradient operand would round each row's sum to 8 bits).
        kernel: the per-block passes after the matmul. ``"torch"``: plain tensor ops, anywhere. ``"triton"``:
            fused Triton kernels on CUDA float32 (``triton_kernels.py``; elsewhere the torch path runs), which
            read each block once: FastAP's histograms in one pass instead of one per bin, PNP's and Smooth-AP's
            sigmoid ranks without their ``[c, P, N]`` tensor. The same function; sums are rounded in another
            order. ``"auto"`` (the default): the fused kernels on CUDA when the blocks are float32 (float32,
            bfloat16 and float16 inputs are computed in float32) and Triton imports, the torch path elsewhere
            (CPU, float64, no Triton); the choice is logged once per device and dtype. On an H100 at N = 65,536
            the fused kernels took 1.14-1.27x the fp32 matmul floor, the torch path 2.0-3.0x
            (``benchmarks/results/gpu-2026-11-27.md``). On CPU, ``"auto"`` takes the passes compiled for the CPU
            that runs them (``cpu_kernels.py``, built on first use where a C compiler is found) for float32
            blocks: at N = 8,192 on one thread FastAP went from 1.23-1.27x to 0.99-1.03x the floor of its three
            matmuls, PNP-Dq from 1.29-1.33x to 1.09-1.13x (``benchmarks/results/loss-floor-*.md``). PNP's and
            Smooth-AP's are taken on one thread only (``SigmoidRankLoss.takes_native_passes``).
    """

    def __init__(
        self,
        *,
        normalize: bool = True,
        memory_budget: int | None = None,
        chunk_rows: int | None = None,
        matmul_precision: str = "highest",
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {matmul_precision!r}"
            )
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel == "triton" and jit_kernels() is None:
            warnings.warn(
                "kernel='triton' needs Triton, which is not installed: the torch path runs instead "
                "(pip install triton, or set kernel='torch')",
                stacklevel=3,
            )
        self.matmul_precision = matmul_precision
        self.kernel = kernel
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
        if chunk_rows is not None and chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        self.normalize = normalize
        self.memory_budget = memory_budget
        self.chunk_rows = chunk_rows

    # ----------------------------------------------------------------------------------------- family API
    @abc.abstractmethod
    def _similarity_affine(self) -> tuple[float, float]:
        """``(scale, shift)`` such that ``_score_chunk`` receives ``shift + scale * S``."""

    @abc.abstractmethod
    def _score_chunk(
        self, block: Tensor, chunk: ChunkInputs, need_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``B_cn [c, N]`` -> ``(losses [c], valid [c], dl/dB_cn [c, N] or None)``."""

    @abc.abstractmethod
    def _bytes_per_query_row(
        self, n_database: int, max_positives: int, itemsize: int, fused: bool = False
    ) -> int:
        """Peak work space of one query row inside ``_score_chunk`` (``fused``: ``chunk.fused`` is set).

        Families count their ``[N]`` and ``[P, N]`` buffers and add ``SAME_CLASS_BYTES`` per same-class column
        for the ``[c, P]`` index, masks and per-column values, which dominate when a class is a large share of
        the batch.
        """

    # ------------------------------------------------------------------------------------------ public API
    @without_autocast
    def prepare(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Check the inputs and bring the embeddings to unit rows in the compute dtype.

        Returns ``(x, labels)``: ``x`` is differentiable with respect to ``embeddings`` (normalisation and the
        cast to float32 for half inputs happen under autograd), ``labels`` is int64.
        Raises ``ValueError`` naming the problem for wrong shapes or dtypes, NaN / Inf values, or rows that
        are not unit vectors when ``normalize=False``.
        """
        labels = check_labels(labels)
        check_embeddings(embeddings, expected_rows=labels.shape[0])
        x = self.unit_rows(embeddings)
        if self.normalize:
            check_norms_fit(embeddings)
            return x, labels
        check_unit_rows(x, embeddings.dtype)
        return x, labels

    @without_autocast
    def unit_rows(self, embeddings: Tensor) -> Tensor:
        """The rows the loss works on: the compute dtype, L2-normalised when ``normalize``. ``prepare`` applies
        it under autograd; the global loss applies it again, without autograd, to the rows gathered from the
        other ranks in their own dtype, which gives the very same values."""
        x = embeddings.to(compute_dtype(embeddings.dtype))
        return F.normalize(x, dim=1) if self.normalize else x

    @torch.no_grad()
    @without_autocast
    def rows(
        self,
        queries: Tensor,
        query_index: Tensor,
        database: Tensor,
        database_labels: Tensor,
        *,
        need_grad: bool = True,
    ) -> RowsOutput:
        """Per-query losses of ``queries`` (rows ``query_index`` of ``database``) and their gradients.

        Args:
            queries: ``[q, d]`` unit rows (from ``prepare``), no autograd.
            query_index: ``[q]`` int64, the database row of each query (the query is excluded from its own
                positives and negatives by this index, never by value).
            database: ``[N, d]`` unit rows, no autograd.
            database_labels: ``[N]`` int64 class ids.
            need_grad: compute the gradients (two matmuls per chunk and the family's backward maths).
        """
        check_rows_inputs(queries, query_index, database, database_labels)
        dtype = compute_dtype(database.dtype)
        queries, database = queries.to(dtype), database.to(dtype)
        n_queries, n_database = queries.shape[0], database.shape[0]
        labels = LabelIndex(database_labels)
        query_labels = database_labels[query_index]

        losses = queries.new_zeros(n_queries)
        valid = torch.zeros(n_queries, dtype=torch.bool, device=queries.device)
        grad_queries = torch.zeros_like(queries) if need_grad else None
        grad_database = torch.zeros_like(database) if need_grad else None

        # One choice of path for every chunk, so that the plan sizes chunks for the path they take. The compiled
        # CPU passes take the torch path's plan: they replace its passes over the same blocks.
        fused = self.takes_fused_kernels(queries.device, dtype)
        native = not fused and self.takes_native_passes(queries.device, dtype)
        row_bytes, chunk_budget, pass_bytes = self._plan(n_database, dtype, queries.device, fused)
        # Queries sorted by class size, chunked at each chunk's own widest class (one device sync per call).
        sizes = labels.class_sizes_of(query_labels)
        order = torch.argsort(sizes, stable=True)
        sorted_sizes = sizes[order].tolist()
        chunks = plan_chunks(sorted_sizes, row_bytes, chunk_budget, queries.device, self.chunk_rows)
        scale, shift = self._similarity_affine()
        low_precision = self.matmul_precision == "bf16"
        # bf16 operands carry only the scaled similarity; the shift is added after, in the compute dtype.
        scaled_queries, block_database = affine_operands(
            queries, database, scale, 0.0 if low_precision else shift
        )
        if low_precision:
            scaled_queries, block_database = scaled_queries.bfloat16(), block_database.bfloat16()
        workspace = Workspace(queries.device, pass_bytes, native)
        for start, stop, width in chunks:
            idx = order[start:stop]
            q_c = queries[idx]
            chunk = ChunkInputs(query_labels[idx], query_index[idx], labels, width, workspace, fused)
            b_cn = workspace.take("block", (q_c.shape[0], n_database), dtype)
            with matmuls_in(self.matmul_precision):
                if low_precision:
                    b_cn.copy_(bf16_mm(scaled_queries[idx], block_database.T)).add_(shift)
                else:
                    torch.mm(scaled_queries[idx], block_database.T, out=b_cn)
            losses[idx], valid[idx], g_cn = self._score_chunk(b_cn, chunk, need_grad)
            if need_grad:
                assert g_cn is not None and grad_queries is not None and grad_database is not None
                with matmuls_in(self.matmul_precision):
                    grad_queries[idx] = torch.mm(g_cn, database).mul_(scale)
                    grad_database.addmm_(g_cn.T, q_c, alpha=scale)
        return RowsOutput(losses, valid, grad_queries, grad_database)

    def takes_fused_kernels(self, device: torch.device, dtype: torch.dtype, log: bool = True) -> bool:
        """Whether a call's blocks of ``dtype`` (the compute dtype) on ``device`` take the fused Triton kernels.

        ``"triton"``: wherever they run (CUDA float32, or CPU under Triton's interpreter, which the tests use);
        ``"auto"``: on CUDA float32 only, when Triton imports and the GPU is one Triton compiles for
        (:func:`cuda_below_triton`; never the interpreter: it is for tests), logged
        once per device type and dtype (``log``); ``"torch"``: never. Decided once per call (no device sync), so
        that the chunk plan and every chunk agree on the path."""
        if self.kernel == "torch":
            return False
        if self.kernel == "triton":
            return fused_kernels_run(device, dtype)
        fused = device.type == "cuda" and fused_kernels_run(device, dtype)
        below = cuda_below_triton(device) if fused else None
        if log:
            native = not fused and self.takes_native_passes(device, dtype)
            _log_auto_kernel(device.type, dtype, fused and not below, native, below)
        return fused and not below

    def takes_native_passes(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a call's blocks take the passes compiled for the CPU (``cpu_kernels.py``): with
        ``kernel="auto"``, for float32 blocks on CPU, where they build."""
        return self.kernel == "auto" and native_kernels_run(device, dtype)

    def _plan(
        self, n_database: int, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> tuple[Callable[[int], int], int, int | None]:
        """``(row_bytes, chunk_budget, pass_bytes)``: the work space one query row of a chunk holds at the
        chunk's widest class, the budget its chunks share, and the size of the sub-blocks the torch path's
        passes walk (None: whole chunks).

        On CPU the torch path's per-block passes (``_pass_bytes_per_query_row``) walk sub-blocks of
        ``rows.CPU_PASS_BYTES`` per thread (at most half the budget) that stay in cache, so a chunk's rows
        hold only the rest, and the similarity and gradient matmuls get chunks of many rows, as they run
        best. On CUDA (or fused) a chunk's passes take it whole."""
        budget = self.memory_budget or DEFAULT_BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
        # bf16 similarity operands: their float32 product exists beside the block until it is copied in.
        product_bytes = n_database * 4 if self.matmul_precision == "bf16" else 0
        itemsize = dtype.itemsize
        if device.type == "cuda" or fused:
            return (
                lambda width: (
                    product_bytes + self._bytes_per_query_row(n_database, width, itemsize, fused=fused)
                ),
                budget,
                None,
            )
        # Each thread takes its share of a pass, in its own core's cache.
        pass_bytes = min(CPU_PASS_BYTES * torch.get_num_threads(), budget // 2)
        return (
            lambda width: (
                product_bytes
                + self._bytes_per_query_row(n_database, width, itemsize, fused=False)
                - self._pass_bytes_per_query_row(n_database, width, itemsize)
            ),
            budget - pass_bytes,
            pass_bytes,
        )

    def _pass_bytes_per_query_row(self, n_database: int, max_positives: int, itemsize: int) -> int:
        """The part of ``_bytes_per_query_row`` (torch path) that only the per-block passes hold, which they
        may take a sub-block of rows at a time (``rows.pass_row_blocks``). 0 unless a family says otherwise."""
        return 0

    def work_space(
        self,
        n_queries: int,
        n_database: int,
        max_positives: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> tuple[int, int]:
        """``(bytes, rows)``: the work space the largest chunk of query rows takes and its row count, for
        ``n_queries`` queries whose classes have at most ``max_positives`` members against ``n_database`` rows,
        on ``device``: the plan ``rows`` would make, without any data (``ddp-rank plan`` reports it). The
        budget bounds it; each buffer keeps its own largest size, so what stays held can reach twice that."""
        device = torch.device(device)
        cdtype = compute_dtype(dtype)
        fused = self.takes_fused_kernels(device, cdtype, log=False)
        row_bytes, chunk_budget, pass_bytes = self._plan(n_database, cdtype, device, fused)
        chunks = plan_chunks([max_positives] * n_queries, row_bytes, chunk_budget, device, self.chunk_rows)
        rows = max((stop - start for start, stop, _ in chunks), default=0)
        work = rows * row_bytes(max_positives)
        if pass_bytes is not None:  # one sub-block of the passes: whole rows, at least one
            pass_row = self._pass_bytes_per_query_row(n_database, max_positives, cdtype.itemsize)
            work += min(rows, max(1, pass_bytes // max(1, pass_row))) * pass_row
        return work, rows

    @without_autocast
    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """Mean per-query loss over the queries that have a positive (0 with a zero gradient if none)."""
        x, labels = self.prepare(embeddings, labels)
        # No gradient work when autograd will not ask for it (evaluation under no_grad, frozen inputs).
        need_grad = torch.is_grad_enabled() and x.requires_grad
        return _ListwiseLossFunction.apply(x, labels, self, need_grad)

    def signature(self) -> str:
        """The loss and its hyper-parameters, as the ranks of a global loss must agree on them."""
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(self.hyper_parameters().items()))
        return f"{type(self).__name__}({settings})"

    def hyper_parameters(self) -> dict[str, object]:
        """What decides the loss's value (families add theirs); the memory settings do not."""
        return {"normalize": self.normalize, "matmul_precision": self.matmul_precision}


class _ListwiseLossFunction(torch.autograd.Function):
    """Single-process loss on prepared rows: every row is a query against the whole batch.

    The gradient is computed with the loss (it costs the same chunked pass) and kept for backward, which
    only scales it by ``grad_output``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, labels: Tensor, loss: ListwiseLoss, need_grad: bool) -> Tensor:
        x_rows = x.detach()
        everyone = torch.arange(x.shape[0], device=x.device)
        out = loss.rows(x_rows, everyone, x_rows, labels, need_grad=need_grad and ctx.needs_input_grad[0])
        n_valid = out.n_valid
        scale = 1.0 / n_valid if n_valid else 0.0
        if out.grad_database is not None and out.grad_queries is not None:
            ctx.save_for_backward(out.grad_database.add_(out.grad_queries).mul_(scale))
        return out.loss_sum * scale

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, None, None, None]:
        refuse_double_backward()
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


KERNELS = ("auto", "torch", "triton")
# Work space per same-class column of a query row: the int64 index, bool masks, and a dozen float [c, P]
# values (scores, ranks, penalties, weights, gradients), with room to spare.
SAME_CLASS_BYTES = 128


def cuda_below_triton(device: torch.device) -> str | None:
    """Why the CUDA ``device`` cannot take the fused kernels (None: it can): Triton compiles for NVIDIA GPUs of
    compute capability 7.0 and up (torch's own inductor refuses older ones), and the kernels were never run on
    ROCm. Asked of the driver once per device (cached by torch), no stream sync. Without a visible GPU (a plan
    made for a GPU on another machine) the GPU is taken to be one Triton compiles for."""
    if torch.version.hip is not None:
        return f"ROCm (HIP {torch.version.hip}): the fused kernels are tested on NVIDIA GPUs only"
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (7, 0):
        return f"compute capability {major}.{minor} is below Triton's 7.0"
    return None


@functools.cache
def _log_auto_kernel(
    device_type: str, dtype: torch.dtype, fused: bool, native: bool = False, below: str | None = None
) -> None:
    """Say once per process, device type and dtype which path ``kernel="auto"`` took (not once per call)."""
    if native:
        _log.info("loss kernel=auto: the passes compiled for this CPU for %s blocks", _dtype_name(dtype))
    elif below:
        _log.info("loss kernel=auto: the torch path on cuda, as %s", below)
    elif fused:
        _log.info(
            "loss kernel=auto: the fused Triton kernels for %s blocks on %s", _dtype_name(dtype), device_type
        )
    elif device_type == "cuda" and dtype == torch.float32:
        _log.info(
            "loss kernel=auto: the torch path on cuda, as Triton does not import (pip install triton for the "
            "fused kernels, about 2x faster at N = 65,536)"
        )
    else:
        _log.info(
            "loss kernel=auto: the torch path for %s blocks on %s (the fused Triton kernels take float32 on CUDA)",
            _dtype_name(dtype),
            device_type,
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refuse_double_backward() -> None:
    """Raise when a backward runs with ``create_graph=True`` (autograd enables grad mode only then).

    The listwise gradients are closed forms computed in the forward pass, with no graph of their own, so a
    second derivative through them would silently be wrong; ``torch.autograd.function.once_differentiable``
    alone would not catch it (it only flags gradients whose ``grad_output`` requires grad, and a scalar loss's
    ``grad_output`` does not).
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            "the listwise losses are once-differentiable: their gradient is a closed form with no graph, so "
            "create_graph=True (double backward, Hessian-vector products) is not supported"
        )

"""The loss of the GLOBAL batch across ranks, with exact gradients, at N_local x N cost per rank.

Every listwise loss here is a mean over queries of a per-query term, so rank r only computes the rows of its
own queries against the gathered database and the ranks share one normaliser:

    L = (1 / V) * sum_r sum_{q local to r, valid} l_q(E)          V = number of valid queries, all ranks

Gradient convention (stated once for the package)
--------------------------------------------------
The loss value returned on every rank is the global ``L``. The gradient each rank hands to its embeddings is
``dL/de_r`` (the rows of the single-process gradient that rank r owns) multiplied by the world size W when
``grad_reduction="mean"``. Why: the parameter gradient of the global loss is a sum over ranks,
``dL/dtheta = sum_r (dL/de_r)(de_r/dtheta)``, rank r back-propagates only its term, and DDP and DeepSpeed ZeRO
AVERAGE parameter gradients over ranks: ``(1/W) sum_r W (dL/de_r)(de_r/dtheta) = dL/dtheta``. With
``grad_reduction="sum"`` (engines that sum) no factor is applied. Under that rule the averaged (or summed) parameter gradients of a W-process step equal the
gradients of one process computing the same loss on the concatenated global batch, for uneven local sizes and
ranks with no sample too, provided every rank back-propagates the returned loss with the same
``grad_output`` (``loss.backward()`` or the same loss scale on every rank) and the model itself is
batch-independent (no BatchNorm in train mode: its statistics are per rank).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ddp_rank.distributed.agreement import RankFailure
from ddp_rank.distributed.any_loss import (
    LossCallable,
    MinerCallable,
    any_failed,
    check_wrappable,
    gathered_loss,
    loss_signature,
)
from ddp_rank.distributed.collectives import (
    CommCounter,
    all_gather_ints,
    all_reduce_sum,
    padded_all_gather,
    padded_reduce_scatter,
)
from ddp_rank.distributed.process_group import ProcessGroup, is_distributed, rank, world_size
from ddp_rank.losses import ListwiseLoss
from ddp_rank.losses.base import refuse_double_backward

GradReduction = Literal["mean", "sum"]

# Fixed codes so that ranks can compare dtypes through an integer all-gather.
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}


@dataclass(frozen=True)
class GlobalLayout:
    """Where each rank's rows sit in the gathered database: rank r owns rows offsets[r]:offsets[r]+sizes[r]."""

    sizes: tuple[int, ...]
    rank: int

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def local_rows(self) -> slice:
        return slice(self.offset, self.offset + self.sizes[self.rank])


@dataclass(frozen=True)
class _Wire:
    """How one call's collectives run: the layout, the dtypes on the wire, the scale, the group."""

    layout: GlobalLayout
    label_dtype: torch.dtype
    grad_dtype: torch.dtype | None
    grad_scale: float
    need_grad: bool
    group: ProcessGroup | None
    counter: CommCounter | None


class GlobalBatchLossFunction(torch.autograd.Function):
    """Global-batch listwise loss: local prepared rows in, the global loss out, a reduce-scatter backward.

    Shapes on rank r (W ranks, n_r local rows, N = sum_r n_r, d embedding width):

        | tensor                   | shape    | note                                                   |
        |--------------------------|----------|--------------------------------------------------------|
        | x_r (input)              | [n_r, d] | prepared (unit) rows, compute dtype                    |
        | y_r (input)              | [n_r]    | int64 class ids, global meaning                        |
        | e_r (input, sent)        | [n_r, d] | the raw embeddings, in their own dtype (bf16: 2 bytes) |
        | E = unit(all_gather(e))  | [N, d]   | detached; rank r's rows at layout.local_rows equal x_r |
        | G_Q = d(sum l)/dQ_r      | [n_r, d] | local queries' side of the local loss rows             |
        | G_E = d(sum l)/dE        | [N, d]   | database side of rank r's loss rows, for every rank    |
        | output                   | []       | global loss L, identical on every rank                 |
        | grad x_r                 | [n_r, d] | c * (reduce_scatter_SUM(G_E)_r + G_Q) / V              |

    Forward: gather the raw embeddings in their own dtype and the labels in the smallest integer type that
    holds every rank's ids (padded, uneven sizes allowed), bring them to unit rows in the compute dtype exactly
    as ``loss.prepare`` did locally, compute the rows of the local queries (``loss.rows``), all-reduce
    ``[sum of local losses, local valid count, failed]`` into ``[S, V, F]`` and return ``S / max(V, 1)``. An
    exception inside ``loss.rows`` on any rank (out of memory, say) is raised on every rank after that
    all-reduce, with the failing ranks' messages, instead of leaving the others in the next collective.

    Backward: the local loss rows depend on every rank's embeddings through E, so rank r holds a piece of the
    gradient of every rank's rows. Reduce-scatter(SUM) sends each piece to its owner (in float32 unless the
    loss was built with another ``grad_dtype``), which adds its query-side rows: that is exactly the owner's
    rows of ``dL/dE`` (times V). ``c = grad_output * grad_scale`` where ``grad_scale`` is W for
    ``grad_reduction="mean"`` and 1 for ``"sum"`` (see the module docstring). ``grad_output`` is applied on
    the sending side, so it must be equal on all ranks. The backward has no graph of its own: a double
    backward is refused.

    Why the gradient is computed in forward: ``loss.rows`` produces the loss and both gradients in the same
    chunked pass for little more than the loss alone, and it keeps backward to one collective.
    """

    @staticmethod
    def forward(
        ctx, x_local: Tensor, labels_local: Tensor, sent: Tensor, loss: ListwiseLoss, wire: _Wire
    ) -> Tensor:
        layout, group, counter = wire.layout, wire.group, wire.counter
        database = loss.unit_rows(padded_all_gather(sent, layout.sizes, group, counter))
        database_labels = padded_all_gather(labels_local.to(wire.label_dtype), layout.sizes, group, counter)
        rows = layout.local_rows
        query_index = torch.arange(rows.start, rows.stop, device=database.device)
        failure: BaseException | None = None
        try:
            out = loss.rows(
                database[rows], query_index, database, database_labels.long(), need_grad=wire.need_grad
            )
            local = torch.stack(
                [out.loss_sum, out.losses.new_tensor(float(out.n_valid)), out.losses.new_zeros(())]
            )
        except Exception as exc:  # shared with every rank below, then raised everywhere
            failure = exc
            local = database.new_tensor([0.0, 0.0, 1.0])
        loss_sum, n_valid, failed = all_reduce_sum(local, group, counter).unbind()
        if float(failed) > 0:
            raise_everywhere(failure, group)
        normaliser = max(float(n_valid), 1.0)
        ctx.wire = wire
        ctx.scale = wire.grad_scale / normaliser
        ctx.input_dtype = x_local.dtype
        if out.grad_queries is not None and out.grad_database is not None:
            ctx.save_for_backward(out.grad_queries, out.grad_database)
        return loss_sum / normaliser

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward()
        grad_queries, grad_database = ctx.saved_tensors
        wire = ctx.wire
        factor = grad_output.to(grad_database.dtype) * ctx.scale
        sent = grad_database * factor
        sent = sent.to(wire.grad_dtype) if wire.grad_dtype is not None else sent
        owned = padded_reduce_scatter(sent, wire.layout.sizes, wire.group, wire.counter).to(
            grad_queries.dtype
        )
        grad_x = owned + grad_queries * factor
        return grad_x.to(ctx.input_dtype), None, None, None, None


def raise_everywhere(failure: BaseException | None, group: ProcessGroup | None) -> None:
    """Collective (called by every rank once some rank failed): raise the failing ranks' errors on all ranks."""
    messages: list[object] = [None] * world_size(group)
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    torch.distributed.all_gather_object(messages, mine, group=group)
    failed = {r: m for r, m in enumerate(messages) if m is not None}
    summary = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    raise RankFailure(f"the global-batch loss failed on rank(s) {sorted(failed)}: {summary}") from failure


class GlobalBatchLoss(nn.Module):
    """Wrap a loss so that it is computed over the global batch of all ranks of `group`.

    ``global_loss(local_embeddings [n_r, d], local_labels [n_r]) -> 0-d global loss`` on every rank; local sizes
    may differ between ranks and may be 0. Labels must be global class ids (the same class has the same id on
    every rank). Without a process group, or with world size 1, this is exactly ``loss(embeddings, labels)``
    (``loss(embeddings, labels, miner(embeddings, labels))`` with a miner).

    Two paths, one convention. A ddp_rank listwise loss (FastAP, PNP, Smooth-AP) is row-split: each rank computes
    only its own queries' rows (N_local x N). Any other loss called as ``loss(embeddings, labels)`` (every
    pytorch-metric-learning loss, a user's own) takes the generic path (``any_loss``): the gathered batch on
    every rank, the whole loss computed everywhere, autograd only through this rank's rows (N x N per rank).
    Either way the value is the single-process loss of the concatenated batch on every rank, and the gradient
    of this rank's embeddings follows ``grad_reduction``. A loss with parameters of its own (ProxyAnchor,
    ProxyNCA, SoftTriple) gets their FULL single-process gradient on every rank: average those gradients over
    the ranks (or leave them as they are, equal everywhere), never sum them. Anything else is refused here.

    Args:
        loss: a listwise loss (used through its ``prepare`` and ``rows`` methods) or any loss module or
            function called as ``loss(embeddings, labels)``.
        miner: generic path only: ``miner(embeddings, labels) -> indices`` run on the GLOBAL batch, whose result
            is passed as ``loss(embeddings, labels, indices)`` (pytorch-metric-learning miners and losses).
        group: the process group to span (default: the default group).
        grad_reduction: ``"mean"`` when the engine averages parameter gradients over ranks (DDP, DeepSpeed
            ZeRO, accelerate), ``"sum"`` when it sums them. See the module docstring for the convention.
        comm_counter: optional ``CommCounter`` that records the bytes this module's collectives send.
        grad_dtype: dtype of the gradient rows the backward reduce-scatters (row-split path; the generic path
            sends no gradient); ``None`` (default) keeps the compute dtype (float32, float64 for float64
            inputs); ``torch.bfloat16`` halves those bytes at about 3 significant digits. Embeddings always travel in their own dtype (bf16 / fp16 inputs: half the
            bytes of float32), labels in the smallest integer type that holds every rank's ids.

    Every rank must call it at the same step (it runs collectives), in the same grad mode, with the same loss
    and hyper-parameters, and call ``backward`` on the result if any rank does. Invalid inputs, a different
    loss, or an exception inside the loss on one rank raise on every rank (the ranks exchange a small status
    vector first and a failure flag with the loss sums), so a bad batch fails the job instead of hanging it.

    Examples:
        Each rank passes its own rows and global class ids; without a process group (or with one process) the
        wrapper is the wrapped loss itself, so the same code runs on a laptop and on W GPUs:

        >>> import torch
        >>> from ddp_rank.distributed import GlobalBatchLoss
        >>> from ddp_rank.losses import PNPLoss
        >>> generator = torch.Generator().manual_seed(0)
        >>> embeddings = torch.randn(32, 8, generator=generator, requires_grad=True)
        >>> labels = torch.arange(32) // 4
        >>> global_loss = GlobalBatchLoss(PNPLoss("Dq"), grad_reduction="mean")
        >>> loss = global_loss(embeddings, labels)
        >>> bool(loss == PNPLoss("Dq")(embeddings, labels))
        True
        >>> loss.backward()

        Under ``torchrun`` or ``accelerate launch`` every rank gets the loss of the whole global batch
        (``docs/losses/global-batch.md`` runs it on 2 processes).
    """

    def __init__(
        self,
        loss: ListwiseLoss | LossCallable,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        comm_counter: CommCounter | None = None,
        grad_dtype: torch.dtype | None = None,
        miner: MinerCallable | None = None,
    ) -> None:
        super().__init__()
        check_wrappable(loss, miner, listwise=isinstance(loss, ListwiseLoss))
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' (DDP, ZeRO) or 'sum', got {grad_reduction!r}")
        if grad_dtype not in (None, torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(
                f"grad_dtype must be None (the compute dtype) or a floating dtype, got {grad_dtype}"
            )
        self.loss = loss
        self.miner = miner
        self.group = group
        self.grad_reduction = grad_reduction
        self.comm_counter = comm_counter
        self.grad_dtype = grad_dtype

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if not is_distributed(self.group):
            if self.miner is not None:
                return self.loss(embeddings, labels, self.miner(embeddings, labels))
            return self.loss(embeddings, labels)
        if not isinstance(self.loss, ListwiseLoss):
            return self._generic(embeddings, labels)
        x, labels, problem = _prepare_or_report(self.loss, embeddings, labels)
        need_grad = torch.is_grad_enabled() and x.requires_grad
        meta = exchange_layout(
            x,
            embeddings.dtype,
            labels,
            problem,
            self.loss.signature(),
            need_grad,
            self.group,
            self.comm_counter,
        )
        wire = _Wire(
            layout=meta.layout,
            label_dtype=meta.label_dtype,
            grad_dtype=self.grad_dtype,
            grad_scale=float(world_size(self.group)) if self.grad_reduction == "mean" else 1.0,
            need_grad=need_grad,
            group=self.group,
            counter=self.comm_counter,
        )
        return GlobalBatchLossFunction.apply(x, labels, embeddings.detach(), self.loss, wire)

    def _generic(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """Any other loss: the whole loss on the gathered batch, gradients through this rank's rows (any_loss)."""
        problem = _generic_input_problem(embeddings, labels)
        need_grad = torch.is_grad_enabled() and embeddings.requires_grad
        signature = loss_signature(self.loss, self.miner)
        meta = exchange_layout(
            embeddings, embeddings.dtype, labels, problem, signature, need_grad, self.group, self.comm_counter
        )
        value, failure = gathered_loss(
            self.loss,
            self.miner,
            embeddings,
            labels,
            meta.layout.sizes,
            meta.layout.rank,
            meta.label_dtype,
            float(world_size(self.group)) if self.grad_reduction == "mean" else 1.0,
            self.group,
            self.comm_counter,
        )
        if any_failed(value is None, embeddings.device, self.group, self.comm_counter):
            raise_everywhere(failure, self.group)
        assert value is not None
        return value

    def extra_repr(self) -> str:
        return f"grad_reduction={self.grad_reduction!r}"


def global_batch_loss(
    loss: ListwiseLoss | LossCallable,
    embeddings: Tensor,
    labels: Tensor,
    group: ProcessGroup | None = None,
    grad_reduction: GradReduction = "mean",
) -> Tensor:
    """Functional form of ``GlobalBatchLoss(loss, group, grad_reduction)(embeddings, labels)``."""
    return GlobalBatchLoss(loss, group, grad_reduction)(embeddings, labels)


def _generic_input_problem(embeddings: Tensor, labels: Tensor) -> ValueError | None:
    """The checks the generic path can make without knowing the loss: shapes and an integer label dtype."""
    if embeddings.dim() != 2:
        return ValueError(f"embeddings must be [n, d], got shape {tuple(embeddings.shape)}")
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        return ValueError(
            f"labels must be [n] with n = {embeddings.shape[0]} (the embeddings' rows), got {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return ValueError(f"labels must be integer class ids, got {labels.dtype}")
    return None


def _prepare_or_report(
    loss: ListwiseLoss, embeddings: Tensor, labels: Tensor
) -> tuple[Tensor, Tensor, ValueError | None]:
    """``loss.prepare``, but a rejected input is returned instead of raised, to be reported on every rank."""
    try:
        x, labels = loss.prepare(embeddings, labels)
    except ValueError as error:
        return embeddings, labels, error
    return x, labels, None


@dataclass(frozen=True)
class _Meta:
    layout: GlobalLayout
    label_dtype: torch.dtype


def _label_dtype(low: int, high: int) -> torch.dtype:
    """The smallest integer dtype that holds every class id in [low, high] (no int16: gloo and NCCL lack it)."""
    for dtype in (torch.int8, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return torch.int64


def exchange_layout(
    x: Tensor,
    wire_dtype: torch.dtype,
    labels: Tensor,
    problem: ValueError | None,
    signature_text: str,
    need_grad: bool,
    group: ProcessGroup | None,
    counter: CommCounter | None = None,
) -> _Meta:
    """All-gather ``[rows, width, dtype, grad, failed, loss signature, min label, max label]`` and check that
    the ranks agree.

    ``wire_dtype`` is the dtype the rows are gathered in (the caller's, not ``x``'s compute dtype: fp16 and
    bf16 both prepare to float32, but travel as 2-byte values that the receiver must read in the same format).

    Raises ``ValueError`` on every rank when a rank rejected its inputs, or when ranks disagree on the
    embedding width, wire dtype, grad mode or the loss and its hyper-parameters (any of which would otherwise
    hang, corrupt the collectives or mix two different losses into one number).
    """
    me = rank(group)
    signature = zlib.crc32(signature_text.encode("utf-8"))
    low, high = 0, 0
    if labels.numel() and problem is None:  # one device sync for both ends (this runs every step)
        low, high = torch.stack(torch.aminmax(labels)).tolist()
    if problem is None:
        code = _DTYPE_CODES.get(wire_dtype, 0)
        mine = [x.shape[0], x.shape[1], code, int(need_grad), 0, signature, low, high]
    else:
        mine = [0, 0, 0, 0, 1, signature, 0, 0]
    meta = all_gather_ints(mine, group, counter)
    failed = [r for r in range(meta.shape[0]) if meta[r, 4]]
    if problem is not None:
        raise ValueError(f"rank {me}: {problem}") from problem
    if failed:
        raise ValueError(
            f"rank(s) {failed} rejected their inputs to the global-batch loss (see their errors)"
        )
    if len(set(meta[:, 5].tolist())) > 1:
        signatures: list[object] = [None] * meta.shape[0]
        torch.distributed.all_gather_object(signatures, signature_text, group=group)
        shown = "; ".join(f"rank {r}: {sig}" for r, sig in enumerate(signatures))
        raise ValueError(
            f"ranks run different losses or hyper-parameters ({shown}): build the same loss everywhere"
        )
    for column, what in ((1, "embedding width d"), (2, "embedding dtype"), (3, "grad mode (requires_grad)")):
        values = meta[:, column].tolist()
        if len(set(values)) > 1:
            if column == 2:
                values = [_DTYPE_NAMES.get(code, "other") for code in values]
                what += " (cast every rank's embeddings to one dtype, empty ones too)"
            raise ValueError(f"ranks disagree on the {what}: {values} (rank order)")
    rows = meta[:, 0].tolist()
    has_rows = [r for r in range(meta.shape[0]) if rows[r]]
    low = min((int(meta[r, 6]) for r in has_rows), default=0)
    high = max((int(meta[r, 7]) for r in has_rows), default=0)
    return _Meta(GlobalLayout(sizes=tuple(rows), rank=me), _label_dtype(low, high))

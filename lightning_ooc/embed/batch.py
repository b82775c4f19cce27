"""The minibatch of partition-buffer embedding training, and how a model hands its updates back.

A batch is a slice of one edge bucket ``(i, j)``: edges whose source lies in
node partition ``i`` and destination in partition ``j``, both resident in the
partition buffer. It carries row indices into the buffer, never embedding
rows: ``weight`` and ``state`` are the buffer's own tensors (on the training
device), and the model updates the rows it used in place with a sparse
Adagrad step (:func:`lightning_ooc.embed.optim.sparse_adagrad_`), then calls
:meth:`EmbeddingBatch.done`, which lets the buffer write back a partition
that no later batch of this state touches.

Negatives are shared by chunks of edges (as PyTorch-BigGraph and Legend do):
the batch's edges ``[c * chunk_size, (c + 1) * chunk_size)`` form chunk ``c``
and all share the ``K`` negative rows ``neg_dst_rows[c]`` (tails drawn from
partition ``j``, replacing ``dst``) and ``neg_src_rows[c]`` (heads drawn from
partition ``i``, replacing ``src``). The last chunk may be shorter.

Evaluation batches may also carry filters: ``dst_filter`` is a ``[2, F]``
tensor of ``(edge position in the batch, negative position)`` pairs whose
negative tail is a known true edge for that edge's ``(src, rel)``; their
scores are to be ignored when ranking (the "filtered" setting). ``src_filter``
likewise for head corruption.

Example::

    >>> import torch
    >>> from lightning_ooc.embed.batch import EmbeddingBatch
    >>> w = torch.randn(10, 4); s = torch.zeros(10, 4)
    >>> b = EmbeddingBatch(src=torch.tensor([0, 1, 2]), dst=torch.tensor([5, 6, 7]), rel=torch.zeros(3, dtype=torch.long),
    ...                    src_rows=torch.tensor([0, 1, 2]), dst_rows=torch.tensor([5, 6, 7]),
    ...                    neg_src_rows=torch.tensor([[3, 4]]), neg_dst_rows=torch.tensor([[8, 9]]),
    ...                    chunk_size=3, weight=w, state=s)
    >>> b.num_chunks, b.num_negatives, len(b)
    (1, 2, 3)
    >>> b.done(); b.is_done
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from lightning_ooc.errors import BatchKindError


#: fields of a PyG minibatch that a model for node features reads; an embedding batch has none of them
_PYG_FIELDS = frozenset({"x", "edge_index", "y", "n_id", "edge_label_index", "edge_label", "node_types"})


@dataclass
class EmbeddingBatch:
    #: global node ids of the edges' sources and destinations, ``[B]`` (int64, on the training device)
    src: Tensor
    dst: Tensor
    #: relation id of each edge, ``[B]`` (all zero for a graph of one relation)
    rel: Tensor
    #: rows of ``src`` and ``dst`` in ``weight`` / ``state``, ``[B]``
    src_rows: Tensor
    dst_rows: Tensor
    #: shared negatives per chunk, ``[num_chunks, K]`` rows of ``weight``: heads from the source
    #: partition, tails from the destination partition
    neg_src_rows: Tensor
    neg_dst_rows: Tensor
    #: edges per chunk of shared negatives (the last chunk may be shorter)
    chunk_size: int
    #: the buffer's embedding rows and Adagrad state (sum of squared gradients), ``[R, dim]`` each;
    #: views into the partition buffer, updated in place
    weight: Tensor
    state: Tensor
    #: evaluation only: ``[2, F]`` (edge position, negative position) pairs to ignore (filtered ranking)
    src_filter: Tensor | None = None
    dst_filter: Tensor | None = None
    #: global ids of the shared negatives, ``[num_chunks, K]`` (what ``neg_src_rows``/``neg_dst_rows`` index)
    neg_src: Tensor | None = None
    neg_dst: Tensor | None = None
    #: "train", "val" or "test"
    split: str = "train"
    #: the bucket ``(i, j)`` this batch comes from, the epoch, and its sequence number in the pass
    bucket: tuple[int, int] = (0, 0)
    epoch: int = 0
    index: int = 0
    #: the buffer state (position in the pass's partition order) the batch is trained in, and whether it
    #: comes "before" that state's swap or "during" it
    state_index: int = 0
    phase: str = "before"
    #: called once by :meth:`done` (set by the pass that made the batch)
    on_done: Callable[["EmbeddingBatch"], None] | None = field(default=None, repr=False)
    is_done: bool = field(default=False, repr=False)

    def __getattr__(self, name: str):
        if name in _PYG_FIELDS:  # a GNN of node features given embedding batches: say what to use instead
            raise BatchKindError(
                f"the model read batch.{name}, but OutOfCoreEmbeddingData gives embedding batches (edges and rows "
                "of an embedding table, no node features); train it with a KGE model (lightning_ooc.models.DistMult, "
                "ComplEx, DotKGE), or give a GNN the table as learnable features: OutOfCoreNodeData(root, "
                "features=Learnable(table=TABLE))")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __len__(self) -> int:
        return int(self.src.numel())

    @property
    def batch_size(self) -> int:
        return len(self)

    @property
    def num_chunks(self) -> int:
        return int(self.neg_dst_rows.shape[0])

    @property
    def num_negatives(self) -> int:
        return int(self.neg_dst_rows.shape[1])

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of each chunk's edges."""
        n, c = len(self), int(self.chunk_size)
        return [(k * c, min(n, (k + 1) * c)) for k in range(max(1, math.ceil(n / c)) if n else 0)]

    def chunk_of_edge(self) -> Tensor:
        """The chunk of every edge, ``[B]`` (on the device of ``src``)."""
        return torch.div(torch.arange(len(self), device=self.src.device), int(self.chunk_size), rounding_mode="floor")

    def done(self) -> None:
        """Say that this batch's updates to ``weight`` and ``state`` are applied (idempotent)."""
        if not self.is_done:
            self.is_done = True
            if self.on_done is not None:
                self.on_done(self)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "EmbeddingBatch":
        """Index tensors moved to ``device`` (``weight`` and ``state`` stay where the buffer keeps them)."""
        kw = {"non_blocking": non_blocking}
        moved = {name: None if getattr(self, name) is None else getattr(self, name).to(device, **kw)
                 for name in _INDEX_FIELDS}  # fmt: skip
        out = EmbeddingBatch(**moved, chunk_size=self.chunk_size, weight=self.weight, state=self.state,
                             split=self.split, bucket=self.bucket, epoch=self.epoch, index=self.index,
                             state_index=self.state_index, phase=self.phase, on_done=None)
        out.on_done = (lambda _b, src=self: src.done())
        out.is_done = self.is_done
        return out


#: the index tensors a batch moves to the training device
_INDEX_FIELDS = ("src", "dst", "rel", "src_rows", "dst_rows", "neg_src_rows", "neg_dst_rows", "src_filter",
                 "dst_filter", "neg_src", "neg_dst")

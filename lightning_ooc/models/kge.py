"""Knowledge-graph embedding models trained on a partition buffer: dot, DistMult and ComplEx.

The node embeddings are not parameters of the module: they are rows of the
partition buffer, reached through an :class:`~lightning_ooc.embed.batch.EmbeddingBatch`
(``batch.weight``, with Adagrad's state in ``batch.state``). A training step
gathers the rows the batch uses (its edges' heads and tails and the chunk's
shared negatives), scores them, backpropagates once, steps the relation
embeddings (an ``nn.Embedding`` trained by a dense ``torch.optim.Adagrad``)
and then updates the gathered node rows in place with
:func:`~lightning_ooc.embed.optim.sparse_adagrad_`, every gradient computed
before any row changes; last it calls ``batch.done()``. The module uses
Lightning's manual optimization.

Scores of an edge ``(h, r, t)`` with ``dim``-wide rows:

* ``"dot"``: ``<h, t>`` (relations ignored; the model has no relation parameters);
* ``"distmult"``: ``sum(h * r * t)``; relations start at ones (DistMult starts as ``dot``);
* ``"complex"``: ``Re(<h, r, conj(t)>)`` where a row's first ``dim / 2`` entries are the real part and the
  last ``dim / 2`` the imaginary part (``dim`` must be even); relations start at ``1 + 0i`` (the identity
  rotation: ComplEx starts as ``dot``).

Every score is a dot product of a query with the candidate rows (``h * r``
against tails, ``r * t`` against heads, complex products for ComplEx), so the
edges of a chunk are scored against their ``K`` shared negatives by one
batched matrix product: the batch's tail and head corruptions give ``[B, K]``
scores each. The ``"softmax"`` loss (PyTorch-BigGraph's and Marius's default)
is the cross-entropy of each edge's ``[positive, K negatives]`` logits with the
positive as the target, summed over both corruptions and averaged over edges;
``"ranking"`` is ``relu(margin - positive + negative)``, averaged over edges
and negatives and summed over both corruptions.

Evaluation ranks every edge's tail among its chunk's tail negatives and its
head among the head negatives on the raw scores, in their own dtype (float64
rows are not narrowed: scores 1e-9 apart are not tied), ignoring the negatives
named by the batch's ``dst_filter`` / ``src_filter`` (filtered ranking), with
the link predictor's code (:mod:`lightning_ooc.models.ranking`):
``val_mrr`` / ``test_mrr`` take the rank that counts a tie half
(ogbl-citation2's evaluator), and ``val_hits@K`` / ``test_hits@K`` follow
``hits_ties``: ``"pessimistic"`` (the default; a tie with the ``K``-th best
negative is a miss, ``pos > kth_neg`` as ogbl-collab's evaluator) or
``"average"`` (ties count half, as ogbl-citation2's). Both are means over both
corruptions of all edges (torchmetrics ``MeanMetric``, synchronised across
processes).

A training step needs a ``Trainer`` (manual optimization); :meth:`KGEModel.scores`
and :meth:`KGEModel.loss` do not. Example::

    >>> import torch
    >>> from lightning_ooc.embed.batch import EmbeddingBatch
    >>> from lightning_ooc.embed.optim import sparse_adagrad_
    >>> from lightning_ooc.models.kge import DistMult
    >>> _ = torch.manual_seed(0)
    >>> weight, state = 0.1 * torch.randn(10, 8), torch.zeros(10, 8)   # the buffer's rows and Adagrad state
    >>> batch = EmbeddingBatch(src=torch.tensor([0, 1, 2]), dst=torch.tensor([5, 6, 7]), rel=torch.tensor([0, 1, 1]),
    ...                        src_rows=torch.tensor([0, 1, 2]), dst_rows=torch.tensor([5, 6, 7]),
    ...                        neg_src_rows=torch.tensor([[3, 4], [4, 0]]), neg_dst_rows=torch.tensor([[8, 9], [9, 5]]),
    ...                        chunk_size=2, weight=weight, state=state)
    >>> model = DistMult(num_relations=2, dim=8)
    >>> pos, neg_dst, neg_src = model.scores(batch)      # edge 2 (chunk 1) meets negatives [9, 5] and [4, 0]
    >>> pos.shape, neg_dst.shape, neg_src.shape
    (torch.Size([3]), torch.Size([3, 2]), torch.Size([3, 2]))
    >>> loss = model.loss(batch)                         # what training_step minimises
    >>> bool(abs(loss - 2 * torch.log(torch.tensor(3.0))) < 0.1)   # near 2 log(1 + K) while the rows are small
    True

Under a ``Trainer`` the same batches train both the rows and the relations::

    >>> import lightning as L
    >>> trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False)
    >>> before = weight.clone()
    >>> trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    >>> batch.is_done, bool((weight != before).any()), bool((state > 0).any())
    (True, True, True)
"""
from __future__ import annotations

from typing import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_ooc.embed.batch import EmbeddingBatch
from lightning_ooc.embed.optim import sparse_adagrad_
from lightning_ooc.errors import InputError
from lightning_ooc.models import checks
from lightning_ooc.models.ranking import HITS_TIES, positive_ranks, random_mrr, rank_metrics

__all__ = ["KGEModel", "DotKGE", "DistMult", "ComplEx", "chunked_scores", "positive_ranks", "random_mrr"]

SCORES = ("dot", "distmult", "complex")
LOSSES = ("softmax", "ranking")


def chunked_scores(query: Tensor, negatives: Tensor, chunk_size: int) -> Tensor:
    """Scores ``<query[b], negatives[c]>`` of each edge ``b`` against the ``K`` rows of its chunk ``b // chunk_size``.

    Args:
        query: ``[B, D]``.
        negatives: ``[C, K, D]``, ``C >= ceil(B / chunk_size)``.
        chunk_size: edges per chunk (the last chunk may be shorter).

    Returns:
        ``[B, K]``, by one batched matrix product over the chunks (the last chunk padded).

    >>> q, n = torch.arange(6.0).view(3, 2), torch.ones(2, 4, 2)
    >>> chunked_scores(q, n, 2)[:, 0].tolist()
    [1.0, 5.0, 9.0]
    """
    b, d = query.shape
    c, k, dn = negatives.shape
    s = int(chunk_size)
    if dn != d:
        raise ValueError(f"query rows have {d} entries, negatives {dn}")
    if s < 1 or c * s < b:
        raise ValueError(f"{b} edges need ceil({b} / {s}) chunks of negatives, got {c}")
    if b <= s:  # one chunk
        return query @ negatives[0].transpose(0, 1)
    c = -(-b // s)  # chunks actually used
    pad = c * s - b
    if pad:
        query = F.pad(query, (0, 0, 0, pad))
    out = torch.bmm(query.view(c, s, d), negatives[:c].transpose(1, 2))  # [C, S, K]
    return out.reshape(c * s, k)[:b]


class KGEModel(L.LightningModule):
    """A knowledge-graph embedding model over :class:`~lightning_ooc.embed.batch.EmbeddingBatch` batches.

    Args:
        num_relations: relation types (the batches' ``rel`` lies in ``[0, num_relations)``; default 1); unused
            by ``"dot"``. ``lightning-ooc fit`` fills it in from the table.
        dim: width of the stored node rows (for ComplEx the real width: ``dim / 2`` complex entries); default
            ``in_channels``, else 100.
        score: ``"dot"``, ``"distmult"`` or ``"complex"``.
        lr: Adagrad learning rate of the node rows.
        relation_lr: Adagrad learning rate of the relation embeddings (default: ``lr``).
        eps: Adagrad's ``eps`` (both optimizers).
        loss: ``"softmax"`` or ``"ranking"``.
        margin: the margin of the ranking loss.
        eval_hits: the ``K`` of the ``hits@K`` metrics.
        hits_ties: how Hits@K counts a positive tied with negatives
            (:data:`~lightning_ooc.models.ranking.HITS_TIES`): ``"pessimistic"`` (a tie with the ``K``-th best
            negative is a miss: ogbl-collab's evaluator, as :class:`~lightning_ooc.models.LinkPredictor`'s
            default) or ``"average"`` (ties count half, as in the MRR: ogbl-citation2's evaluator).
        in_channels: the table's row width, which ``lightning-ooc fit`` links from the datamodule (as for
            every model); ``dim`` defaults to it.
        num_classes: not used (``lightning-ooc fit`` links every model's ``num_classes``; this takes and
            ignores it, as :class:`~lightning_ooc.models.LinkPredictor` does).

    Node rows are initialised by whoever fills the partition buffer (small random values, e.g.
    ``N(0, 0.001)`` as PyTorch-BigGraph does, or ``N(0, 0.1)`` for small tables).

    ``configure_optimizers`` returns ``None`` for ``"dot"`` (Lightning then warns that the fit runs with
    no optimizer, and steps a placeholder so ``global_step`` still counts batches). A ``GradScaler``
    precision (``"16-mixed"``) is not supported: the node rows' gradients would come back scaled.
    
    Scores of edges from the rows of their ends (a training batch brings them from the partition buffer)::

        >>> import torch
        >>> model = KGEModel(num_relations=2, dim=4, score="distmult")
        >>> h, t = torch.ones(3, 4), torch.full((3, 4), 0.5)
        >>> model.score_edges(h, model.relation(torch.tensor([0, 1, 1])), t).tolist()  # relations start at ones
        [2.0, 2.0, 2.0]
    """

    _fixed_score: str | None = None

    def __init__(
        self,
        num_relations: int | None = None,
        dim: int | None = None,
        score: str = "distmult",
        lr: float = 0.1,
        relation_lr: float | None = None,
        eps: float = 1e-10,
        loss: str = "softmax",
        margin: float = 0.1,
        eval_hits: Sequence[int] = (1, 10),
        in_channels: int | None = None,
        num_classes: int | None = None,
        hits_ties: str = "pessimistic",
    ):
        super().__init__()
        if dim is not None and in_channels is not None and int(dim) != int(in_channels):
            raise InputError(f"dim={dim} but the embedding table's rows have {in_channels} entries (in_channels); "
                             "leave dim out to take the table's")  # fmt: skip
        dim = checks.count("dim", dim if dim is not None else in_channels if in_channels is not None else 100, 1,
                           "entries of a node's embedding")  # fmt: skip
        num_relations = checks.count("num_relations", 1 if num_relations is None else num_relations, 1,
                                     "relation types")  # fmt: skip
        checks.choice("score", score, SCORES)
        checks.choice("loss", loss, LOSSES)
        checks.choice("hits_ties", hits_ties, HITS_TIES)
        if score == "complex" and dim % 2:
            raise InputError(f"dim must be even for ComplEx (pairs of real and imaginary parts), got {dim}")
        lr = checks.rate("lr", lr)
        relation_lr = None if relation_lr is None else checks.rate("relation_lr", relation_lr)
        eps = checks.rate("eps", eps)
        margin = checks.rate("margin", margin, zero=True)
        hits = [checks.count("eval_hits", k, 1, "the K of hits@K") for k in eval_hits]
        # the subclasses fix the score and do not take it
        self.save_hyperparameters(ignore=["score"] if self._fixed_score is not None else None)
        self.automatic_optimization = False
        self.score_name = score
        self.dim = int(dim)
        self.lr = float(lr)
        self.relation_lr = float(lr if relation_lr is None else relation_lr)
        self.eps = float(eps)
        self.loss_name = loss
        self.margin = float(margin)
        self.eval_hits = hits
        self.hits_ties = hits_ties
        self.relations: nn.Embedding | None = None
        if score != "dot":
            self.relations = nn.Embedding(num_relations, dim)
            with torch.no_grad():
                self.relations.weight.fill_(1.0)
                if score == "complex":
                    self.relations.weight[:, dim // 2:] = 0.0  # 1 + 0i: the identity rotation
        for stage in ("val", "test"):
            ranking = {"mrr": MeanMetric()} | {f"hits@{k}": MeanMetric() for k in hits}
            setattr(self, f"{stage}_ranking", nn.ModuleDict(ranking))

    # -- scores -----------------------------------------------------------------------------------
    def relation(self, rel: Tensor) -> Tensor | None:
        """The relation embeddings of ``rel`` (``None`` for ``"dot"``)."""
        return None if self.relations is None else self.relations(rel)

    def tail_query(self, h: Tensor, r: Tensor | None) -> Tensor:
        """``q`` with ``score(h, r, t) = <q, t>`` for every tail ``t``."""
        if self.score_name == "dot":
            return h
        r = r.to(h.dtype)
        if self.score_name == "distmult":
            return h * r
        a, b = h.chunk(2, dim=-1)
        c, d = r.chunk(2, dim=-1)
        return torch.cat([a * c - b * d, a * d + b * c], dim=-1)  # h * r

    def head_query(self, r: Tensor | None, t: Tensor) -> Tensor:
        """``k`` with ``score(h, r, t) = <h, k>`` for every head ``h``."""
        if self.score_name == "dot":
            return t
        r = r.to(t.dtype)
        if self.score_name == "distmult":
            return r * t
        c, d = r.chunk(2, dim=-1)
        e, f = t.chunk(2, dim=-1)
        return torch.cat([c * e + d * f, c * f - d * e], dim=-1)  # conj(r * conj(t))

    def score_edges(self, h: Tensor, r: Tensor | None, t: Tensor) -> Tensor:
        """Scores of the edges ``(h[i], r[i], t[i])``."""
        return (self.tail_query(h, r) * t).sum(-1)

    def gather(self, batch: EmbeddingBatch, requires_grad: bool = False) -> tuple[Tensor, Tensor]:
        """The batch's rows ``cat(src_rows, dst_rows, neg_src_rows, neg_dst_rows)`` (flattened) and their embeddings.

        The embeddings are a copy (a leaf tensor, requiring grad if asked), never a view of ``batch.weight``.
        """
        rows = torch.cat([batch.src_rows.reshape(-1), batch.dst_rows.reshape(-1),
                          batch.neg_src_rows.reshape(-1), batch.neg_dst_rows.reshape(-1)])  # fmt: skip
        emb = batch.weight[rows].detach()
        return rows, emb.requires_grad_(requires_grad)

    def _scores(self, batch: EmbeddingBatch, emb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, (c, k) = len(batch), batch.neg_dst_rows.shape
        cs, ks = batch.neg_src_rows.shape
        h, t, neg_src, neg_dst = emb.split([b, b, cs * ks, c * k])
        r = self.relation(batch.rel)
        pos = self.score_edges(h, r, t)
        neg_dst_scores = chunked_scores(self.tail_query(h, r), neg_dst.view(c, k, -1), batch.chunk_size)
        neg_src_scores = chunked_scores(self.head_query(r, t), neg_src.view(cs, ks, -1), batch.chunk_size)
        return pos, neg_dst_scores, neg_src_scores

    def scores(self, batch: EmbeddingBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Scores of the positives ``[B]``, of the tail corruptions ``[B, K]`` and of the head corruptions ``[B, K]``.

        Gradients reach the relation embeddings only (node rows are gathered as a detached copy).
        """
        return self._scores(batch, self.gather(batch)[1])

    def loss_from_scores(self, pos: Tensor, neg_dst: Tensor, neg_src: Tensor) -> Tensor:
        """The training loss of scores as :meth:`scores` gives them, computed in float32 at least (half-precision
        scores are widened; float64 scores stay float64)."""
        dtype = torch.promote_types(pos.dtype, torch.float32)
        pos, neg_dst, neg_src = pos.to(dtype), neg_dst.to(dtype), neg_src.to(dtype)
        if self.loss_name == "softmax":
            total = pos.new_zeros(())
            for neg in (neg_dst, neg_src):
                logits = torch.cat([pos[:, None], neg], dim=1)
                total = total + F.cross_entropy(logits, torch.zeros_like(pos, dtype=torch.long), reduction="sum")
            return total / max(1, pos.numel())
        total = pos.new_zeros(())
        for neg in (neg_dst, neg_src):
            if neg.numel():
                total = total + F.relu(self.margin - pos[:, None] + neg).mean()
        return total

    def loss(self, batch: EmbeddingBatch) -> Tensor:
        """The training loss of a batch (no update)."""
        return self.loss_from_scores(*self.scores(batch))

    # -- training ---------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            raise InputError(f"{type(self).__name__} does not support a GradScaler precision ('16-mixed'); "
                             "use '32-true' or 'bf16-mixed'")  # fmt: skip

    def training_step(self, batch: EmbeddingBatch, batch_idx: int) -> Tensor | None:
        if len(batch) == 0:
            batch.done()
            return None
        rows, emb = self.gather(batch, requires_grad=True)
        loss = self.loss_from_scores(*self._scores(batch, emb))
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()  # the relations (or, for "dot", a placeholder that keeps global_step counting)
        sparse_adagrad_(batch.weight, batch.state, rows, emb.grad, self.lr, self.eps)
        batch.done()
        self.log("train_loss", loss.detach(), prog_bar=True, batch_size=len(batch))
        return loss.detach()

    # -- evaluation -------------------------------------------------------------------------------
    def ranked_scores(self, batch: EmbeddingBatch) -> list[tuple[Tensor, Tensor]]:
        """``(positives [B], negatives [B, K])`` of the tail corruptions, then of the head corruptions, in the
        scores' own dtype; a negative that ``batch.dst_filter`` / ``batch.src_filter`` names scores ``-inf``
        (filtered ranking)."""
        with torch.no_grad():
            pos, neg_dst, neg_src = self.scores(batch)
            out = []
            for neg, flt in ((neg_dst, batch.dst_filter), (neg_src, batch.src_filter)):
                if flt is not None and flt.numel():
                    neg = neg.clone()
                    flt = flt.to(neg.device)
                    neg[flt[0], flt[1]] = float("-inf")
                out.append((pos, neg))
            return out

    def ranks(self, batch: EmbeddingBatch, ties: str = "average") -> Tensor:
        """Ranks ``[2B]`` of every edge's true tail among its tail negatives, then of its true head among
        its head negatives, filtered by ``batch.dst_filter`` / ``batch.src_filter``, compared in the scores'
        own dtype; ``ties`` as :func:`~lightning_ooc.models.ranking.positive_ranks` takes it (default: a tie
        counts half, the MRR's rank)."""
        return torch.cat([positive_ranks(pos, neg, ties) for pos, neg in self.ranked_scores(batch)])

    def _evaluate(self, batch: EmbeddingBatch, stage: str) -> None:
        if len(batch):
            parts = [rank_metrics(pos, neg, self.eval_hits, self.hits_ties) for pos, neg in self.ranked_scores(batch)]
            ranking = getattr(self, f"{stage}_ranking")
            for name, metric in ranking.items():
                values = torch.cat([part[name] for part in parts])
                metric.update(values)
                self.log(f"{stage}_{name}", metric, batch_size=int(values.numel()),
                         prog_bar=stage == "val" and name == "mrr")  # fmt: skip
        batch.done()

    def validation_step(self, batch: EmbeddingBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: EmbeddingBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: EmbeddingBatch, batch_idx: int) -> Tensor:
        """Scores of the batch's edges."""
        with torch.no_grad():
            h, t = batch.weight[batch.src_rows], batch.weight[batch.dst_rows]
            out = self.score_edges(h, self.relation(batch.rel), t)
        batch.done()
        return out

    def configure_optimizers(self):
        if self.relations is None:
            return None
        return torch.optim.Adagrad(self.relations.parameters(), lr=self.relation_lr, eps=self.eps)


class DotKGE(KGEModel):
    """:class:`KGEModel` scoring ``<h, t>`` (``num_relations`` is accepted and ignored).

        >>> import torch
        >>> model = DotKGE(dim=2)
        >>> model.relations is None, model.score_edges(torch.tensor([[1.0, 2.0]]), None, torch.tensor([[3.0, 4.0]]))
        (True, tensor([11.]))
    """

    _fixed_score = "dot"

    def __init__(self, num_relations: int | None = None, dim: int | None = None, lr: float = 0.1,
                 relation_lr: float | None = None, eps: float = 1e-10, loss: str = "softmax", margin: float = 0.1,
                 eval_hits: Sequence[int] = (1, 10), in_channels: int | None = None,
                 num_classes: int | None = None, hits_ties: str = "pessimistic"):  # fmt: skip
        super().__init__(num_relations, dim, "dot", lr, relation_lr, eps, loss, margin, eval_hits, in_channels,
                         num_classes, hits_ties=hits_ties)


class DistMult(KGEModel):
    """:class:`KGEModel` scoring ``sum(h * r * t)``; relations start at ones.

        >>> import torch
        >>> model = DistMult(num_relations=3, dim=2)
        >>> with torch.no_grad():
        ...     _ = model.relations.weight.copy_(torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 3.0]]))
        >>> h, t = torch.tensor([[1.0, 2.0]]).expand(3, 2), torch.tensor([[3.0, 4.0]]).expand(3, 2)
        >>> model.score_edges(h, model.relation(torch.arange(3)), t).tolist()
        [11.0, 6.0, 24.0]
    """

    _fixed_score = "distmult"

    def __init__(self, num_relations: int | None = None, dim: int | None = None, lr: float = 0.1,
                 relation_lr: float | None = None, eps: float = 1e-10, loss: str = "softmax", margin: float = 0.1,
                 eval_hits: Sequence[int] = (1, 10), in_channels: int | None = None,
                 num_classes: int | None = None, hits_ties: str = "pessimistic"):  # fmt: skip
        super().__init__(num_relations, dim, "distmult", lr, relation_lr, eps, loss, margin, eval_hits, in_channels,
                         num_classes, hits_ties=hits_ties)


class ComplEx(KGEModel):
    """:class:`KGEModel` scoring ``Re(<h, r, conj(t)>)`` (rows: real half, then imaginary half); relations
    start at ``1 + 0i``.

    A relation of ``i`` (a quarter turn) scores ``h = 1`` against ``t = i`` as 1, against ``t = 1`` as 0::

        >>> import torch
        >>> model = ComplEx(num_relations=1, dim=2)
        >>> r = torch.tensor([[0.0, 1.0]])  # 0 + 1i
        >>> h = torch.tensor([[1.0, 0.0]])  # 1 + 0i
        >>> model.score_edges(h, r, torch.tensor([[0.0, 1.0]])).item(), model.score_edges(h, r, h).item()
        (1.0, 0.0)
    """

    _fixed_score = "complex"

    def __init__(self, num_relations: int | None = None, dim: int | None = None, lr: float = 0.1,
                 relation_lr: float | None = None, eps: float = 1e-10, loss: str = "softmax", margin: float = 0.1,
                 eval_hits: Sequence[int] = (1, 10), in_channels: int | None = None,
                 num_classes: int | None = None, hits_ties: str = "pessimistic"):  # fmt: skip
        super().__init__(num_relations, dim, "complex", lr, relation_lr, eps, loss, margin, eval_hits, in_channels,
                         num_classes, hits_ties=hits_ties)

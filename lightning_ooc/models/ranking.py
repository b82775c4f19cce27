"""The ranking metrics of link prediction, shared by :class:`~lightning_ooc.models.LinkPredictor` and the KGE models.

Every positive is ranked among its own negatives on the raw scores, compared in
their own dtype (float64 scores 1e-9 apart are not tied). The MRR's rank counts
a tied negative half (ogbl-citation2's evaluator: the mean of the optimistic and
the pessimistic rank). Hits@K follows ``hits_ties`` (:data:`HITS_TIES`):
``"pessimistic"`` counts a positive as a hit at ``K`` only when fewer than ``K``
of its negatives score at least as high as it (ogbl-collab's, ddi's and ppa's
evaluator: ``pos > kth_neg``, a tie with the ``K``-th best negative is a miss);
``"average"`` ranks it with ties counted half, as the MRR does (ogbl-citation2's
Hits@K). :func:`rank_metrics` gives both for a batch; the models average them
over an epoch.

    >>> import torch
    >>> pos, neg = torch.tensor([3.0, 1.0]), torch.tensor([[1.0, 3.0], [1.0, 1.0]])
    >>> {k: [round(x, 3) for x in v.tolist()] for k, v in rank_metrics(pos, neg, hits_at=(2,)).items()}
    {'mrr': [0.667, 0.5], 'hits@2': [1.0, 0.0]}
    >>> rank_metrics(pos, neg, hits_at=(2,), hits_ties="average")["hits@2"].tolist()  # ranks 1.5 and 2
    [1.0, 1.0]
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_ooc.errors import InputError

__all__ = ["HITS_TIES", "positive_ranks", "rank_metrics", "random_mrr"]

#: how Hits@K counts a positive tied with negatives: ``"pessimistic"`` (every tie ranks above it: OGB's
#: ogbl-collab/ddi/ppa evaluator, ``pos > kth_neg``) or ``"average"`` (a tie counts half: ogbl-citation2's)
HITS_TIES = ("pessimistic", "average")


def random_mrr(num_negatives: int) -> float:
    """Expected MRR of a scorer that ranks a positive at random among ``num_negatives`` negatives.

    >>> random_mrr(1)
    0.75
    """
    n = int(num_negatives) + 1
    return sum(1.0 / r for r in range(1, n + 1)) / n


def positive_ranks(pos: Tensor, neg: Tensor, ties: str = "average") -> Tensor:
    """The rank (1 = best) of each positive among its negatives ``neg[i]``, compared in the scores' own dtype.

    ``ties="average"`` counts a tie half (ogbl-citation2's evaluator: the mean of the optimistic and the
    pessimistic rank); ``"pessimistic"`` ranks every tied negative above the positive (ogbl-collab's Hits@K:
    a positive is a hit at ``K`` when its pessimistic rank is at most ``K``, i.e. ``pos > kth_neg``).

    >>> positive_ranks(torch.tensor([3.0, 1.0]), torch.tensor([[1.0, 3.0], [1.0, 1.0]])).tolist()
    [1.5, 2.0]
    >>> positive_ranks(torch.tensor([3.0, 1.0]), torch.tensor([[1.0, 3.0], [1.0, 1.0]]), ties="pessimistic").tolist()
    [2.0, 3.0]
    """
    if ties not in HITS_TIES:
        raise InputError(f"ties must be one of {', '.join(HITS_TIES)}, got {ties!r}")
    dtype = torch.promote_types(pos.dtype, neg.dtype)  # no narrowing: float64 scores 1e-9 apart stay apart
    pos, neg = pos.to(dtype)[:, None], neg.to(dtype)
    higher = (neg > pos).sum(dim=1)
    tied = (neg == pos).sum(dim=1)
    return 1.0 + higher + (tied if ties == "pessimistic" else 0.5 * tied)


def rank_metrics(pos: Tensor, neg: Tensor, hits_at: Sequence[int], hits_ties: str = "pessimistic") -> dict[str, Tensor]:
    """Per positive, what the ranking metrics average: ``"mrr"`` (the reciprocal of the rank that counts a tie
    half) and ``"hits@K"`` for every ``K`` of ``hits_at`` (1.0 for a hit, ties as ``hits_ties`` says).

    ``pos``: ``[B]`` scores; ``neg``: ``[B, K]`` scores of each positive's own negatives (a negative to leave
    out, as filtered ranking does, scored ``-inf``). Scores are compared in their own dtype.

    >>> pos, neg = torch.tensor([1.0, 1.0 + 1e-9], dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    >>> {k: v.tolist() for k, v in rank_metrics(pos, neg, hits_at=(1,)).items()}   # 1e-9 above its negatives
    {'mrr': [0.5, 1.0], 'hits@1': [0.0, 1.0]}
    """
    ranks = positive_ranks(pos, neg)
    hit_ranks = ranks if hits_ties == "average" else positive_ranks(pos, neg, hits_ties)
    out = {"mrr": 1.0 / ranks}
    for k in hits_at:
        out[f"hits@{int(k)}"] = (hit_ranks <= int(k)).float()
    return out

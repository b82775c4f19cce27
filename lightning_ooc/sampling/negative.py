"""Negative sampling for link prediction: :class:`NegativeSampling` and :class:`NegativeSampler`.

The two modes of PyG's :class:`torch_geometric.sampler.NegativeSampling`,
drawn by the native module (``ext/sampler/negative.cpp``) over the dataset's
in-edge CSC, with the GIL released:

* ``"binary"``: ``ceil(amount x B)`` random (source, destination) pairs for a
  batch of ``B`` positive edges; they are the batch's label-0 edges.
* ``"triplet"``: ``amount`` (an integer) random destinations for every
  positive ``(src[i], dst[i])``, laid out as PyG lays them out: negative ``j``
  of positive ``i`` at ``i * amount + j``.

``weight="uniform"`` draws nodes uniformly; ``weight="degree"`` draws a source
in proportion to its out-degree and a destination in proportion to its
in-degree (the endpoints of a uniformly drawn edge), as popular nodes are
drawn in word2vec-style negative sampling. ``strict=True`` redraws a pair that
is an edge of the graph or one of the batch's positives (and, for a triplet, a
destination equal to the positive's own), up to ``max_tries`` times; pairs
still not strict after that are kept, so shapes never change, and counted in
:attr:`Negatives.unresolved`.

The same seed gives the same negatives on any thread, so a batch's negatives
do not depend on which thread draws them.

Example::

    >>> import torch
    >>> from lightning_ooc.sampling import CSCGraph
    >>> from lightning_ooc.sampling.negative import NegativeSampler, NegativeSampling, Negatives
    >>> g = CSCGraph.from_edge_index(torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]))
    >>> neg = NegativeSampler(g, NegativeSampling("triplet", amount=2, strict=True))
    >>> out = neg.sample(torch.tensor([0, 1]), torch.tensor([1, 2]), seed=0)
    >>> out.dst.view(2, 2).shape, bool((out.dst.view(2, 2) != torch.tensor([[1], [2]])).all())
    (torch.Size([2, 2]), True)
    >>> isinstance(out, Negatives), out.src is None, out.unresolved  # a triplet's negatives are destinations
    (True, True, 0)
    >>> pairs = NegativeSampler(g, NegativeSampling("binary", amount=3)).sample(torch.tensor([0]), torch.tensor([1]),
    ...                                                                          seed=1)
    >>> pairs.src.shape, pairs.dst.shape  # binary: (src, dst) pairs
    (torch.Size([3]), torch.Size([3]))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_ooc.errors import CorruptDatasetError, InputError
from lightning_ooc.sampling.csc import _as_numpy

try:
    from lightning_ooc import _sampler
except ImportError:  # pragma: no cover - only without a build
    _sampler = None

MODES = ("binary", "triplet")
WEIGHTS = ("uniform", "degree")
_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class NegativeSampling:
    """How negatives are drawn (PyG's ``NegativeSampling`` modes, with a weighting and a strict option).

    Args:
        mode: ``"binary"`` or ``"triplet"``.
        amount: negatives per positive edge (a ratio for binary, an integer for triplet).
        weight: ``"uniform"`` or ``"degree"``.
        strict: redraw negatives that are edges of the graph or positives of the batch.
        max_tries: redraws per negative before it is kept anyway (and counted).
    """

    mode: str = "binary"
    amount: float = 1
    weight: str = "uniform"
    strict: bool = False
    max_tries: int = 64

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"negative sampling mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.weight not in WEIGHTS:
            raise InputError(f"negative sampling weight must be one of {', '.join(WEIGHTS)}, got {self.weight!r}")
        if isinstance(self.amount, bool) or not isinstance(self.amount, (int, float)) or not self.amount > 0:
            raise InputError(f"negative sampling amount must be a number > 0, got {self.amount!r}")
        if self.mode == "triplet" and self.amount != math.ceil(self.amount):
            raise InputError(f"triplet negative sampling needs an integer amount, got {self.amount!r}")
        if isinstance(self.max_tries, bool) or not isinstance(self.max_tries, int) or self.max_tries < 0:
            raise InputError(f"max_tries must be an integer >= 0, got {self.max_tries!r}")

    @classmethod
    def cast(cls, value: Any) -> "NegativeSampling | None":
        """From ``None``, a mode name, a dict of the fields, an instance, or PyG's ``NegativeSampling``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            return cls(**value)
        mode = getattr(value, "mode", None)
        if mode is not None:  # PyG's NegativeSampling: node weights other than none are not supported
            if getattr(value, "src_weight", None) is not None or getattr(value, "dst_weight", None) is not None:
                raise InputError("PyG NegativeSampling with src_weight/dst_weight: use weight='degree' or 'uniform'")
            return cls(getattr(mode, "value", str(mode)), amount=value.amount)
        raise InputError(f"neg_sampling must be None, 'binary', 'triplet', a dict or a NegativeSampling, got {value!r}")

    def count(self, num_pos: int) -> int:
        """Negatives for ``num_pos`` positives."""
        return math.ceil(num_pos * self.amount) if self.mode == "binary" else num_pos * int(self.amount)


@dataclass
class Negatives:
    """Negatives of one batch: ``src`` (binary only) and ``dst``, int64, and how many are not strict."""

    src: torch.Tensor | None
    dst: torch.Tensor
    unresolved: int = 0


class NegativeSampler:
    """Draws the negatives of a batch of positive edges over a graph's in-edge CSC.

    Args:
        graph: anything with ``indptr`` and ``indices`` (an
            :class:`~lightning_ooc.data.dataset.OnDiskDataset`, a
            :class:`~lightning_ooc.sampling.CSCGraph`).
        config: a :class:`NegativeSampling` (or what :meth:`NegativeSampling.cast` takes).
    """

    def __init__(self, graph: Any, config: Any):
        if _sampler is None:
            raise ImportError("the native sampler is not built; run `make ext` (or pip install -e .)")
        cfg = NegativeSampling.cast(config)
        if cfg is None:
            raise InputError("a NegativeSampler needs a negative sampling configuration, got None")
        self.config = cfg
        self.indptr = np.ascontiguousarray(_as_numpy(graph.indptr, "indptr"), dtype=np.int64)
        self.indices = _as_numpy(graph.indices, "indices")
        if self.indices.dtype not in (np.int32, np.int64):
            self.indices = self.indices.astype(np.int64)
        self.num_nodes = int(self.indptr.shape[0]) - 1
        if self.num_nodes < 0 or (self.num_nodes and np.any(self.indptr[1:] < self.indptr[:-1])):
            raise CorruptDatasetError("corrupt graph: indptr decreases (or is empty); the negative sampler "
                                      "needs the CSC offsets of a valid graph", None)  # fmt: skip
        if cfg.weight == "degree" and self.indices.shape[0] == 0:
            raise InputError("weight='degree' needs a graph with edges")

    def sample(self, src: Any, dst: Any, seed: int) -> Negatives:
        """The negatives of positives ``(src[i], dst[i])``, drawn with ``seed``."""
        src_t = torch.as_tensor(src, dtype=torch.int64).contiguous()
        dst_t = torch.as_tensor(dst, dtype=torch.int64).contiguous()
        if src_t.dim() != 1 or src_t.shape != dst_t.shape:
            raise InputError(f"src and dst must be 1-D of one length, got {tuple(src_t.shape)} and {tuple(dst_t.shape)}")
        cfg = self.config
        n = cfg.count(src_t.numel())
        triplet = cfg.mode == "triplet"
        out_dst = torch.empty(n, dtype=torch.int64)
        out_src = None if triplet else torch.empty(n, dtype=torch.int64)
        try:
            left = _sampler.negatives(self.indptr, self.indices, src_t.numpy(), dst_t.numpy(),
                                      None if out_src is None else out_src.numpy(), out_dst.numpy(), triplet,
                                      cfg.weight == "degree", cfg.strict, int(seed) & _SEED_MASK, cfg.max_tries)  # fmt: skip
        except IndexError as e:
            raise InputError(f"negative sampling: {e}") from None
        except ValueError as e:
            if not str(e).startswith("corrupt graph"):
                raise
            raise CorruptDatasetError(f"negative sampling: {e}", None) from None
        return Negatives(out_src, out_dst, int(left))

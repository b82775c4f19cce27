"""``LinkPasses``: link-prediction passes over a dataset's link splits, on the node passes' tiers and pipeline.

The seeds of a split are the positions ``0 .. M-1`` of its supervision edges
(:meth:`~lightning_ooc.data.dataset.OnDiskDataset.link_split`); they are cut
into minibatches exactly as node seeds are (shuffled per training epoch, a
disjoint share per rank). The sampler of a minibatch of edge positions, run on
the pipeline's sampler threads:

1. reads the edges' ``(src, dst)`` (and labels, when the split has some);
2. draws their negatives with the batch's seed in native code
   (:class:`~lightning_ooc.sampling.negative.NegativeSampler`): the training
   split with the configured ``neg_sampling``; an evaluation split with its own
   stored labels or negatives when it has any, else as training does;
3. forms PyG's seed set, ``unique(cat([src, dst, negatives]))``, and samples
   ONE subgraph around it with the native
   :class:`~lightning_ooc.sampling.NeighborSampler`;
4. returns a ``Data`` with the fields of PyG's ``LinkNeighborLoader``: ``n_id``
   (the seed set first, sorted, as PyG's), ``edge_index``, ``input_id`` (the
   edges' positions in the split), ``edge_label_index``/``edge_label`` (no
   negatives or binary ones) or ``src_index``/``dst_pos_index``/``dst_neg_index``
   (triplet), ``num_sampled_nodes``/``num_sampled_edges``; ``batch_size`` is the
   number of positive edges, and ``x`` comes from the feature tiers.

Binary negative sampling with given labels follows PyG's rule: when a split's
labels include 0, they are shifted by one so that 0 means "sampled negative".
With ``exclude_seed_edges`` the batch's positive edges (and their reverses)
are removed from its sampled ``edge_index``, so a model cannot read a
supervision edge off its own message passing.

Example::

    >>> import tempfile, numpy as np
    >>> from lightning_ooc.data.prepare import prepare_from_arrays
    >>> from lightning_ooc.loader.context import ProcessContext
    >>> from lightning_ooc.loader.features import Tiered
    >>> from lightning_ooc.loader.link_task import LinkDataConfig, LinkPasses
    >>> rng = np.random.default_rng(0)
    >>> root = prepare_from_arrays(tempfile.mkdtemp() + "/g", rng.integers(0, 300, (2, 1500)),
    ...                            rng.random((300, 8), dtype=np.float32), split_edges=(0.8, 0.1, 0.1),
    ...                            progress=False)
    >>> cfg = LinkDataConfig(root, batch_size=64, num_neighbors=[3, 2], neg_sampling="binary", progress=False,
    ...                      features=Tiered(gpu_cache="1MiB", host_cache="8KiB", staging="256KiB"))
    >>> passes = LinkPasses(cfg, ProcessContext())
    >>> batch = next(iter(passes.run("train", epoch=0)))
    >>> batch.edge_label_index.shape, batch.edge_label.sum().item()
    (torch.Size([2, 128]), 64.0)

The passes are the tiered backend over the link task (:class:`LinkTask`), whose :class:`LinkBatchSampler`
draws a batch from its edges' positions; :class:`SyncLinkPasses`, the synchronous baseline over the same
task, draws the very same batch from the same positions and seed:

    >>> import torch
    >>> from lightning_ooc.loader.link_task import LinkBatchSampler, LinkTask, SyncLinkPasses
    >>> isinstance(passes.task, LinkTask), isinstance(passes.links, LinkBatchSampler)
    (True, True)
    >>> sync = SyncLinkPasses(cfg, ProcessContext(), features="mmap")
    >>> a = passes.sample_links("train", torch.arange(64), seed=3)
    >>> b = sync.sample_links("train", torch.arange(64), seed=3)
    >>> torch.equal(a.n_id, b.n_id), torch.equal(a.edge_label_index, b.edge_label_index)
    (True, True)
    >>> sync.close(); passes.close()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch_geometric.data import Data

from lightning_ooc.data.dataset import OnDiskDataset
from lightning_ooc.data.format import SPLITS
from lightning_ooc.data.link_splits import LinkSplit
from lightning_ooc.errors import InputError
from lightning_ooc.loader.baseline import DeviceTablePasses, SyncPasses
from lightning_ooc.loader.batches import SeedBatches
from lightning_ooc.loader.config import NodeDataConfig
from lightning_ooc.loader.context import ProcessContext
from lightning_ooc.loader.source import LocalPasses
from lightning_ooc.loader.tasks import NodeTask, open_for
from lightning_ooc.sampling.negative import NegativeSampler, NegativeSampling
from lightning_ooc.store.tally import BatchNegatives

__all__ = [
    "LinkDataConfig", "LinkTask", "LinkPasses", "LinkBatchSampler", "SyncLinkPasses", "open_links", "link_batches",
    "has_link_splits_or_fail", "training_edges_or_fail",
]  # fmt: skip


@dataclass
class LinkDataConfig(NodeDataConfig):
    """:class:`~lightning_ooc.loader.config.NodeDataConfig` plus the link-prediction settings.

    ``neg_sampling`` is ``None``, ``"binary"``, ``"triplet"``, a dict of
    :class:`~lightning_ooc.sampling.negative.NegativeSampling` fields, an instance, or
    PyG's ``NegativeSampling``; it is kept as a plain dict (or ``None``).
    ``exclude_seed_edges`` removes a batch's positive edges from its message passing.
    ``node_labels`` adds each node's class as ``y`` (off by default: link models do not read
    it, and under a memory cap every label is a random read of the labels file).
    """

    neg_sampling: Any = None
    exclude_seed_edges: bool = False
    node_labels: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.typed:
            raise InputError("link prediction runs on homogeneous datasets: num_neighbors is one list of fanouts "
                             f"per hop and there is no input_type (got num_neighbors={self.num_neighbors!r}, "
                             f"input_type={self.input_type!r})")  # fmt: skip
        self.neg_sampling = self.plain_negatives(self.neg_sampling)
        if not isinstance(self.exclude_seed_edges, bool):
            raise InputError(f"exclude_seed_edges must be True or False, got {self.exclude_seed_edges!r}")
        if not isinstance(self.node_labels, bool):
            raise InputError(f"node_labels must be True or False, got {self.node_labels!r}")

    @staticmethod
    def plain_negatives(value: Any) -> dict[str, Any] | None:
        """``neg_sampling`` in any of its forms as a plain dict of its fields (or ``None``)."""
        ns = NegativeSampling.cast(value)
        return None if ns is None else {
            "mode": ns.mode, "amount": ns.amount, "weight": ns.weight, "strict": ns.strict, "max_tries": ns.max_tries,
        }  # fmt: skip

    @property
    def negatives(self) -> NegativeSampling | None:
        return NegativeSampling.cast(self.neg_sampling)


def has_link_splits_or_fail(ds: OnDiskDataset) -> None:
    """Raise an :class:`~lightning_ooc.errors.InputError` naming the fix when ``ds`` has no link splits."""
    if not ds.has_link_splits:
        raise InputError(
            f"{ds.root}: the dataset has no link-prediction edge splits, which OutOfCoreLinkData trains on; prepare "
            "it with them: `lightning-ooc prepare ... --split-edges 0.85,0.05,0.10` (a random split of its edges; "
            "or give --link-train/--link-val/--link-test), or prepare_from_arrays(..., split_edges=(0.85, 0.05, 0.10))"
        )  # fmt: skip


def training_edges_or_fail(root: Any, link_meta: dict[str, Any] | None) -> None:
    """Raise an :class:`~lightning_ooc.errors.InputError` naming the fix when the link splits of ``root``
    (``link_meta``, meta.json's ``link_splits``; None: no link splits, refused elsewhere) hold no training edge.

    Training reads the supervision edges of the link split ``train`` and nothing else: the stored graph
    only passes messages. Without them ``fit`` would train on nothing and stop as if it had finished.
    """
    if link_meta is None:
        return
    splits = link_meta.get("splits", {})
    train = splits.get("train")
    if train is not None and int(train.get("edges", 0)) > 0:
        return
    what = ("its link split train holds no edges" if train is not None
            else f"it has no training link split (its link splits: {', '.join(splits) or 'none'})")  # fmt: skip
    raise InputError(
        f"{root}: {what}, so fit has no edges to train on (OutOfCoreLinkData trains on the link split train "
        "only; the stored graph passes messages and is not supervision); make one: `lightning-ooc prepare "
        f"--dataset {root} --out NEW --split-edges 0.85,0.05,0.10` (a random split of its stored edges), or "
        "give the training edges with --link-train EDGES (beside --link-val/--link-test); validate, test and "
        "predict need no training split"
    )  # fmt: skip


def open_links(cfg: NodeDataConfig, ctx: ProcessContext) -> OnDiskDataset:
    """The dataset of ``cfg`` (as :func:`~lightning_ooc.loader.source.open_for`), which must hold link splits."""
    ds = open_for(cfg, ctx, labelled=False)
    has_link_splits_or_fail(ds)
    return ds


def _split_or_empty(ds: OnDiskDataset, split: str, random_access: bool = False) -> LinkSplit:
    splits = (ds.link_splits or {}).get("splits", {})
    if split in splits:
        return ds.link_split(split, random_access=random_access)
    return LinkSplit(torch.empty((2, 0), dtype=torch.int64))


def link_batches(cfg: NodeDataConfig, ds: OnDiskDataset, ctx: ProcessContext) -> SeedBatches:
    """The minibatches of edge positions of every link split for the context's rank (a missing split: none)."""
    return SeedBatches(lambda s: _split_or_empty(ds, s).num_edges, batch_size=cfg.batch_size,
                       eval_batch_size=cfg.eval_size, shuffle=cfg.shuffle, drop_last=cfg.drop_last, seed=cfg.seed,
                       rank=ctx.rank, world=ctx.world)  # fmt: skip


class _Split:
    """One link split as the sampler reads it, with what its batches carry."""

    def __init__(self, ls: LinkSplit, negatives: NegativeSampler | None, name: str, scan: LinkSplit | None = None):
        """``ls`` is read at random positions; ``scan`` (default ``ls``), the same split through maps with
        read-ahead, is read whole (the labels' minimum)."""
        self.src, self.dst = ls.index[0], ls.index[1]
        self.neg_dst = ls.neg_dst  # given negatives: their batches are triplets with them
        self.label = ls.label
        self.time = ls.time  # each edge's time: its subgraphs see only what precedes it (temporal sampling)
        # evaluation splits that carry their own labels or negatives get no sampled ones
        given = self.neg_dst is not None or (name != "train" and self.label is not None)
        self.negatives = None if given else negatives
        mode = None if self.negatives is None else self.negatives.config.mode
        if mode == "triplet" and self.label is not None:
            raise InputError(f"the {name} link split has labels, and triplet negative sampling has no place for them "
                             "(as in PyG: src_index/dst_pos_index/dst_neg_index tell positives from negatives); "
                             "use neg_sampling='binary' or a split without labels")  # fmt: skip
        # PyG's rule (LinkLoader): with binary negatives, given labels that include 0 move up by one (0: negative)
        self.shift = (mode == "binary" and self.label is not None and self.label.numel() > 0
                      and bool((scan or ls).label.min() == 0))  # fmt: skip


class LinkBatchSampler:
    """The sampling half of the link passes: a link split's minibatch of edge positions -> a PyG-shaped
    ``Data`` without ``x`` (steps 1 to 4 of the module docstring). :class:`LinkPasses` runs it on its
    pipeline's sampler threads, :class:`SyncLinkPasses` in the trainer's
    thread; both give it their neighbor samplers, so the same positions and seed give the same batch."""

    def __init__(self, cfg: LinkDataConfig, ds: OnDiskDataset):
        has_link_splits_or_fail(ds)
        self.cfg, self.dataset = cfg, ds
        ns = cfg.negatives
        negatives = NegativeSampler(ds, ns) if ns is not None else None
        # a batch reads a few edges at random positions: maps with read-ahead off
        self.splits = {s: _Split(_split_or_empty(ds, s, random_access=True), negatives, s, _split_or_empty(ds, s))
                       for s in SPLITS}  # fmt: skip
        self.exclude_seed_edges = bool(cfg.exclude_seed_edges)
        self._with_labels = bool(cfg.node_labels) and ds.num_classes > 0
        if cfg.time_attr is not None:
            untimed = [s for s in SPLITS if self.splits[s].src.numel() and self.splits[s].time is None]
            if untimed:
                raise InputError(f"{ds.root}: time_attr={cfg.time_attr!r} samples each supervision edge's "
                                 f"subgraph at its time (PyG's edge_label_time), but the link split(s) "
                                 f"{', '.join(untimed)} have no times; give them (--link-SPLIT-time, a link "
                                 "split's 'time' field, or `prepare --from tgb`)")  # fmt: skip

    def seeds_per_batch(self) -> int:
        """A training batch's seed nodes: the endpoints of its edges and of their negatives."""
        b, ns = self.cfg.batch_size, self.cfg.negatives
        given = self.splits["train"].neg_dst
        if given is not None:
            return b * (2 + int(given.shape[1]))
        if ns is None:
            return 2 * b
        return 2 * b + ns.count(b) if ns.mode == "triplet" else 2 * (b + ns.count(b))

    def negatives(self) -> BatchNegatives | None:
        """The negatives of the largest minibatch of any split, for the plan: a training batch's sampled ones,
        an evaluation batch's given or sampled ones (``None``: no batch has any)."""
        cfg, found = self.cfg, []
        for split in SPLITS:
            sp = self.splits[split]
            size = int(sp.src.numel())
            if not size:
                continue
            train = split == "train"
            edges = min(cfg.batch_size if train else cfg.eval_size, size)
            option = "batch_size" if train or cfg.eval_batch_size is None else "eval_batch_size"
            if sp.neg_dst is not None:
                found.append(BatchNegatives(edges, int(sp.neg_dst.shape[1]), "triplet", option,
                                            f"the {split} split's given negatives per edge"))  # fmt: skip
            elif sp.negatives is not None:
                ns = sp.negatives.config
                found.append(BatchNegatives(edges, ns.amount, ns.mode, option, "neg_sampling amount"))
        return max(found, key=lambda n: n.count, default=None)

    def describe(self) -> str:
        ns = self.cfg.negatives
        return "no negatives" if ns is None else f"{ns.mode} negatives x{ns.amount:g} ({ns.weight})"

    def sample(self, split: str, positions: torch.Tensor, seed: int, sampler: Any) -> Data:
        """The minibatch of the edges at ``positions`` of link split ``split``, drawn with ``seed`` around
        the neighbor sampler ``sampler`` (no ``x``)."""
        sp = self.splits[split]
        pos = torch.as_tensor(positions, dtype=torch.int64)
        src, dst = sp.src[pos], sp.dst[pos]
        b = pos.numel()
        label = None if sp.label is None else sp.label[pos]
        triplet = False
        dst_neg = None
        if sp.neg_dst is not None:  # the split's own negatives, paired with each edge's source
            triplet, dst_neg = True, sp.neg_dst[pos].reshape(-1)
            nodes = torch.cat([src, dst, dst_neg])
        elif sp.negatives is not None:
            neg = sp.negatives.sample(src, dst, seed=seed ^ 0x5DEECE66D)
            if neg.src is None:
                triplet, dst_neg = True, neg.dst
                nodes = torch.cat([src, dst, neg.dst])
            else:
                nodes = torch.cat([src, neg.src, dst, neg.dst])
                if label is None:
                    label = torch.ones(b)
                elif sp.shift:
                    label = label + 1
                label = torch.cat([label, label.new_zeros((neg.dst.numel(),) + tuple(label.shape[1:]))])
        else:
            nodes = torch.cat([src, dst])
        times: dict[str, Any] = {}
        if self.cfg.time_attr is None:
            uniq, inverse = nodes.unique(return_inverse=True)
        else:  # every endpoint is a seed of its own, at its edge's time (PyG's edge_label_time): nothing merged
            uniq, inverse = nodes, torch.arange(nodes.numel())
            times["seed_time"] = _endpoint_times(sp.time[pos], b, nodes.numel(), triplet)
        out = sampler.sample_subgraph(uniq, seed=seed, labels=self._with_labels and sampler.labels is not None,
                                      **times)  # fmt: skip
        edge_index, hop_edges, e_id = out.edge_index, list(out.num_sampled_edges), out.e_id
        if self.exclude_seed_edges:
            given = None if sp.shift else sp.label  # shifted: every raw label, 0 included, is a positive's class
            keep, hop_edges = self._without_seed_edges(out.n_id, edge_index, hop_edges, src, dst, given, pos)
            if keep is not None:
                edge_index = edge_index[:, keep]
                e_id = None if e_id is None else e_id[keep]
        data = Data(edge_index=edge_index, n_id=out.n_id)
        if e_id is not None:
            data.e_id = e_id
        if out.y is not None:
            data.y = out.y
        data.input_id = pos.clone()
        if triplet:
            data.src_index = inverse[:b]
            data.dst_pos_index = inverse[b : 2 * b]
            data.dst_neg_index = inverse[2 * b :].view(b, -1).squeeze(-1)
        else:
            data.edge_label_index = inverse.view(2, -1)
            if label is not None:
                data.edge_label = label
        data.batch_size = b
        data.num_sampled_nodes = list(out.num_sampled_nodes)
        data.num_sampled_edges = hop_edges
        if out.batch is not None:  # temporal: each endpoint's subgraph, and its time
            data.batch = out.batch
            data.seed_time = out.seed_time
            data.edge_label_time = sp.time[pos] if triplet else out.seed_time[: inverse.numel() // 2]
        return data

    def _without_seed_edges(self, n_id: torch.Tensor, edge_index: torch.Tensor, hop_edges: list[int],
                            src: torch.Tensor, dst: torch.Tensor, labels: torch.Tensor | None,
                            pos: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:  # fmt: skip
        """Which sampled edges to keep (None: all): every one but the batch's positives and their reverses; and
        the kept edges per hop."""
        if labels is not None:  # label 0: a given negative, not a link to hide
            keep_pos = labels[pos] != 0
            src, dst = src[keep_pos], dst[keep_pos]
        if src.numel() == 0 or edge_index.shape[1] == 0:
            return None, hop_edges
        n = self.dataset.num_nodes
        seeds = torch.cat([src * n + dst, dst * n + src])
        keys = n_id[edge_index[0]] * n + n_id[edge_index[1]]
        keep = ~torch.isin(keys, seeds)
        hops = torch.repeat_interleave(torch.arange(len(hop_edges)), torch.tensor(hop_edges, dtype=torch.int64))
        kept = torch.bincount(hops[keep], minlength=len(hop_edges)).tolist()
        return keep, kept


class LinkTask(NodeTask):
    """Link prediction: a batch is the subgraph around a batch of a link split's edges and their negatives
    (see the module docstring); the seeds of a split are its edges' positions."""

    name = "link"

    def __init__(self, cfg: LinkDataConfig, ctx: ProcessContext, dataset: Any = None):
        super().__init__(cfg, ctx, dataset)
        self.links = LinkBatchSampler(cfg, self.dataset)
        self.splits = self.links.splits

    @classmethod
    def open(cls, cfg: Any, ctx: ProcessContext) -> OnDiskDataset:
        return open_links(cfg, ctx)

    @classmethod
    def seed_batches_of(cls, cfg: Any, ds: Any, ctx: ProcessContext) -> SeedBatches:
        return link_batches(cfg, ds, ctx)

    def sample(self, split: str, sampler: Any, seeds: torch.Tensor, seed: int) -> Data:
        """The minibatch of the edges at positions ``seeds`` of link split ``split``, drawn with ``seed``."""
        return self.links.sample(split, seeds, seed, sampler)

    def presample_nodes(self, sampler: Any, seeds: torch.Tensor, seed: int) -> torch.Tensor:
        return self.sample("train", sampler, seeds, seed).n_id

    def seeds_per_batch(self) -> int:
        return self.links.seeds_per_batch()

    def seed_memory(self) -> dict[str, Any]:
        """The seeds are edge positions: an epoch's order is one int32 permutation of them (int64 past
        2**31 edges), an evaluation pass an int32 ``arange``, and nothing is held between passes; a batch
        carries its edges' negatives."""
        sizes = {s: self.splits[s].src.numel() for s in SPLITS}
        wide = 4 if max(sizes.values()) < 2**31 else 8
        return {"split_sizes": sizes, "seed_bytes": (wide, 0, wide), "negatives": self.links.negatives()}

    def per_epoch(self) -> str:
        return f"edges per epoch ({self.links.describe()})"


class LinkPassesMixin:
    """What a link pass source offers besides its backend's: its link batches by split and positions."""

    task: LinkTask

    @property
    def links(self) -> LinkBatchSampler:
        return self.task.links

    @property
    def splits(self) -> dict[str, Any]:
        return self.task.splits

    def sample_links(self, split: str, positions: torch.Tensor, seed: int) -> Data:
        """The minibatch of the edges at ``positions`` of link split ``split``, drawn with ``seed`` (no ``x``)."""
        return self.task.sample(split, self.sampler if split == "train" else self.eval_sampler, positions, seed)


class LinkPasses(LinkPassesMixin, LocalPasses):
    """Link prediction over the tiered store (see the module docstring)."""

    task_type = LinkTask


class DeviceTableLinkPasses(LinkPassesMixin, DeviceTablePasses):
    """Link prediction over the device table (every feature row in the training device's memory): the same
    link batches and pipeline without the hierarchy, the in-memory reference of ``OutOfCoreLinkData``."""

    task_type = LinkTask


class SyncLinkPasses(LinkPassesMixin, SyncPasses):
    """The link batches of :class:`LinkPasses` (the same :class:`LinkBatchSampler`, positions and seeds),
    drawn and read synchronously in the trainer's thread with features in RAM or a memory map: what
    "PyG's link loader with memory-mapped features" amounts to, the baseline of ``bench epoch``'s link
    setting. In order it gives the very same minibatches as ``OutOfCoreLinkData``."""

    task_type = LinkTask


def _endpoint_times(t: torch.Tensor, b: int, n: int, triplet: bool) -> torch.Tensor:
    """The time of each of a link batch's ``n`` seed nodes, laid out as :meth:`LinkBatchSampler.sample` lays
    them out, from its ``b`` edges' times ``t``: triplets ``[src, dst, dst_neg (per edge, in a row)]``, each
    negative at its edge's time; binary ``[src, src_neg, dst, dst_neg]``, the ``j``-th negative pair at edge
    ``j % b``'s time (as PyG repeats ``edge_label_time``)."""
    t = t.to(torch.int64)
    if triplet:
        k = (n - 2 * b) // max(b, 1)
        return torch.cat([t, t, t.repeat_interleave(k)])
    side = n // 2
    one = t.repeat(-(-side // max(b, 1)))[:side]
    return torch.cat([one, one])

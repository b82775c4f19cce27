"""The feature-store protocol: what the pipeline asks of a store, keyed by node type.

A pipeline run (:class:`~lightning_ooc.loader.pipeline.EpochRun`) drives any store through these calls and
nothing else: it claims a sampled batch's rows (``claim_batch``), fills them in an extractor thread
(``fill``; ``abandon`` gives every lease back when that fails), pins the batch's index tensors (``pin``),
attaches ``x`` on the training device (``attach``) and hands the leases back with the gather's completion
fence (``release``). Evaluation passes run on ``without("buffer")``.

Rows are keyed by node type, as PyG's ``TensorAttr`` group name and GraphBolt's feature keys are: a
homogeneous graph is the one type ``None`` (:data:`HOMOGENEOUS`), a heterogeneous graph has one chain of
tiers per type with features. :meth:`StoreProtocol.of` is the chain of one type, a
:class:`~lightning_ooc.store.tiered.TieredFeatureStore`, whose tiers keep their statistics per tier
(:class:`~lightning_ooc.store.tier.ExtractStats`; a remote tier's own under ``tiers["remote"]``).

Two stores have it: :class:`~lightning_ooc.store.tiered.TieredFeatureStore` (one type) and
:class:`~lightning_ooc.store.typed_stores.HeteroFeatureStore` (a chain per type, planned as one). A new kind of
store (packed minibatches, say) is a third class with these members.

Example::

    >>> import tempfile, torch, lightning_ooc
    >>> from lightning_ooc.data.synth import synthesize
    >>> from lightning_ooc.store.protocol import StoreProtocol, HOMOGENEOUS
    >>> from lightning_ooc.store.tiered import TieredFeatureStore
    >>> ds = lightning_ooc.open_dataset(synthesize(tempfile.mkdtemp() + "/g", num_nodes=300, avg_degree=4,
    ...                                            num_features=8, num_classes=2, progress=False))
    >>> store = TieredFeatureStore.create(ds, buffer_slots=32, staging_bytes=8192)
    >>> isinstance(store, StoreProtocol), store.node_types, store.of(HOMOGENEOUS) is store
    (True, (None,), True)
    >>> store.close()
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from lightning_ooc.store.tier import Fence
from lightning_ooc.utils.cancel import NEVER, CancelToken

if TYPE_CHECKING:  # lazy: only for annotations (tiered.py implements this protocol)
    from lightning_ooc.store.tiered import TieredFeatureStore

#: the node type of a homogeneous graph's rows (PyG's and GraphBolt's ``None``)
HOMOGENEOUS = None


@runtime_checkable
class StoreProtocol(Protocol):
    """What a pipeline run uses of a feature store (see the module docstring)."""

    #: the node types whose rows the store serves (``(None,)``: a homogeneous graph)
    node_types: tuple[str | None, ...]

    def of(self, node_type: str | None) -> "TieredFeatureStore":
        """The chain of tiers of ``node_type`` (a ``KeyError`` naming the types it has for another)."""
        ...

    def claim_batch(self, data: Any, cancel: CancelToken = NEVER) -> Any:
        """Claim the rows of a sampled batch (its ``n_id``, per node type); may wait for room in a tier."""
        ...

    def fill(self, ext: Any, cancel: CancelToken = NEVER) -> None:
        """Make every claimed row readable (I/O, in an extractor thread); on failure every lease is given back."""
        ...

    def abandon(self, ext: Any) -> None:
        """Give back a claim whose rows were never all filled."""
        ...

    def pin(self, ext: Any) -> None:
        """Pin the claim's index tensors (extractor side), so the trainer's copies need no host synchronisation."""
        ...

    def attach(self, data: Any, ext: Any, device: torch.device | str | None = None) -> None:
        """Set the batch's ``x`` (per node type) from its claimed rows, on ``device``."""
        ...

    def release(self, ext: Any, fence: Fence | None = None) -> None:
        """Done with the batch: every tier gets its lease back, to be reused after ``fence``."""
        ...

    def without(self, name: str) -> "StoreProtocol":
        """The same store with tier ``name`` replaced by its source in every chain (closes nothing)."""
        ...

    def close(self) -> None:
        ...


def missing_type(node_type: Any, have: Any) -> KeyError:
    """The error for a node type a store has no chain for."""
    return KeyError(f"no feature store for node type {node_type!r}; the store has {', '.join(map(repr, have))}")

"""Inference over every node of a graph larger than memory: layer by layer, each layer's states on disk.

:func:`layerwise` runs a model one layer at a time over all nodes with
blocked aggregation (:mod:`lightning_ooc.infer.run`); :mod:`~lightning_ooc.infer.model`
says what a model must tell it, :mod:`~lightning_ooc.infer.layers` which
layers run blocked and how, :mod:`~lightning_ooc.infer.hetero_layerwise` how a
relational model runs over a heterogeneous dataset.

    >>> from lightning_ooc.infer import layerwise, plan_layerwise, LayerByLayer
"""
from lightning_ooc.infer.model import HeteroLayerByLayer, LayerByLayer, LayerSteps, hetero_steps, layer_steps
from lightning_ooc.infer.run import LayerwisePlan, LayerwiseResult, layerwise, plan_layerwise

__all__ = ["LayerByLayer", "LayerSteps", "layer_steps", "layerwise", "plan_layerwise", "LayerwisePlan",
           "LayerwiseResult", "HeteroLayerByLayer", "hetero_steps"]

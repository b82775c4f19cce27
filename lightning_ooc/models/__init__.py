"""Node classifiers (homogeneous, and R-GAT/R-SAGE for heterogeneous graphs), a link predictor and
knowledge-graph embedding models (Dot, DistMult, ComplEx) as LightningModules.

>>> from lightning_ooc.models import GraphSAGE
>>> model = GraphSAGE(in_channels=16, num_classes=4, hidden_channels=32, num_layers=2)
>>> type(model.gnn).__name__
'GraphSAGE'
"""
from lightning_ooc.models.relational import RGAT, RSAGE, HeteroNodeClassifier
from lightning_ooc.models.kge import ComplEx, DistMult, DotKGE, KGEModel
from lightning_ooc.models.link_predictor import LinkPredictor
from lightning_ooc.models.node_classifier import GAT, GCN, MLP, GraphSAGE, NodeClassifier

__all__ = ["NodeClassifier", "GraphSAGE", "GCN", "GAT", "MLP", "LinkPredictor", "HeteroNodeClassifier", "RGAT",
           "RSAGE", "KGEModel", "DotKGE", "DistMult", "ComplEx"]

"""Turn an in-memory PyG graph into an on-disk dataset and read it back.

    python examples/prepare_your_graph.py /tmp/my_graph
"""
import sys

import numpy as np
import torch
from torch_geometric.data import Data

import lightning_ooc
from lightning_ooc.data.prepare import prepare_from_pyg

def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "data/example"
    num_nodes, dim = 10_000, 32
    g = torch.Generator().manual_seed(0)
    data = Data(
        x=torch.randn(num_nodes, dim, generator=g),
        edge_index=torch.randint(0, num_nodes, (2, 100_000), generator=g),
        y=torch.randint(0, 5, (num_nodes,), generator=g),
    )
    data.train_mask = torch.rand(num_nodes, generator=g) < 0.1

    # Directed citation-style edges become undirected; repeats are dropped; rows stored as bfloat16.
    prepare_from_pyg(out, data, add_reverse=True, drop_duplicates=True, feature_dtype="bfloat16", overwrite=True)

    ds = lightning_ooc.open_dataset(out)
    print(ds)
    v = int(np.argmax(ds.in_degree))
    print(f"node {v} has {ds.in_degree[v]} in-neighbours, the first few: {ds.indices[ds.indptr[v]:ds.indptr[v] + 5]}")
    print("its features:", ds.read_features([v])[0, :4])


if __name__ == "__main__":
    main()

/* Heterogeneous neighbour sampling (hetero.cpp), a function of lightning_ooc._sampler. */
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *looc_py_sample_hetero(PyObject *self, PyObject *args, PyObject *kwargs);

/* Free the calling thread's heterogeneous sampling workspace. */
void looc_release_hetero_workspace();

#define LOOC_SAMPLE_HETERO_DOC                                                                                      \
    "sample_hetero(num_nodes, relations, seeds, input_type, num_hops, replace, rng_seed, return_e_id, *,\n"        \
    "              disjoint=False, node_time=None, seed_time=None, time_window=-1, last=False)\n"                 \
    "--\n\n"                                                                                                        \
    "Sample one minibatch of a heterogeneous graph. num_nodes: the node count of each node type.\n"               \
    "relations: one tuple (indptr, indices, src_type, dst_type, fanouts, name[, edge_time]) per edge type, in\n"  \
    "sampling order: its in-edge CSC over per-type ids (indptr int64 with num_nodes[dst_type] + 1 entries;\n"     \
    "indices int32 or int64 ids of src_type), the node type indices of its sources and targets, num_hops\n"       \
    "fanouts (-1: all in-edges), a name for error messages and optionally the int64 time of each edge.\n"        \
    "seeds: int64 ids of node type input_type. Temporal (node_time: one int64 array or None per node type, or\n" \
    "edge times; with seed_time): as the homogeneous sample(); each seed gets a subgraph of its own.\n"          \
    "Returns (n_id, edge_index, e_id, num_sampled_nodes, num_sampled_edges, batch): a list of int64 buffers per\n" \
    "node type, a list per relation (2 x E items, row 0 then row 1), e_id likewise or None, the per-hop counts\n" \
    "(num_hops + 1 per node type, num_hops per relation), and the seed of each node per node type (disjoint or\n" \
    "temporal; else None). The GIL is released while sampling."

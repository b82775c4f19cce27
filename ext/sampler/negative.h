/* Negative sampling for link prediction (negative.cpp), a function of lightning_ooc._sampler. */
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *looc_py_negatives(PyObject *self, PyObject *args, PyObject *kwargs);

#define LOOC_NEGATIVES_DOC                                                                                          \
    "negatives(indptr, indices, src, dst, out_src, out_dst, triplet, degree, strict, rng_seed, max_tries)\n"         \
    "--\n\n"                                                                                                        \
    "Draw negative edges into out_dst (and out_src, binary only); returns how many could not be made strict.\n"    \
    "binary: len(out_src) == len(out_dst) random (source, destination) pairs; triplet: len(out_dst) =\n"           \
    "len(src) x amount destinations, `amount` per positive (src[i], dst[i]). degree: sources in proportion to\n"   \
    "their out-degree, destinations to their in-degree (else uniform). strict: redraw, up to max_tries times, a\n" \
    "pair that is an edge of the graph or one of the positives (and, triplet, a destination equal to the\n"       \
    "positive's). The GIL is released while drawing."

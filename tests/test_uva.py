"""The zero-copy gather kernel of lightning_ooc.store.uva, checked on CPU.

Triton's interpreter must be switched on (``TRITON_INTERPRET=1``) before
``triton`` is imported, so the kernel runs in a subprocess: this file run as a
script (``python tests/test_uva.py cases|overflow``) runs the cases named below
and prints one JSON line per case; the tests read those lines. The main pytest
process never sets the variable.

Offsets past 2**31 elements are checked without allocating them: ``_window``
makes a tensor of more than 2**31 elements whose last rows are a small real
buffer and whose other rows are never mapped (a ctypes array at an address
below the buffer, seen by ``torch.frombuffer``). The interpreter takes the
tensor's ``data_ptr()`` as the pointer and dereferences only the addresses the
kernel computes, so the kernel reads and writes the real buffers only if its
row offsets (``row * n_cols``, source and output) are right past 2**31; a
32-bit offset wraps to an unmapped address (a crash) or a wrong row.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (it is in the dev extra)")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# name -> (dtype, n_cols, n_src, n, n_out, how)
CASES = {}
for _dt in DTYPES:
    for _d in (1, 3, 37, 100, 128, 256):
        CASES[f"{_dt}-d{_d}"] = (_dt, _d, 50, 45, 60, "scattered")
CASES.update(
    {
        "float32-d1500-two-column-steps": ("float32", 1500, 20, 9, 12, "scattered"),
        "float16-d2101-three-column-steps": ("float16", 2101, 20, 9, 12, "scattered"),
        "float32-d3-five-programs": ("float32", 3, 400, 300, 310, "scattered"),
        "float32-d128-empty": ("float32", 128, 10, 0, 5, "scattered"),
        "float16-d37-empty": ("float16", 37, 10, 0, 5, "scattered"),
        "float32-d37-repeated": ("float32", 37, 10, 20, 20, "repeated"),
        "bfloat16-d128-repeated": ("bfloat16", 128, 10, 20, 20, "repeated"),
        "float32-d37-in-order": ("float32", 37, 30, 30, 30, "in_order"),
        "float32-d4-src-view-16B": ("float32", 4, 50, 30, 40, "view_rows"),  # rows 16 B, source 16 B past a line
        "float32-d3-src-view-12B": ("float32", 3, 50, 30, 40, "view_rows"),
        "float32-d4-src-view-4B": ("float32", 4, 50, 30, 40, "view_elem"),  # rows 16 B, source not 16 B aligned
        "float16-d8-out-rows-int32": ("float16", 8, 50, 30, 40, "int32_index"),
    }
)

# name -> (dtype, n_cols): source and output rows past 2**31 elements
OVERFLOW = {
    "float32-d37": ("float32", 37),
    "float32-d128": ("float32", 128),
    "bfloat16-d100": ("bfloat16", 100),
    "float16-d256": ("float16", 256),
}


# ---- run in the subprocess, under TRITON_INTERPRET=1 ------------------------------------------


def _case(name, dtype, n_cols, n_src, n, n_out, how):
    from lightning_ooc.store import uva

    g = torch.Generator().manual_seed(sum(map(ord, name)))
    dt = DTYPES[dtype]
    if how == "view_rows":  # a source starting one row into its allocation
        src = torch.randn(n_src + 1, n_cols, generator=g).to(dt)[1:]
    elif how == "view_elem":  # a source starting one element into its allocation
        src = torch.randn(n_src * n_cols + 1, generator=g).to(dt)[1:].view(n_src, n_cols)
    else:
        src = torch.randn(n_src, n_cols, generator=g).to(dt)
    if how == "repeated":
        pos = torch.full((n,), 3, dtype=torch.int64)
        pos[::3] = n_src - 1
        out_rows = torch.randperm(n_out, generator=g)[:n]
    elif how == "in_order":
        pos = torch.arange(n)
        out_rows = torch.arange(n)
    else:
        pos = torch.randint(0, n_src, (n,), generator=g)  # repeats included
        out_rows = torch.randperm(n_out, generator=g)[:n]  # scattered, some rows left alone
    if how == "int32_index":
        pos, out_rows = pos.int(), out_rows.int()
    out = torch.full((n_out, n_cols), -7.0, dtype=dt)
    want = out.clone()
    want.index_copy_(0, out_rows.long(), src.index_select(0, pos.long()))
    uva.triton_gather_into(out, out_rows, src, pos)
    plan = uva.kernel_plan(n_cols, src.element_size(), src.data_ptr(), n)
    return torch.equal(out.view(torch.uint8), want.view(torch.uint8)), plan["VEC"]


def _window(buf, first_row):
    """A tensor of ``first_row + len(buf)`` rows whose last rows are ``buf``; the others are never mapped."""
    import ctypes

    row_bytes = buf.shape[1] * buf.element_size()
    addr = buf.data_ptr() - first_row * row_bytes
    assert addr > 0, "buffer address too low for the window"
    raw = (ctypes.c_char * ((first_row + buf.shape[0]) * row_bytes)).from_address(addr)
    t = torch.frombuffer(raw, dtype=buf.dtype).view(first_row + buf.shape[0], buf.shape[1])
    t._keep_alive = (raw, buf)
    return t


def _overflow(name, dtype, n_cols):
    from lightning_ooc.store import uva

    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    src_real = torch.randn(20, n_cols, generator=g).to(dt)
    out_real = torch.full((30, n_cols), -7.0, dtype=dt)
    first_src = 2**31 // n_cols + 5  # source row first_src starts past element 2**31
    first_out = 2**31 // n_cols + 9
    src, out = _window(src_real, first_src), _window(out_real, first_out)
    assert src.numel() > 2**31 and out.numel() > 2**31
    j = torch.tensor([3, 0, 19, 3, 7, 12, 19])
    k = torch.tensor([29, 0, 5, 11, 17, 2, 28])
    uva.triton_gather_into(out, k + first_out, src, j + first_src)
    want = torch.full((30, n_cols), -7.0, dtype=dt)
    want[k] = src_real[j]
    plan = uva.kernel_plan(n_cols, src.element_size(), src.data_ptr(), len(j))
    return torch.equal(out_real.view(torch.uint8), want.view(torch.uint8)), plan["VEC"]


def _main(what):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases, fn = (CASES, _case) if what == "cases" else (OVERFLOW, _overflow)
    for name, args in cases.items():
        try:
            ok, vec = fn(name, *args)
            print(json.dumps({"name": name, "ok": ok, "vec": vec}), flush=True)
        except Exception as e:  # one case's error does not hide the others
            print(json.dumps({"name": name, "ok": False, "error": repr(e)}), flush=True)


# ---- the tests -----------------------------------------------------------------------------------


def _run_interpreted(what):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, what], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["name"]] = r
    return proc, results


def _check(proc, results, name):
    r = results.get(name)
    assert r is not None, f"no result for {name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert r["ok"], f"{name}: {r.get('error', 'output differs from index_select')}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def interpreted():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (it is in the dev extra)")
    return _run_interpreted("cases")


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_index_select(interpreted, name):
    proc, results = interpreted
    dtype, n_cols, *_, how = CASES[name]
    _check(proc, results, name)
    row_bytes = n_cols * DTYPES[dtype].itemsize
    want_vec = 16 // DTYPES[dtype].itemsize if row_bytes % 16 == 0 and how != "view_elem" else 1
    assert results[name]["vec"] == want_vec


@needs_triton
def test_offsets_past_2_31_elements():
    proc, results = _run_interpreted("overflow")
    for name in OVERFLOW:
        _check(proc, results, name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {results[n]["vec"] for n in OVERFLOW} == {1, 4, 8}  # both variants


@needs_triton
def test_aligned_rows_compile_to_16_byte_loads(tmp_path, monkeypatch):
    """For sm_90 (no GPU needed), rows of a multiple of 16 bytes give 16-byte loads and stores."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_ooc.store import uva

    if not isinstance(uva._gather_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("the kernel is interpreted in this process")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences a warning; no floating point here
    for n_cols, dt, want in [(100, torch.float32, True), (256, torch.float16, True), (37, torch.float32, False)]:
        plan = uva.kernel_plan(n_cols, dt.itemsize, 4096, 1000)
        ty = {torch.float32: "*fp32", torch.float16: "*fp16"}[dt]
        sig = {"src": ty, "pos": "*i64", "out": ty, "out_rows": "*i64", "n": "i32", "n_vecs": "i32", "src_mis": "i32"}
        sig.update({k: "constexpr" for k in plan})
        constexprs = {(7 + i,): v for i, v in enumerate(plan.values())}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # what the launcher infers for aligned pointers
        try:
            src = ASTSource(fn=uva._gather_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        except (ImportError, FileNotFoundError, KeyError) as e:  # a Triton without the NVIDIA backend or ptxas
            pytest.skip(f"cannot compile for CUDA here: {e!r}")
        vec_ld = bool(re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx))
        vec_st = bool(re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx))
        assert (vec_ld, vec_st) == (want, want), (n_cols, dt, plan)


def test_kernel_plan_variants():
    from lightning_ooc.store import uva

    assert uva.kernel_plan(128, 4, 4096, 100)["VEC"] == 4
    assert uva.kernel_plan(128, 4, 4096, 100)["MAX_SHIFT"] == 0  # whole lines: no shift
    assert uva.kernel_plan(100, 4, 4096, 100)["MAX_SHIFT"] == 28
    assert uva.kernel_plan(100, 2, 4096, 100)["VEC"] == 1  # 200-byte rows
    assert uva.kernel_plan(4, 4, 4100, 100)["VEC"] == 1  # source not 16-byte aligned
    assert uva.kernel_plan(8, 2, 4096, 100)["VEC"] == 8
    for n_cols, esize, n in [(1, 4, 1), (3, 2, 1000), (5000, 4, 7), (100, 2, 3)]:
        p = uva.kernel_plan(n_cols, esize, 4096, n)
        for k in ("ROWS", "BLOCK"):
            assert p[k] & (p[k] - 1) == 0, p
        assert p["ROWS"] * p["BLOCK"] * esize <= max(uva._TILE_BYTES, p["BLOCK"] * esize)
        # one compiled kernel per row shape: the plan does not depend on the batch's row count
        assert {k: v for k, v in uva.kernel_plan(n_cols, esize, 4096, 10 * n + 3).items()} == p


@pytest.mark.parametrize("have_triton", [True, False])
def test_gather_rows_into_cpu(monkeypatch, have_triton):
    from lightning_ooc.store import uva

    monkeypatch.setattr(uva, "HAVE_TRITON", have_triton and uva.HAVE_TRITON)
    host = torch.randn(40, 37)
    pos = torch.tensor([5, 5, 0, 39, 12])
    out_rows = torch.tensor([7, 1, 3, 0, 6])
    for zero_copy in (False, True):
        x = torch.full((9, 37), -1.0)
        uva.gather_rows_into(x, out_rows, host, pos, zero_copy=zero_copy)
        want = torch.full((9, 37), -1.0)
        want[out_rows] = host[pos]
        assert torch.equal(x, want)
        uva.gather_rows_into(x, out_rows[:0], host, pos[:0], zero_copy=zero_copy)  # nothing to do
        assert torch.equal(x, want)
        assert torch.equal(uva.gather_rows(host, pos, torch.device("cpu"), zero_copy), host[pos])


@needs_triton
def test_triton_gather_into_rejects_bad_arguments():
    from lightning_ooc.store import uva

    src, out = torch.zeros(4, 3), torch.zeros(5, 3)
    i = torch.tensor([0, 1])
    with pytest.raises(ValueError):
        uva.triton_gather_into(torch.zeros(5, 4), i, src, i)
    with pytest.raises(ValueError):
        uva.triton_gather_into(out.half(), i, src, i)
    with pytest.raises(ValueError):
        uva.triton_gather_into(torch.zeros(3, 5).t(), i, src, i)
    with pytest.raises(IndexError):
        uva.triton_gather_into(out, i, src, torch.tensor([0, 4]))
    with pytest.raises(IndexError):
        uva.triton_gather_into(out, torch.tensor([-1, 0]), src, i)



@pytest.mark.parametrize("sort_min", [2, 1 << 62])
def test_the_kernel_reads_source_rows_in_ascending_order_and_each_lands_in_its_row(monkeypatch, sort_min):
    # GPU reads of registered host memory in address order run at ~0.95 of pinned cudaMemcpy, in a batch's
    # random order at ~0.36 (H100): the launch gets the positions sorted, and out_rows permuted with them
    from lightning_ooc.store import uva

    seen = []

    def launch(out, out_rows, src, pos, n_cols, element_size):  # the kernel's contract, on the CPU
        seen.append(pos.clone())
        out.index_copy_(0, out_rows, src.index_select(0, pos))

    monkeypatch.setattr(uva, "HAVE_TRITON", True)
    monkeypatch.setattr(uva, "_launch", launch)
    monkeypatch.setattr(uva, "SORT_MIN", sort_min)
    g = torch.Generator().manual_seed(3)
    src = torch.randn(500, 8, generator=g)
    pos = torch.randint(0, 500, (300,), generator=g)  # repeats included
    out_rows = torch.randperm(400, generator=g)[:300]
    out = torch.full((400, 8), -1.0)
    uva.triton_gather_into(out, out_rows, src, pos)
    want = torch.full((400, 8), -1.0)
    want[out_rows] = src[pos]
    assert torch.equal(out, want)
    if sort_min == 2:
        assert torch.equal(seen[0], pos.sort().values)
    else:
        assert torch.equal(seen[0], pos)  # below the threshold: the batch's own order

if __name__ == "__main__":
    _main(sys.argv[1])

"""Build the native extensions in ``ext/``.

Each sub-folder of ``ext/`` is one extension module ``lightning_ooc._<folder>``
built from the ``.c`` / ``.cpp`` files it holds (C++ if any ``.cpp`` is
present). Only the CPython API is used: no PyTorch C++ headers, so the build
takes seconds and the result works with any torch.

liburing is linked statically when found, so nothing is needed at run time:

* ``LIBURING_PREFIX=/some/dir`` points at a tree with ``include/liburing.h``
  and ``lib/liburing.a`` (or ``usr/include`` / ``usr/lib/<triplet>``, as
  ``dpkg -x liburing-dev_*.deb DIR`` unpacks it);
* otherwise the system headers (Debian ``liburing-dev``) are used.

Without liburing the ``_io`` module is still built, with the io_uring backend
compiled out; the reader then falls back to its thread-pool backend and says
so in the log.
"""
from __future__ import annotations

import glob
import os
import sys
import sysconfig

from setuptools import Extension, setup


def _find_liburing():
    """Return (include_dir, static_lib or None, shared_lib_dir or None) or None."""
    prefixes = []
    env = os.environ.get("LIBURING_PREFIX")
    if env:
        prefixes.append(env)
    prefixes += ["/usr/local", "/usr", "/"]
    triplet = sysconfig.get_config_var("MULTIARCH") or ""
    for prefix in prefixes:
        for inc in (os.path.join(prefix, "include"), os.path.join(prefix, "usr", "include")):
            if not os.path.exists(os.path.join(inc, "liburing.h")):
                continue
            libdirs = []
            for base in (prefix, os.path.join(prefix, "usr")):
                libdirs += [os.path.join(base, "lib", triplet), os.path.join(base, "lib64"), os.path.join(base, "lib")]
            for d in libdirs:
                if os.path.exists(os.path.join(d, "liburing.a")):
                    return inc, os.path.join(d, "liburing.a"), None
            for d in libdirs:
                if glob.glob(os.path.join(d, "liburing.so*")):
                    return inc, None, d
    return None


def _extension(folder: str) -> Extension | None:
    srcdir = os.path.join("ext", folder)
    sources = sorted(glob.glob(os.path.join(srcdir, "*.c")) + glob.glob(os.path.join(srcdir, "*.cpp")))
    if not sources:
        return None
    cpp = any(s.endswith(".cpp") for s in sources)
    args = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
    args += ["-std=c++17"] if cpp else ["-std=gnu11"]
    ext = Extension(
        f"lightning_ooc._{folder}",
        sources=sources,
        include_dirs=[srcdir, os.path.join("ext", "include")],
        extra_compile_args=args,
        extra_link_args=["-pthread"],
        language="c++" if cpp else "c",
        depends=sorted(glob.glob(os.path.join(srcdir, "*.h")) + glob.glob(os.path.join("ext", "include", "*.h"))),
    )
    if folder == "io":
        found = _find_liburing()
        if found is None:
            print(f"lightning_ooc: liburing not found; building _{folder} without io_uring "
                  "(install liburing-dev or set LIBURING_PREFIX)", file=sys.stderr)
        else:
            inc, static, shared_dir = found
            if os.path.realpath(inc) != "/usr/include":
                ext.include_dirs.append(inc)
            ext.define_macros.append(("LOOC_HAVE_LIBURING", "1"))
            if static:
                ext.extra_objects.append(static)
            else:
                ext.library_dirs.append(shared_dir)
                ext.libraries.append("uring")
    return ext


FOLDERS = ["io", "sampler", "kernels"]
# LOOC_EXT_ONLY=io,sampler builds a subset (handy while working on one module).
if os.environ.get("LOOC_EXT_ONLY"):
    FOLDERS = [f for f in FOLDERS if f in os.environ["LOOC_EXT_ONLY"].split(",")]
setup(ext_modules=[e for e in map(_extension, FOLDERS) if e is not None])

"""Run libpecos 1.2.8 (XR-Linear) on numpy 2 / scipy >= 1.14.

libpecos 1.2.8 pins numpy<2 and scipy<1.14, while onnx's ml-dtypes (a core dependency of
export) needs numpy>=2, so the two cannot share one resolved environment. XR-Linear's
Python side touches only two things those releases removed: scipy.sparse.sputils helpers
and np.array(copy=False) when wrapping the C library's output buffers. Patching those in
the bench process (never in service/ or training/) lets the unmodified C++ core run;
its predictions are checked against numpy 1.x results by the accuracy the bench reports.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as smat
import scipy.sparse._sputils as private_sputils


def _cs_matrix(arg1, mat_type, shape=None, dtype=None, copy=False, check_contents=False):  # noqa: ANN001
    # Same as pecos.utils.smat_util.cs_matrix, with numpy-2 copy semantics
    # (copy=False meant "copy only if needed", which is np.asarray now).
    data, indices, indptr = arg1
    indices_dtype = private_sputils.get_index_dtype(indices, check_contents=check_contents)
    indptr_dtype = private_sputils.get_index_dtype(indptr, check_contents=check_contents)
    ret = mat_type(shape, dtype=dtype)
    as_array = np.array if copy else np.asarray
    ret.indices = as_array(indices, dtype=indices_dtype)
    ret.indptr = as_array(indptr, dtype=indptr_dtype)
    ret.data = as_array(data, dtype=dtype)
    return ret


def patch_pecos() -> None:
    """Idempotently make pecos' sparse helpers work on the installed numpy/scipy."""
    import pecos.utils.smat_util as smat_util

    legacy = smat.sputils
    for name in ("get_index_dtype", "upcast"):
        if not hasattr(legacy, name):
            setattr(legacy, name, getattr(private_sputils, name))
    if int(np.__version__.split(".")[0]) >= 2:
        smat_util.cs_matrix = _cs_matrix

"""The C kernels' self-tests, run on a fresh build of each: where the host's compiler builds a
kernel, its self-test must pass. (Elsewhere a kernel that fails its self-test is switched off and
its tests skip, so a kernel broken by a change would otherwise show as skips, not failures.)"""

from __future__ import annotations

import pytest

from multihead.backends import cpu_gemv, cpu_kernels, cpu_sparse, cpu_topk, native_build


@pytest.mark.parametrize(
    "module", [cpu_kernels, cpu_sparse, cpu_topk, cpu_gemv], ids=lambda m: m.__name__.rsplit(".", 1)[1]
)
def test_a_kernel_that_builds_passes_its_self_test(module):
    library = module._LIBRARY
    try:
        lib = library.build(native_build.FLAGS)
    except RuntimeError as error:  # no compiler here, or one that cannot build it: the kernel stays off
        pytest.skip(str(error))
    library._self_test(lib)  # raises AssertionError with what disagreed
    assert module.kernel() is not None, module.unavailable()

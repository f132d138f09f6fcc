"""An import-only stand-in for SGLang's ``sgl_kernel``, for CPU runs. Not a kernel library.

What it is: SGLang 0.5.23 on its CPU path (``--device cpu --attention-backend torch_native
--disable-overlap-schedule``) *imports* the eight names below from ``sgl_kernel`` (its
speculative-decoding and KV-cache helpers for CPU) but calls none of them when it serves a
plain model. The real ``sgl-kernel`` for CPU is built from SGLang's git sources, which the
package registries do not carry, and the published ``sglang-kernel`` wheel is a CUDA one that
fails without ``libcuda.so.1``. So this module lets ``import sglang`` succeed and nothing more:
every name raises ``NotImplementedError`` if it is ever called.

Where it is used: ``runtimes.sglang`` puts ``runtimes/sglang/cpu_kernel_stub`` on the SGLang
server's ``PYTHONPATH`` only when the device is ``cpu`` (and ``make sglang`` for its import
check). On a GPU machine the real ``sgl-kernel`` is installed and this directory is not on the
path. See docs/runtimes.md.
"""

__version__ = "0.0.0+shoal-cpu-import-stub"

_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def _unavailable(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is shoal's import-only CPU stub "
            "(runtimes/sglang/cpu_kernel_stub): it has no kernels. The feature that needs it "
            "(e.g. speculative decoding) is not available on SGLang's CPU path here; on a GPU "
            "machine install the real sgl-kernel and run without the stub."
        )

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


for _name in _NAMES:
    globals()[_name] = _unavailable(_name)
del _name

__all__ = list(_NAMES)

"""llama.cpp's OpenAI server (``llama_cpp.server``) without its extra CPU buffers.

llama.cpp's extra CPU buffer types repack the weights for AMX, and the first
forward over them dies here (SIGSEGV/SIGILL). llama-cpp-python 0.3.36 has
``use_extra_bufts`` in its ``llama_model_params`` but no argument or server
setting for it, so :func:`llama_without_extra_buffers` wraps its
default-params function once. ``tools.bench_serve`` starts the server as

    python -m tools.bench.llama_server --model FILE.gguf --port N --n_threads T ...

(every argument is ``llama_cpp.server``'s). llama-cpp-python is not a
dependency of shmcache: ``tools/bench/build_llama_cpp_wheel.sh`` builds and caches
its wheel.
"""
from __future__ import annotations

import runpy


def llama_without_extra_buffers():
    """llama_cpp's ``Llama`` class, every model then loaded with ``use_extra_bufts=False``.

    Raises ImportError where llama_cpp is not installed."""
    import llama_cpp.llama_cpp as low
    if not getattr(low.llama_model_default_params, "shmcache_no_extra_bufts", False):
        defaults = low.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params
        without_extra_bufts.shmcache_no_extra_bufts = True  # type: ignore[attr-defined]
        low.llama_model_default_params = without_extra_bufts
    from llama_cpp import Llama
    return Llama


if __name__ == "__main__":
    llama_without_extra_buffers()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)

"""Test-run hook (not part of the package; put this folder first on ``PYTHONPATH``): when LLCPP_FORCE_NGL is set, every llama_cpp.Llama built in
this process (SkippyLlama and the tests' plain Llama alike) gets n_gpu_layers=LLCPP_FORCE_NGL unless the
caller passed one; LLCPP_FORCE_UBATCH sets n_batch = n_ubatch, LLCPP_FORCE_THREADS n_threads and
n_threads_batch (several pytest lanes on one machine must not oversubscribe its cores: llama.cpp's
threads spin) and LLCPP_FORCE_FA turns flash attention on the same way (CPU + flash attention + small n_ubatch reproduces the GPU's canonical-batching
conditions locally). Subprocesses inherit it through PYTHONPATH. Chains to any other sitecustomize.

Used by ``.ci/run``'s GPU-like lane (``LLCPP_FORCE_NGL=0 LLCPP_FORCE_UBATCH=64``) and by
``scripts/gpu.sh test`` (``n_gpu_layers`` -1 and 0 on a CUDA build). Do not name such variables
``SKIPPY_*``: the L3 tests strip those from their worker processes."""

import os
import sys

_ngl = os.environ.get("LLCPP_FORCE_NGL")
if _ngl:
    import importlib.abc
    import importlib.machinery
    from typing import Any

    ngl = _ngl

    class _PatchLlama(importlib.abc.MetaPathFinder):
        def find_spec(
            self, name: str, path: Any, target: Any = None
        ) -> importlib.machinery.ModuleSpec | None:
            if name != "llama_cpp.llama":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_orig = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                exec_orig(module)
                cls = module.Llama
                init = cls.__init__

                def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                    kwargs.setdefault("n_gpu_layers", int(ngl))
                    if os.environ.get("LLCPP_FORCE_FA"):
                        kwargs.setdefault("flash_attn", True)
                    ub = os.environ.get("LLCPP_FORCE_UBATCH")
                    if ub:
                        kwargs.setdefault("n_batch", int(ub))
                        kwargs.setdefault("n_ubatch", int(ub))
                    threads = os.environ.get("LLCPP_FORCE_THREADS")
                    if threads:
                        kwargs.setdefault("n_threads", int(threads))
                        kwargs.setdefault("n_threads_batch", int(threads))
                    log = os.environ.get("LLCPP_FORCE_NGL_LOG")
                    if log:
                        with open(log, "a") as f:
                            f.write(
                                f"{os.getpid()} {type(self).__name__} ngl={kwargs['n_gpu_layers']}\n"
                            )
                    init(self, *args, **kwargs)

                cls.__init__ = __init__

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _PatchLlama())

_here = os.path.dirname(os.path.abspath(__file__))
for _p in list(sys.path):
    _f = os.path.join(os.path.abspath(_p or "."), "sitecustomize.py")
    if os.path.dirname(_f) != _here and os.path.isfile(_f):
        with open(_f) as _fh:
            exec(
                compile(_fh.read(), _f, "exec"), {"__name__": "_orig_sitecustomize", "__file__": _f}
            )
        break

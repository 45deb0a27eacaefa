"""Leasehold's sitecustomize for program jobs.

The agent starts a program job with this folder first on PYTHONPATH (and
python/, the leasehold package, after it), so Python's site module runs this
file at start-up. It does two things:

1. In a program job (LEASEHOLD_JOB_ID set) it installs an import hook that
   waits for ``import torch``: once torch's module has fully executed, it
   calls ``leasehold.torch.install()``, before the script can allocate CUDA
   memory. It imports neither torch nor leasehold itself: a script that never
   imports torch pays nothing. A failed install (too late: PyTorch's CUDA
   allocator was initialized during torch's own import; the plug-in cannot be
   loaded; an old torch) ends the process with status 1 and the error line
   (SystemExit from ``import torch``): a program job's CUDA memory comes from
   its leases, never from around them. Where install() does not apply (CPU
   torch, a CPU job) nothing is printed.
2. Always, it runs the next sitecustomize on sys.path after this folder, if
   any (Debian ships one in /usr/lib/python3.X), so nothing the system or
   the user's environment does at start-up is lost.
"""

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))

# The sitecustomize this one ran after itself (None: there was none).
next_sitecustomize = None


def _one_line(e):
    text = " ".join(str(e).split()) or type(e).__name__
    return text if text.startswith("leasehold") else "leasehold: " + text


def _after_torch():
    """Runs once torch's module has executed."""
    try:
        import leasehold.torch as plugin

        plugin.install()
    except Exception as e:
        raise SystemExit(_one_line(e) + " (the job's CUDA memory must come from its leases)") from e


class _Loader:
    """Runs torch's own loader, then _after_torch()."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        loader = self._loader
        # The module sees its own loader, not this wrapper.
        module.__loader__ = loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = loader
        loader.exec_module(module)
        _remove_hook()
        _after_torch()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class TorchImportHook:
    """A meta path finder that lets the other finders find torch and wraps
    its loader with _Loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


def _remove_hook():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TorchImportHook)]


def _install_hook():
    if not os.environ.get("LEASEHOLD_JOB_ID"):
        return
    if "torch" in sys.modules:  # imported before site ran (not in an ordinary start-up)
        _after_torch()
        return
    if not any(isinstance(f, TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchImportHook())


def _run_next_sitecustomize():
    """Runs the first sitecustomize found on sys.path after this folder."""
    import importlib.machinery
    import importlib.util

    entries = list(sys.path)
    start = 0
    for i, entry in enumerate(entries):
        if os.path.realpath(entry or os.curdir) == _HERE:
            start = i + 1
            break
    me = os.path.realpath(__file__)
    for entry in entries[start:]:
        try:
            spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        except Exception:
            continue
        if spec is None or spec.loader is None:
            continue
        if spec.origin and os.path.realpath(spec.origin) == me:
            continue
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # as site.py reports a failing sitecustomize
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             "%s: %s\n" % (type(e).__name__, e))
        return module
    return None


_install_hook()
next_sitecustomize = _run_next_sitecustomize()

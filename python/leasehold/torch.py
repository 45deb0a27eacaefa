"""Leasehold's leases as PyTorch's CUDA allocator.

``install()`` loads the plug-in (libleasehold_torch.so, whose path the agent
sets in LEASEHOLD_TORCH_PLUGIN) as PyTorch's whole CUDA allocator through
``torch.cuda.memory.CUDAPluggableAllocator``, with its record_stream and
empty_cache hooks. It must run before PyTorch's first CUDA allocation: the
agent's sitecustomize runs it right after ``import torch``.

This module imports torch only inside install(), never at import time.
docs/torch-plugin.md says what works through a pluggable allocator and what
does not.
"""

import ctypes
import logging
import os
import sys
import threading

from .regions import RegionError, cached_dataset, init_from, publish_parameters  # noqa: E402,F401

__all__ = ["AllocatorTooLate", "RegionError", "cached_dataset", "init_from", "install",
           "install_status", "publish_parameters", "restored_bytes_total", "spill", "spill_stats",
           "spilled_bytes_total", "stats"]

# leasehold.standby uses install(standby=True), standby_begin() and standby_end().

log = logging.getLogger("leasehold.torch")

# LEASEHOLD_TORCH_ABI_VERSION of torch_plugin/leasehold_torch.h.
ABI_VERSION = 5

_STATS_FIELDS = ("leased_bytes", "peak_leased_bytes", "in_use_bytes", "peak_in_use_bytes",
                 "allocations", "cache_hits", "lease_requests", "budget_bytes",
                 "unbacked_bytes", "unbacks", "refused_allocations")


class _Stats(ctypes.Structure):
    # struct leasehold_torch_stats, field for field.
    _fields_ = [(name, ctypes.c_uint64) for name in _STATS_FIELDS]


class AllocatorTooLate(RuntimeError):
    """PyTorch's own CUDA allocator is initialized already: too late to
    install Leasehold's."""


TOO_LATE = ("leasehold: PyTorch's CUDA allocator is already initialized, so Leasehold's can no "
            "longer be installed: leasehold.torch.install() must run before the first CUDA "
            "allocation (in a program job the automatic install does this right after "
            "`import torch`)")

# Reentrant: install() imports torch, whose import may run the sitecustomize
# hook, which calls install() again on the same thread.
_lock = threading.RLock()
_plugin = None     # the loaded plug-in (ctypes.CDLL) once installed
_allocator = None  # the CUDAPluggableAllocator, kept alive for the process
_status = {"attempted": False, "installed": False, "reason": "not attempted"}


def install(standby=False):
    """Makes the plug-in PyTorch's CUDA allocator. Idempotent.

    Returns True when it is PyTorch's allocator now; False, logging why at
    debug level, when this is not a program job on a CUDA device, the agent
    named no plug-in, or torch is built without CUDA. `standby`: installs it
    in a warm standby that has no job yet (leasehold.standby): the device
    comes from LEASEHOLD_DEVICE alone, the session opens at the first
    allocation after standby_end(), once the job's environment is set. Raises AllocatorTooLate
    (a RuntimeError) when PyTorch's CUDA allocator is initialized already,
    and RuntimeError when the plug-in cannot be loaded or installed.
    """
    global _plugin, _allocator
    with _lock:
        if _status["installed"]:
            return True
        _status["attempted"] = True
        try:
            lib, allocator, reason = _install(standby)
        except Exception as e:
            _status["reason"] = str(e)
            raise
        if _status["installed"]:  # by the import hook, while _install imported torch
            return True
        _status["reason"] = reason
        if lib is None:
            log.debug("leasehold: the plug-in is not installed: %s", reason)
            return False
        _plugin, _allocator = lib, allocator
        _status["installed"] = True
        if _spiller is not None:  # spill() ran inside _install, before the plug-in was known
            _set_pressure_handler(_spiller.relieve)
        log.debug("leasehold: %s", reason)
        return True


def _install(standby):
    """(plug-in, allocator, why) when installed; (None, None, why) when not
    applicable. Raises on failures."""
    import leasehold

    if standby:
        device = leasehold._env_device()
    else:
        job = leasehold.job()
        if job is None:
            return None, None, "not a Leasehold program job (LEASEHOLD_JOB_ID is not set)"
        device = job.device
    if not device.startswith("cuda"):
        return None, None, "the job's device is %s" % device
    path = os.environ.get("LEASEHOLD_TORCH_PLUGIN")
    if not path:
        return None, None, "LEASEHOLD_TORCH_PLUGIN is not set"

    import torch

    if _status["installed"]:  # the import hook installed it meanwhile
        return None, None, _status["reason"]
    if not getattr(torch.version, "cuda", None):
        return None, None, "PyTorch %s is built without CUDA" % torch.__version__
    memory = getattr(torch.cuda, "memory", None)
    if memory is None or not hasattr(memory, "CUDAPluggableAllocator") \
            or not hasattr(memory, "change_current_allocator"):
        raise RuntimeError("leasehold: PyTorch %s has no torch.cuda.memory.CUDAPluggableAllocator "
                           "(2.0 or later is needed)" % torch.__version__)
    if torch.cuda.is_initialized():
        raise AllocatorTooLate(TOO_LATE)

    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise RuntimeError("leasehold: cannot load the plug-in %s: %s" % (path, e)) from None
    try:
        _declare(lib)
    except AttributeError as e:
        raise RuntimeError("leasehold: %s is not the Leasehold plug-in (%s)" % (path, e)) from None
    version = lib.leasehold_torch_abi_version
    record_stream = lib.leasehold_torch_record_stream
    empty_cache = lib.leasehold_torch_empty_cache
    if version() != ABI_VERSION:
        raise RuntimeError("leasehold: the plug-in %s has interface version %d, this package %d"
                           % (path, version(), ABI_VERSION))

    allocator = memory.CUDAPluggableAllocator(path, "leasehold_torch_alloc", "leasehold_torch_free")
    native = allocator.allocator()
    for hook in ("set_record_stream_fn", "set_reset_fn"):
        if not hasattr(native, hook):
            raise RuntimeError("leasehold: PyTorch %s's pluggable allocator has no %s"
                               % (torch.__version__, hook))
    # Function addresses as ints, which the hooks cast back to C functions.
    native.set_record_stream_fn(ctypes.cast(record_stream, ctypes.c_void_p).value)
    native.set_reset_fn(ctypes.cast(empty_cache, ctypes.c_void_p).value)
    try:
        memory.change_current_allocator(allocator)
    except RuntimeError as e:
        if "already initialized" in str(e):
            raise AllocatorTooLate(TOO_LATE) from e
        raise
    _keep_cudnn_benchmark_off(torch)
    if not standby:
        _spill_by_default()
    return lib, allocator, "the plug-in %s is PyTorch's CUDA allocator" % path


def _declare(lib):
    """The C signatures of the plug-in's functions (leasehold_torch.h) on
    the loaded library. AttributeError when one is missing."""
    lib.leasehold_torch_abi_version.restype = ctypes.c_int
    lib.leasehold_torch_record_stream.restype = None
    lib.leasehold_torch_empty_cache.restype = None
    lib.leasehold_torch_stats.argtypes = [ctypes.POINTER(_Stats)]
    lib.leasehold_torch_stats.restype = ctypes.c_int
    lib.leasehold_torch_standby_begin.restype = ctypes.c_int
    lib.leasehold_torch_standby_end.restype = ctypes.c_uint64
    lib.leasehold_torch_set_pressure_handler.argtypes = [_PRESSURE_FN, ctypes.c_void_p]
    lib.leasehold_torch_set_pressure_handler.restype = None


CUDNN_BENCHMARK_OFF = (
    "leasehold: torch.backends.cudnn.benchmark stays off: its algorithm search asks PyTorch's own "
    "allocator for its largest free block (cacheInfo), which a pluggable allocator cannot answer "
    "(the convolution would raise); cuDNN's heuristics choose the algorithms instead")


def _keep_cudnn_benchmark_off(torch):
    """Training scripts commonly set torch.backends.cudnn.benchmark = True;
    through a pluggable allocator every convolution of a new shape would then
    raise ("CUDAPluggableAllocator does not yet support cacheInfo"). Keep it
    off, saying so once on stderr, so that such scripts run unmodified.

    Both ways of setting it go through torch._C._set_cudnn_benchmark: the
    property (whose setter the ContextProp holds) and cudnn.flags(), which
    looks the function up at each call."""
    native = getattr(torch, "_C", None)
    original = getattr(native, "_set_cudnn_benchmark", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return
    said = []

    def set_cudnn_benchmark(on):
        if on and not said:
            said.append(True)
            print(CUDNN_BENCHMARK_OFF, file=sys.stderr, flush=True)
        original(False)

    set_cudnn_benchmark.__wrapped__ = original
    native._set_cudnn_benchmark = set_cudnn_benchmark
    cudnn = getattr(getattr(torch, "backends", None), "cudnn", None)
    prop = type(cudnn).__dict__.get("benchmark") if cudnn is not None else None
    if prop is not None and hasattr(prop, "setter"):
        prop.setter = set_cudnn_benchmark
    getter = getattr(native, "_get_cudnn_benchmark", None)
    if getter is not None and getter():
        set_cudnn_benchmark(True)  # set before install: turned off, said once


def standby_begin():
    """Opens the plug-in's standby arena (leasehold_torch.h): until
    standby_end(), allocations are a standby's own warm-up memory, made
    before it has a job. Raises RuntimeError when the plug-in is not
    installed or refuses (a session is open already, or it was opened
    before)."""
    lib = _plugin
    if lib is None:
        raise RuntimeError("leasehold: the plug-in is not installed: no standby arena")
    if lib.leasehold_torch_standby_begin() != 0:
        raise RuntimeError("leasehold: the plug-in refused to open its standby arena (a job's "
                           "session is open, or the arena was opened before)")


def standby_end():
    """Closes the standby arena: the bytes still allocated from it (0: all
    the warm-up's memory is freed)."""
    lib = _plugin
    if lib is None:
        raise RuntimeError("leasehold: the plug-in is not installed: no standby arena")
    return int(lib.leasehold_torch_standby_end())


# ---- spilling saved activations (leasehold/spill.py) ---------------------------------

_spiller = None
# Bytes spilled and restored by spillers replaced since (spilled_bytes_total).
_moved_before = {"spilled_bytes": 0, "restored_bytes": 0}
# The plug-in's pressure handler (leasehold_torch_set_pressure_handler).
_PRESSURE_FN = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)
# Every handler ever given to the plug-in, kept: the plug-in's threads may be
# inside one while another replaces it, and a freed ctypes thunk is a jump
# into freed memory.
_pressure_handlers = []
SPILL_HOST_DEFAULT = 4 << 30  # spill()'s host tier when none is given (bytes)


def _host_available():
    """MemAvailable of /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _spill_by_default():
    """A program job with a budget spills when it nears it, unless
    LEASEHOLD_SPILL=off (the agent's environment). Its host tier is
    LEASEHOLD_SPILL_HOST_BYTES, else four times the budget (a step's
    activations may be several budgets), at most half the host memory
    available now; pinned only at the first spill."""
    import leasehold

    setting = os.environ.get("LEASEHOLD_SPILL", "on")
    if setting not in ("on", "off"):
        raise RuntimeError("leasehold: LEASEHOLD_SPILL=%r is neither on nor off" % setting)
    job = leasehold.job()
    if setting == "off" or job is None or not job.budget_bytes:
        return
    host = leasehold._env_int("LEASEHOLD_SPILL_HOST_BYTES", minimum=1)
    if host is None:
        host = 4 * job.budget_bytes
        available = _host_available()
        if available:
            host = min(host, available // 2)
    spill(True, host_bytes=host)


def spill(enabled=True, host_bytes=None, **options):
    """Spills saved activations to a pinned host tier of `host_bytes` when
    the job nears its budget (leasehold.spill says how), or, with
    enabled=False, stops doing so. Program jobs with a budget start with it
    on. `host_bytes` None keeps the size of the tier in use (the program
    job's default), else SPILL_HOST_DEFAULT. `options`: min_bytes,
    lookahead, high_water (a fraction of the budget), max_in_flight.
    Installs the hooks as the process's default saved-tensor hooks; a
    script's own torch.autograd.graph.saved_tensors_hooks still
    take precedence inside their block. Returns the Spiller (None when
    disabled)."""
    global _spiller
    import torch

    from .spill import Spiller

    with _lock:
        if host_bytes is None:
            host_bytes = _spiller.host_bytes if _spiller is not None else SPILL_HOST_DEFAULT
        if _spiller is not None:
            _set_pressure_handler(None)
            torch._C._autograd._pop_saved_tensors_default_hooks()
            for key in _moved_before:
                _moved_before[key] += _spiller.counts[key]
            _spiller = None
        if not enabled:
            return None
        spiller = Spiller(host_bytes, **options)
        torch._C._autograd._push_saved_tensors_default_hooks(spiller.pack, spiller.unpack)
        _spiller = spiller
        _set_pressure_handler(spiller.relieve)
        return spiller


def _set_pressure_handler(relieve):
    """Makes relieve(bytes) -> bytes spilled the plug-in's pressure
    handler (None: removes it). A failure inside it counts as nothing
    freed: the allocation then fails as it would have."""
    if _plugin is None:
        return
    if relieve is None:
        _plugin.leasehold_torch_set_pressure_handler(_PRESSURE_FN(), None)
        return

    def handler(nbytes, _ctx):
        try:
            return relieve(nbytes)
        except BaseException as e:  # ctypes would return garbage to the plug-in
            log.warning("leasehold: spilling to make room for %d bytes failed: %s", nbytes, e)
            return 0

    _pressure_handlers.append(_PRESSURE_FN(handler))
    _plugin.leasehold_torch_set_pressure_handler(_pressure_handlers[-1], None)


def spilled_bytes_total():
    """Bytes spilled in this process so far, by every spiller it had: what
    the job's progress counts (it never goes down)."""
    return _moved_total("spilled_bytes")


def restored_bytes_total():
    """Bytes brought back to the device in this process so far, by every
    spiller it had (the job's progress counts it too)."""
    return _moved_total("restored_bytes")


def _moved_total(key):
    spiller = _spiller
    return _moved_before[key] + (spiller.counts[key] if spiller is not None else 0)


def spill_stats():
    """What spilling did (tensors saved, spilled and restored, prefetches,
    relief asked by the plug-in, tensors left on the device for want of
    host room), or None when it is off."""
    spiller = _spiller
    return spiller.stats() if spiller is not None else None


def install_status():
    """{"attempted": bool, "installed": bool, "reason": str}: what install()
    did last (for diagnostics and tests)."""
    with _lock:
        return dict(_status)


def stats():
    """The plug-in's statistics as a dict (the fields of struct
    leasehold_torch_stats), or None when it is not installed."""
    lib = _plugin
    if lib is None:
        return None
    s = _Stats()
    if lib.leasehold_torch_stats(ctypes.byref(s)) != 0:
        return None
    return {name: int(getattr(s, name)) for name in _STATS_FIELDS}

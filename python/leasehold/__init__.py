"""Leasehold inside a program job's process.

A program job is an unmodified script the Leasehold agent starts as its
child. The agent tells it who it is through the environment; this package
reads that and talks back:

- ``job()``: the job this process runs for, or None outside a program job.
- ``report(step=..., loss=..., ...)``: progress for the agent (and, when the
  PyTorch plug-in is installed, its memory statistics), one JSON line at a
  time on the pipe the agent passed as LEASEHOLD_REPORT_FD.
- ``region(name, nbytes, fill)``: a shared cache region's bytes as a tensor,
  filled by the first job that asks and attached in place by the next
  (leasehold.regions; ``leasehold.torch.cached_dataset``,
  ``publish_parameters`` and ``init_from`` build on it).
- ``leasehold.torch.install()``: Leasehold's leases as PyTorch's CUDA
  allocator. The agent's sitecustomize (python/leasehold_site) calls it
  right after ``import torch``; scripts need not.

Standard library only. Importing it is cheap and never imports torch.
"""

import atexit
import json
import math
import numbers
import os
import sys
import threading
import time
import warnings

__all__ = ["Job", "job", "region", "report"]

# The pipe's atomic write size (PIPE_BUF on Linux): a line no longer than
# this never interleaves with another writer's.
MAX_LINE_BYTES = 4096
# Memory lines go out at most this often (seconds).
MEMORY_INTERVAL = 1.0

_INT_MAX = 2**63 - 1


class Job:
    """The program job this process runs for (immutable).

    id: the job's id; attempt: which attempt this is; name: the job's name;
    budget_bytes: its memory budget (None: not given); device: "cuda:N" or
    "cpu"; checkpoint_dir: a folder kept across attempts, where the script
    may save checkpoints and find them again when it is restarted (None:
    none given).
    """

    __slots__ = ("id", "attempt", "name", "budget_bytes", "device", "checkpoint_dir")

    def __init__(self, id, attempt, name, budget_bytes, device, checkpoint_dir):
        for key, value in (("id", id), ("attempt", attempt), ("name", name),
                           ("budget_bytes", budget_bytes), ("device", device),
                           ("checkpoint_dir", checkpoint_dir)):
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value):
        raise AttributeError("leasehold.Job is immutable")

    def __delattr__(self, key):
        raise AttributeError("leasehold.Job is immutable")

    def _fields(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __eq__(self, other):
        return isinstance(other, Job) and self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        inner = ", ".join("%s=%r" % (k, getattr(self, k)) for k in self.__slots__)
        return "leasehold.Job(%s)" % inner


def _env_int(name, default=None, minimum=0):
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text, 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError("leasehold: %s=%r is not a number of at least %d" % (name, text, minimum))
    return value


def _env_device():
    text = os.environ.get("LEASEHOLD_DEVICE") or "cpu"
    if text == "cpu":
        return text
    if text == "cuda":
        return "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda:%d" % int(text[5:])
    raise ValueError("leasehold: LEASEHOLD_DEVICE=%r is neither 'cpu' nor 'cuda:N'" % text)


def job():
    """The program job this process runs for, from the environment the agent
    sets (LEASEHOLD_JOB_ID, LEASEHOLD_JOB_ATTEMPT, LEASEHOLD_JOB_NAME,
    LEASEHOLD_BUDGET, LEASEHOLD_DEVICE, LEASEHOLD_CHECKPOINT_DIR); None when
    LEASEHOLD_JOB_ID is not set. Raises ValueError naming the variable when
    one is malformed."""
    job_id = _env_int("LEASEHOLD_JOB_ID", minimum=1)
    if job_id is None:
        return None
    return Job(
        id=job_id,
        attempt=_env_int("LEASEHOLD_JOB_ATTEMPT", default=0),
        name=os.environ.get("LEASEHOLD_JOB_NAME", ""),
        budget_bytes=_env_int("LEASEHOLD_BUDGET"),
        device=_env_device(),
        checkpoint_dir=os.environ.get("LEASEHOLD_CHECKPOINT_DIR") or None,
    )


# ---- report ---------------------------------------------------------------------

_INT_FIELDS = ("step", "epoch", "samples")
_FLOAT_FIELDS = ("loss", "test_accuracy")
_MEMORY_FIELDS = ("leased_bytes", "peak_leased_bytes", "in_use_bytes", "peak_in_use_bytes",
                  "allocations", "cache_hits", "lease_requests", "spilled_bytes",
                  "restored_bytes")

_lock = threading.Lock()
_broken = False          # the pipe failed: nothing more is written
_last_memory = None      # time.monotonic() of the last memory line
_exit_line = False       # _last_memory_line is registered to run at exit
_monotonic = time.monotonic  # tests replace it


def _check_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError("leasehold.report: %s must be an int, not %s" % (name, type(value).__name__))
    value = int(value)
    if not 0 <= value <= _INT_MAX:
        raise ValueError("leasehold.report: %s=%d is out of range (0 to 2**63-1)" % (name, value))
    return value


def _check_float(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = " (a tensor? pass tensor.item())" if hasattr(value, "item") else ""
        raise TypeError("leasehold.report: %s must be a number, not %s%s"
                        % (name, type(value).__name__, hint))
    value = float(value)
    if not math.isfinite(value):
        raise ValueError("leasehold.report: %s=%r is not finite" % (name, value))
    if name == "test_accuracy" and not 0.0 <= value <= 1.0:
        raise ValueError("leasehold.report: test_accuracy=%r is not between 0 and 1" % value)
    return value


def _report_fd():
    text = os.environ.get("LEASEHOLD_REPORT_FD")
    if not text:
        return None
    try:
        fd = int(text, 10)
    except ValueError:
        return None
    return fd if fd >= 0 else None


def _write_line(fd, obj):
    data = (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
    if len(data) > MAX_LINE_BYTES:
        raise ValueError("leasehold.report: a line of %d bytes (at most %d)"
                         % (len(data), MAX_LINE_BYTES))
    written = os.write(fd, data)  # one write: a pipe takes it whole
    while written < len(data):    # only where the fd is not a pipe
        written += os.write(fd, data[written:])


def _memory_stats():
    plugin = sys.modules.get("leasehold.torch")
    if plugin is None:
        return None
    stats = plugin.stats()
    if stats is None:
        return None
    return dict(stats, spilled_bytes=plugin.spilled_bytes_total(),
                restored_bytes=plugin.restored_bytes_total())


def _memory_line(stats):
    line = {"type": "memory"}
    line.update((k, int(stats.get(k, 0))) for k in _MEMORY_FIELDS)
    return line


def _last_memory_line():
    """At the program's exit: the plug-in's figures once more, so that the
    job's progress keeps everything spilled up to the end, not only up to
    the last memory line (at most one a second). Never raises."""
    fd = _report_fd()
    if fd is None or os.environ.get("LEASEHOLD_JOB_ID") is None:
        return
    with _lock:
        if _broken:
            return
        try:
            stats = _memory_stats()
            if stats is not None:
                _write_line(fd, _memory_line(stats))
        except Exception:  # at exit: the pipe or the plug-in may be gone
            pass


def report(step=None, epoch=None, loss=None, samples=None, test_accuracy=None):
    """Reports progress to the agent: one JSON line
    ``{"type": "report", "step": .., "epoch": .., "loss": .., "samples": ..,
    "test_accuracy": ..}`` with the fields given. ``samples`` counts the
    samples processed so far in all (the agent derives samples/s);
    ``test_accuracy`` is a fraction in [0, 1].

    When the PyTorch plug-in is installed, a ``{"type": "memory", ...}`` line
    of its statistics follows, at most once a second, and once more at the
    program's exit.

    Returns True when the line was written; False outside a program job,
    when the agent gave no report pipe, or once the pipe broke (then a
    RuntimeWarning is issued, once: training goes on). Raises TypeError or
    ValueError naming a bad argument (also outside a job). Thread-safe.
    """
    global _broken, _last_memory, _exit_line
    fields = {}
    for name, value in (("step", step), ("epoch", epoch), ("samples", samples)):
        if value is not None:
            fields[name] = _check_int(name, value)
    for name, value in (("loss", loss), ("test_accuracy", test_accuracy)):
        if value is not None:
            fields[name] = _check_float(name, value)
    if not fields:
        raise TypeError("leasehold.report: give at least one of step, epoch, loss, samples, "
                        "test_accuracy")
    if os.environ.get("LEASEHOLD_JOB_ID") is None:
        return False
    fd = _report_fd()
    if fd is None:
        return False
    line = {"type": "report"}
    line.update(fields)
    with _lock:
        if _broken:
            return False
        try:
            _write_line(fd, line)
            stats = _memory_stats()
            now = _monotonic()
            if stats is not None and (_last_memory is None or now - _last_memory >= MEMORY_INTERVAL):
                _write_line(fd, _memory_line(stats))
                _last_memory = now
                if not _exit_line:  # the figures of the last second too
                    atexit.register(_last_memory_line)
                    _exit_line = True
        except OSError as e:
            _broken = True
            message = ("leasehold.report: the agent's report pipe (fd %d) failed (%s); progress "
                       "is no longer reported" % (fd, e))
            try:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            except Exception:  # warnings turned into errors (-W error): still never raise
                sys.stderr.write(message + "\n")
            return False
    return True


def region(name, nbytes=None, fill=None, wait=None):
    """The bytes of the shared cache region `name` as a uint8 tensor on the
    job's device, created and filled by ``fill(tensor)`` when it does not
    exist (leasehold.regions.region says the rest). Imports torch."""
    from . import regions

    return regions.region(name, nbytes=nbytes, fill=fill, wait=wait)


from . import torch  # noqa: E402  (leasehold.torch.install(); imports no torch itself)

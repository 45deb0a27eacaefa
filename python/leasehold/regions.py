"""Shared cache regions from PyTorch (coordinator/regions.md).

A region is named memory of the pool that outlives the jobs using it. The
first job to ask for one fills it; every later job on any agent of the same
device gets the same memory in place, with no copy:

- ``region(name, nbytes, fill)``: a uint8 tensor over the region's bytes
  (the job's device: a CUDA tensor on the cuda backend, a CPU tensor on the
  host backend). ``fill(tensor)`` runs only in the job that creates it.
- ``cached_dataset(name, build)``: tensors decoded once (``build()`` returns
  a dict of name -> tensor, or a tuple or list of tensors) and kept in region
  ``datasets/NAME``; later jobs skip ``build``.
- ``publish_parameters(module, name)`` / ``init_from(module, name)``: a
  module's ``state_dict`` in region ``params/NAME``, the region engine jobs'
  publish_parameters / init_from use, checked name by name for shape and
  dtype on the way in.

Tensors in a region are laid out as engine jobs lay theirs out
(agent/region_tensors.h: a header of names, dtypes and shapes with a CRC-32,
then each tensor 256-byte aligned), with dtype codes past the engine's three
for PyTorch's other types. A job attached to a region holds it until the
process ends (the coordinator never evicts a region while it is attached).

Read-only: once a region is ready, every attacher's mapping of it is
read-only, the filler's too (the isolation of tenants, issue 28). Writing to
a region's tensor faults: on a GPU the job's CUDA context ends with an
illegal-address error, on the host the process gets SIGSEGV. Copy a tensor
(``t.clone()``) to change it.

Inside a program job on a CUDA device the PyTorch plug-in's session is used
(the plug-in must be installed, as the agent does); on the host backend the
lease client (LEASEHOLD_CLIENT_LIB, which the agent sets) opens the job's
session itself.
"""

import ctypes
import hashlib
import os
import struct
import threading
import zlib

__all__ = ["RegionError", "region", "cached_dataset", "publish_parameters", "init_from",
           "digest"]

# lease_client/leasehold.h
LH_OK, LH_ERR_NOT_FOUND = 0, 7
LH_REGION_CREATE, LH_REGION_REPLACE = 1, 2

MAGIC = b"LHREGN1\n"
VERSION = 1
MAX_NAME = 63
MAX_DIMS = 6
ALIGN = 256
_HEAD = struct.Struct("<8sIIQ")                  # magic, version, count, data_bytes
_ENTRY = struct.Struct("<64sBB6x6qQQ")           # name, dtype, ndim, dims, offset, bytes
assert _HEAD.size == 24 and _ENTRY.size == 136

# Dtype codes: the engine's first (agent/engine/dtype.h), then PyTorch's.
_DTYPE_NAMES = ("float32", "float64", "int64", "uint8", "int8", "int16", "int32", "float16",
                "bfloat16", "bool")


class RegionError(RuntimeError):
    """A region cannot be had or is not what was expected (the message says
    which region and why)."""


class _Region:
    """One attachment, kept for the process's life."""

    def __init__(self, handle, data, size, device):
        self.handle, self.data, self.size, self.device = handle, data, size, device


_lock = threading.RLock()
_client = None      # (ctypes library, lh_session*) once known
_attached = {}      # name -> _Region


def _lib_and_session():
    """The lease client (ctypes) and the job's session."""
    global _client
    with _lock:
        if _client is not None:
            return _client
        import leasehold
        import leasehold.torch as plugin

        if leasehold.job() is None:
            raise RegionError("leasehold: regions exist only inside a Leasehold program job "
                              "(LEASEHOLD_JOB_ID is not set)")
        if plugin._plugin is not None:
            lib = plugin._plugin  # its dependency, libleasehold.so, answers lh_* too
            lib.leasehold_torch_session.restype = ctypes.c_void_p
            session = lib.leasehold_torch_session()
            if not session:
                raise RegionError("leasehold: the plug-in cannot open the job's session (its "
                                  "reason is on standard error)")
        else:
            path = os.environ.get("LEASEHOLD_CLIENT_LIB")
            if not path:
                raise RegionError("leasehold: no session for regions: the plug-in is not "
                                  "installed and LEASEHOLD_CLIENT_LIB is not set")
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise RegionError("leasehold: cannot load the lease client %s: %s"
                                  % (path, e)) from None
            session = _open_session(lib)
        _declare(lib)
        _client = (lib, ctypes.c_void_p(session))
        return _client


class _Options(ctypes.Structure):
    # Room for an lh_session_options (far smaller), which only the library's
    # own lh_session_options_init and _from_env fill and read.
    _fields_ = [("_bytes", ctypes.c_byte * 1024)]


def _open_session(lib):
    lib.lh_session_options_init.argtypes = [ctypes.c_void_p]
    lib.lh_session_options_from_env.argtypes = [ctypes.c_void_p]
    lib.lh_session_open.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.lh_last_error.restype = ctypes.c_char_p
    options = _Options()
    lib.lh_session_options_init(ctypes.byref(options))
    status = lib.lh_session_options_from_env(ctypes.byref(options))
    if status != LH_OK:
        raise RegionError("leasehold: the job's session settings: %s" % _error(lib))
    session = ctypes.c_void_p()
    status = lib.lh_session_open(ctypes.byref(options), ctypes.byref(session))
    if status != LH_OK:
        raise RegionError("leasehold: cannot open the job's session: %s" % _error(lib))
    return session.value


def _declare(lib):
    lib.lh_last_error.restype = ctypes.c_char_p
    lib.lh_region_attach.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64,
                                     ctypes.c_int, ctypes.c_int64,
                                     ctypes.POINTER(ctypes.c_void_p)]
    lib.lh_region_attach.restype = ctypes.c_int
    lib.lh_region_data.argtypes = [ctypes.c_void_p]
    lib.lh_region_data.restype = ctypes.c_void_p
    lib.lh_region_size.argtypes = [ctypes.c_void_p]
    lib.lh_region_size.restype = ctypes.c_uint64
    lib.lh_region_must_fill.argtypes = [ctypes.c_void_p]
    lib.lh_region_must_fill.restype = ctypes.c_int
    lib.lh_region_mark_ready.argtypes = [ctypes.c_void_p]
    lib.lh_region_mark_ready.restype = ctypes.c_int
    lib.lh_region_detach.argtypes = [ctypes.c_void_p]
    lib.lh_region_detach.restype = ctypes.c_int
    lib.lh_session_pool.argtypes = [ctypes.c_void_p, ctypes.c_void_p]


def _error(lib):
    message = lib.lh_last_error()
    return message.decode("utf-8", "replace") if message else "no details"


def _device():
    import leasehold

    return leasehold.job().device


def _as_tensor(ptr, nbytes, device):
    """A uint8 tensor over [ptr, ptr + nbytes) of the job's device, no copy."""
    import torch

    if device.startswith("cuda"):
        class _Memory:  # the CUDA array interface (version 2: no stream to order with)
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                        "data": (ptr, False), "version": 2}
        return torch.as_tensor(_Memory(), device=device)
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=torch.uint8)


def _synchronize(device):
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _attach(name, nbytes, flags, wait):
    lib, session = _lib_and_session()
    handle = ctypes.c_void_p()
    wait_ms = -1 if wait is None else int(wait * 1000)
    status = lib.lh_region_attach(session, name.encode(), nbytes, flags, wait_ms,
                                  ctypes.byref(handle))
    if status == LH_ERR_NOT_FOUND:
        return None
    if status != LH_OK:
        raise RegionError("leasehold: region '%s': %s" % (name, _error(lib)))
    return lib, handle


def region(name, nbytes=None, fill=None, wait=None):
    """The bytes of region `name` as a uint8 tensor on the job's device.

    When the region does not exist and `fill` is given, it is created with
    `nbytes` bytes and ``fill(tensor)`` writes it (then the device is
    synchronized and the region marked ready, read-only from then on);
    when another job is filling it, this waits until it is ready (`wait`
    seconds at most; None: the coordinator's default). Raises RegionError
    when it does not exist and no `fill` is given, when `nbytes` differs
    from its size, or when `fill` raises (the unfilled region is discarded).
    """
    if fill is not None and (nbytes is None or nbytes <= 0):
        raise ValueError("leasehold.region: creating '%s' needs nbytes > 0" % name)
    with _lock:
        known = _attached.get(name)
        if known is not None:
            if nbytes is not None and nbytes != known.size:
                raise RegionError("leasehold: region '%s' holds %d bytes, not %d"
                                  % (name, known.size, nbytes))
            return _as_tensor(known.data, known.size, known.device)
        got = _attach(name, nbytes or 0, LH_REGION_CREATE if fill is not None else 0, wait)
        if got is None:
            raise RegionError("leasehold: region '%s' does not exist (evicted, or never "
                              "filled) and no fill was given" % name)
        return _take(name, got, fill)


def _take(name, got, fill, replace=False):
    lib, handle = got
    data, size = lib.lh_region_data(handle), lib.lh_region_size(handle)
    device = _device()
    if not data:
        lib.lh_region_detach(handle)
        raise RegionError("leasehold: region '%s' is not mapped: %s" % (name, _error(lib)))
    try:
        tensor = _as_tensor(data, size, device)
    except BaseException:
        lib.lh_region_detach(handle)
        raise
    if lib.lh_region_must_fill(handle):
        try:
            fill(tensor)
            _synchronize(device)
        except BaseException:
            del tensor  # views of memory about to be detached
            lib.lh_region_detach(handle)  # left unfilled: discarded
            raise
        if lib.lh_region_mark_ready(handle) != LH_OK:
            message = _error(lib)
            lib.lh_region_detach(handle)
            raise RegionError("leasehold: region '%s' cannot be marked ready: %s"
                              % (name, message))
    _attached[name] = _Region(handle, data, size, device)
    return tensor


# ---- tensors laid out in a region -------------------------------------------------


def _dtype_code(dtype):
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_NAMES:
        raise TypeError("leasehold: tensors of %s cannot be kept in a region (%s)"
                        % (name, ", ".join(_DTYPE_NAMES)))
    return _DTYPE_NAMES.index(name)


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(specs):
    """(offsets, total bytes) of tensors (name, dtype, shape, nbytes) after
    the header."""
    at = _align(_HEAD.size + len(specs) * _ENTRY.size + 4)
    offsets = []
    for name, _, shape, nbytes in specs:
        if len(name.encode()) > MAX_NAME:
            raise ValueError("leasehold: tensor name '%s' is longer than %d bytes"
                             % (name, MAX_NAME))
        if len(shape) > MAX_DIMS:
            raise ValueError("leasehold: tensor '%s' has more than %d dimensions"
                             % (name, MAX_DIMS))
        offsets.append(at)
        at = _align(at + nbytes)
    return offsets, at


def _header(specs, offsets, total):
    out = bytearray(_HEAD.pack(MAGIC, VERSION, len(specs), total))
    for (name, dtype, shape, nbytes), offset in zip(specs, offsets):
        dims = list(shape) + [0] * (MAX_DIMS - len(shape))
        out += _ENTRY.pack(name.encode(), _dtype_code(dtype), len(shape), *dims, offset, nbytes)
    out += struct.pack("<I", zlib.crc32(bytes(out)) & 0xFFFFFFFF)
    return bytes(out)


def _named(tensors, what):
    """(names, tensors, kind) of what build() or a state_dict gave."""
    import torch

    if isinstance(tensors, dict):
        items, kind = list(tensors.items()), "dict"
    elif isinstance(tensors, (tuple, list)):
        items, kind = [(str(i), t) for i, t in enumerate(tensors)], type(tensors).__name__
    else:
        raise TypeError("leasehold: %s must be a dict of tensors or a tuple or list of them, "
                        "not %s" % (what, type(tensors).__name__))
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError("leasehold: %s: entry %r is not a tensor named by a string"
                            % (what, name))
    return items, kind


def _write(region_bytes, items):
    import torch

    specs = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in items]
    offsets, total = _layout(specs)
    header = _header(specs, offsets, total)
    region_bytes[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for (name, t), offset, (_, dtype, shape, nbytes) in zip(items, offsets, specs):
        view = region_bytes[offset:offset + nbytes].view(dtype).view(shape)
        view.copy_(t.detach())


def _read(name, region_bytes):
    """[(tensor name, view)] of a region's tensors, checked."""
    import torch

    size = region_bytes.numel()
    if size < _HEAD.size + 4:
        raise RegionError("leasehold: region '%s' is too small for a header" % name)
    head = bytes(region_bytes[:_HEAD.size].cpu().numpy().tobytes())
    magic, version, count, data_bytes = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise RegionError("leasehold: region '%s' does not hold tensors (magic %r, version %d)"
                          % (name, magic, version))
    crc_at = _HEAD.size + count * _ENTRY.size
    if crc_at + 4 > size or data_bytes > size:
        raise RegionError("leasehold: region '%s': a header of %d entries and %d bytes does not "
                          "fit its %d bytes" % (name, count, data_bytes, size))
    raw = bytes(region_bytes[:crc_at + 4].cpu().numpy().tobytes())
    (stored,) = struct.unpack("<I", raw[crc_at:])
    if zlib.crc32(raw[:crc_at]) & 0xFFFFFFFF != stored:
        raise RegionError("leasehold: region '%s': its header's checksum does not match" % name)
    out, seen = [], set()
    for i in range(count):
        fields = _ENTRY.unpack_from(raw, _HEAD.size + i * _ENTRY.size)
        tname = fields[0].rstrip(b"\0").decode("utf-8", "replace")
        code, ndim, dims, offset, nbytes = fields[1], fields[2], fields[3:9], fields[9], fields[10]
        why = None
        if code >= len(_DTYPE_NAMES):
            why = "dtype code %d" % code
        elif ndim > MAX_DIMS or any(d < 0 for d in dims[:ndim]):
            why = "%d dimensions %s" % (ndim, dims[:ndim])
        elif offset % ALIGN or offset < _HEAD.size or offset + nbytes > size:
            why = "bytes %d+%d outside the region's %d or unaligned" % (offset, nbytes, size)
        elif tname in seen:
            why = "a second entry of that name"
        if why is None:
            dtype = getattr(torch, _DTYPE_NAMES[code])
            numel = 1
            for d in dims[:ndim]:
                numel *= d
            if numel * torch.empty((), dtype=dtype).element_size() != nbytes:
                why = "%d bytes for shape %s of %s" % (nbytes, dims[:ndim], _DTYPE_NAMES[code])
        if why is not None:
            raise RegionError("leasehold: region '%s': entry '%s' is not valid (%s)"
                              % (name, tname, why))
        seen.add(tname)
        shape = tuple(dims[:ndim])
        view = region_bytes[offset:offset + nbytes].view(dtype).view(shape)
        out.append((tname, view))
    return out


def _tensors_region(region_name, items, replace, wait):
    """Attaches (creating and filling when absent) the region holding
    `items`; [(name, view)]."""
    specs = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in items]
    _, total = _layout(specs)
    with _lock:
        if replace and region_name in _attached:
            raise RegionError("leasehold: region '%s' is attached by this job; it cannot "
                              "publish new contents under it" % region_name)
        flags = LH_REGION_CREATE | (LH_REGION_REPLACE if replace else 0)
        got = _attach(region_name, total, flags, wait)
        if got is None:
            raise RegionError("leasehold: region '%s' cannot be created" % region_name)
        tensor = _take(region_name, got, lambda t: _write(t, items))
    return _read(region_name, tensor)


def cached_dataset(name, build, wait=None):
    """Tensors kept in region ``datasets/NAME``: the first job calls build()
    (a dict of name -> tensor, or a tuple or list of tensors) and fills the
    region with them; later jobs get the region's tensors without calling
    it. Returns a dict when build() gave one, else a tuple; its tensors are
    on the job's device, read-only (see the module's notes)."""
    region_name = "datasets/" + name
    with _lock:
        try:
            existing = region(region_name, wait=wait)
        except RegionError as e:
            if "does not exist" not in str(e):
                raise
            existing = None
    if existing is not None:
        items = _read(region_name, existing)
    else:
        items, _ = _named(build(), "cached_dataset's build()")
        items = _tensors_region(region_name, items, replace=False, wait=wait)
    if items and all(n == str(i) for i, (n, _) in enumerate(items)):
        return tuple(t for _, t in items)  # build() gave a tuple or list
    return dict(items)


def digest(tensors):
    """BLAKE2b-64 of the tensors' bytes in order (hex), for logs: two sets of
    weights with the same digest are the same weights."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    for _, t in tensors:
        flat = t.detach().contiguous().reshape(-1).cpu()
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def publish_parameters(module, name, wait=None):
    """Puts `module`'s state_dict (parameters and buffers) in region
    ``params/NAME``, replacing what an earlier job published there (while
    another job is attached to it, RegionError). Returns its digest."""
    items, _ = _named(module.state_dict(), "the state_dict")
    views = _tensors_region("params/" + name, items, replace=True, wait=wait)
    return digest(views)


def init_from(module, name, wait=None):
    """Loads `module`'s state_dict from region ``params/NAME``: every name of
    the module's state_dict must be there with its shape and dtype
    (RegionError lists what differs). The values are copied; the region is
    not written. Returns their digest."""
    region_name = "params/" + name
    items = _read(region_name, region(region_name, wait=wait))
    found = dict(items)
    wanted = module.state_dict()
    problems = []
    for key, t in wanted.items():
        got = found.get(key)
        if got is None:
            problems.append("%s: missing" % key)
        elif tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
            problems.append("%s: %s %s in the region, %s %s in the module"
                            % (key, tuple(got.shape), str(got.dtype).replace("torch.", ""),
                               tuple(t.shape), str(t.dtype).replace("torch.", "")))
    for key in found:
        if key not in wanted:
            problems.append("%s: in the region, not in the module" % key)
    if problems:
        raise RegionError("leasehold: region '%s' does not fit the module: %s"
                          % (region_name, "; ".join(problems)))
    module.load_state_dict(found, strict=True)
    return digest(items)

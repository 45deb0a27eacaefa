"""Spilling a PyTorch job's saved activations to host memory when its budget
is short (``leasehold.torch.spill``).

Autograd keeps the tensors a backward pass needs ("saved tensors") from the
forward pass until the backward pass uses them; they are most of a training
step's peak. Through ``torch.autograd.graph`` saved-tensor hooks installed
as the process's defaults, every saved tensor passes through ``pack`` when
it is saved and ``unpack`` when backward needs it. A saved CUDA tensor of at
least ``min_bytes`` that is not a parameter, a view of one, or anything else
that requires grad as a leaf (parameters and optimiser state stay resident)
is held by a record of its root (a view's base, whose memory it is), on the
device at first. Views of one root share its record, and a root is copied
as its bytes lie in memory, so everything comes back with the strides it
had (kernels given another layout may round differently):

- Coldest first. The record saved first is needed last in backward. When
  the plug-in's bytes in use pass ``high_water`` of the job's budget at a
  save, the oldest records still on the device are spilled until they are
  back under it: each is copied to the host tier on a copy stream after
  the work that produced it, and its device memory is handed back to the
  allocator at once, reused only after the copy (record_stream).
- Pressure. The plug-in calls ``relieve(bytes)`` (its pressure handler)
  when an allocation finds no room within the budget, a peak of the
  backward pass for example, and when the coordinator's Shrink asks for
  more than its cache holds free; the oldest records on the device are
  spilled then too, and the allocation is retried.
- unpack: a spilled tensor comes back on the copy stream into new device
  memory, and the next ``lookahead`` spilled tensors in backward order are
  brought back behind it while the budget has room for them, so copies
  overlap the backward's kernels; the compute stream waits only for the
  one it needs.
- Copy order. Copies overlap the compute on a copy stream only while the
  budget has room for them in flight (``max_in_flight``). Once a forward
  pass has had to wait for its copies to free memory, they go in the
  compute stream's own order, as ``save_on_cpu`` does: a spilled tensor's
  memory is free in that order at once, and a restore comes when its use
  does, with nothing brought back ahead. With a budget of little more than
  the parameters and optimiser state that is the faster way: on an H200
  with the GPT-2 shape at ``save_on_cpu``'s peak, 2.04 steps/s against
  1.82 overlapping; at half the peak, overlapping is 5% faster
  (``overlap=True``/``False`` fixes the choice).

The host tier holds up to ``host_bytes`` in pinned slabs of ``slab_bytes``,
allocated as spills first need them and then kept, carved into 256-byte
aligned ranges. When it is full a tensor stays on the device (counted in
``stats()["host_full"]``). Copies are exact: gradients are bit-identical
with and without spilling.

Saved tensors only: a script that keeps activations alive itself, or whose
parameters and optimiser state alone pass the budget, still runs out of
memory, with the plug-in's message naming the numbers.
"""

import bisect
import collections
import threading
import weakref

__all__ = ["Spiller"]

ALIGN = 256


class _HostRanges:
    """First-fit ranges of the host tier, merged again when freed."""

    def __init__(self, size):
        self.size = size
        self.free = [(0, size)]  # sorted (offset, bytes)

    def take(self, nbytes):
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        for i, (offset, size) in enumerate(self.free):
            if size >= need:
                if size == need:
                    del self.free[i]
                else:
                    self.free[i] = (offset + need, size - need)
                return offset, need
        return None

    def give(self, offset, size):
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (offset, size))
        # Merge with the neighbours.
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo] = (free[lo][0], free[lo][1] + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    def free_bytes(self):
        return sum(size for _, size in self.free)


class _HostTier:
    """The host tier: pinned slabs of `slab_bytes` (a tensor larger than
    that gets a slab of its own size), allocated as spills need them up to
    `capacity` and then kept. Pinning is done slab by slab: pinning many
    GiB at once holds the process's memory-map lock for seconds, and every
    other thread that faults a page waits (the session's heartbeats too)."""

    def __init__(self, torch, capacity, slab_bytes, pinned):
        self.torch, self.capacity, self.slab_bytes, self.pinned = torch, capacity, slab_bytes, \
            pinned
        self.slabs = []  # (tensor, _HostRanges)
        self.allocated = 0

    def take(self, nbytes):
        """(slab, offset, span) of a range for nbytes, or None."""
        for i, (_, ranges) in enumerate(self.slabs):
            got = ranges.take(nbytes)
            if got is not None:
                return (i,) + got
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        size = max(self.slab_bytes, need)
        if self.allocated + size > self.capacity:
            size = (self.capacity - self.allocated) // ALIGN * ALIGN
            if size < need:
                return None
        try:
            slab = self.torch.empty(size, dtype=self.torch.uint8, pin_memory=self.pinned)
        except RuntimeError:  # no more pinned memory: the tier is as large as it gets
            self.capacity = self.allocated
            return None
        self.slabs.append((slab, _HostRanges(size)))
        self.allocated += size
        return (len(self.slabs) - 1,) + self.slabs[-1][1].take(nbytes)

    def give(self, slab, offset, span):
        self.slabs[slab][1].give(offset, span)

    def view(self, slab, offset, nbytes):
        return self.slabs[slab][0][offset:offset + nbytes]

    def free_bytes(self):
        return self.capacity - self.allocated + sum(r.free_bytes() for _, r in self.slabs)


class _Saved:
    """A saved tensor's memory under the Spiller: the root tensor that owns
    it (a view's base; the tensor itself otherwise), on the device (`dev`),
    in the host tier (`offset` set), or back on the device (`back`). Its
    bytes are copied as they lie in memory, and it comes back with the same
    strides: kernels given another layout may round differently."""

    __slots__ = ("owner", "shape", "stride", "dtype", "device", "nbytes", "dev", "stream",
                 "slab", "offset", "span", "back", "ready", "ready_on", "seq", "key",
                 "__weakref__")

    def __init__(self, owner, root, nbytes, seq, key, stream):
        # Every saved activation passes here, most never spilled: the
        # least work (its geometry is taken when it is spilled).
        self.owner, self.nbytes, self.seq, self.key = owner, nbytes, seq, key
        # Detached: the saved output of an op holding its own grad_fn would
        # be a reference cycle through C++ that no collector sees.
        self.dev = root.detach()
        # The stream that produced it (a raw cudaStream_t: cheaper than a
        # torch.cuda.Stream): its copy out waits for that stream, whichever
        # thread or stream spills it (a Shrink's thread, an allocation
        # on the copy stream).
        self.stream = stream
        self.shape = self.stride = self.dtype = self.device = None
        self.slab = self.offset = self.span = None
        self.back = None   # the root once brought back
        self.ready = None  # its copy's event
        self.ready_on = None  # the raw stream of that copy

    def __del__(self):
        # Garbage collection may run this on a thread that is inside the
        # Spiller's own bookkeeping: only queue what to forget; the next
        # hook call does.
        owner = self.owner
        if owner is not None:
            owner.dead.append((self.slab, self.offset, self.span, self.seq, self.key))
            self.offset = None


class _View:
    """A saved view of a record's root: its geometry, relative to the
    root's first element. Views of one root (attention's q, k and v of
    one projection) share the record: copied once, brought back once."""

    __slots__ = ("rec", "size", "stride", "offset")

    def __init__(self, rec, t, root):
        self.rec, self.size, self.stride = rec, t.size(), t.stride()
        self.offset = t.storage_offset() - root.storage_offset()


class Spiller:
    """Saved-tensor hooks that spill to a pinned host tier (module notes).

    `pressure(nbytes)` says whether the device holds `nbytes` more than
    it should: None, the plug-in's statistics against `high_water` of
    the job's budget. `in_use()`: the bytes the allocator has handed out
    (None: the plug-in's; returning None, unknown). `device_types` are the
    tensors' device types considered ("cuda"; tests add "cpu")."""

    def __init__(self, host_bytes, min_bytes=1 << 20, lookahead=2, high_water=0.8,
                 pressure=None, in_use=None, device_types=("cuda",), max_in_flight=None,
                 slab_bytes=256 << 20, overlap=None):
        import torch

        if host_bytes <= 0:
            raise ValueError("leasehold.torch.spill: host_bytes must be > 0")
        self.torch = torch
        self._parameter, self._tensor = torch.nn.Parameter, torch.Tensor
        self.host_bytes, self.min_bytes, self.lookahead = int(host_bytes), min_bytes, lookahead
        self.high_water, self.device_types = high_water, tuple(device_types)
        self.pressure = pressure or self._budget_pressure
        self.in_use = in_use or self._plugin_in_use
        self._stats = None  # (leasehold_torch_stats, its argument, the struct) once known
        self.slab_bytes = slab_bytes
        # Copies on a copy stream beside the compute (overlap), or in the
        # compute streams' own order, as save_on_cpu does: device memory
        # then goes back to the allocator in stream order at once, which a
        # budget with little room past the parameters needs more than the
        # overlap. None: overlapping until the forward first waits for its
        # copies (_throttle), in order from then on.
        self.overlap = True if overlap is None else bool(overlap)
        self._overlap_chosen = overlap is not None
        self._externals = {}  # (raw stream, device index) -> torch.cuda.ExternalStream
        # The stream of the last copy to or from the host tier, one for all
        # streams and devices, since they share the tier (_after_last_copy).
        self._last_copy = None
        self._saving = False  # inside pack's spilling (a forward pass)
        self.host = None  # the _HostTier, at the first spill
        self.streams = {}
        self._current_raw = None  # torch._C._cuda_getCurrentRawStream, once needed
        # Records on the device, oldest (coldest) first, and records in the
        # host tier by number (sorted): weak references, a record dies with
        # the graph that saved it.
        self.resident = collections.OrderedDict()
        self.pending = []
        self.records = {}
        # The same tensor saved again (a layer's input saved by two ops) is
        # the same record: copied once, brought back once.
        self.by_tensor = {}
        # Re-entrant: the plug-in's pressure handler runs on whichever
        # thread allocates, this one's copies included.
        self.lock = threading.RLock()
        self.dead = collections.deque()  # records that died (see _Saved.__del__)
        self.seq = 0
        # Copies to the host not known to be done: (event, bytes). A forward
        # pass makes activations faster than a host link takes them; past
        # max_in_flight (None: a quarter of the budget, 256 MiB when none is
        # known) it waits for the oldest, so the memory of spilled tensors
        # comes back before more is asked for. Waiting earlier only stalls
        # the forward: the allocator itself waits for the copies that hold
        # the blocks it needs.
        self.max_in_flight = max_in_flight
        self.in_flight = []
        self.in_flight_bytes = 0
        self.counts = {"saved_tensors": 0, "spilled_tensors": 0, "spilled_bytes": 0,
                       "restored_bytes": 0, "prefetched": 0, "host_full": 0, "waits": 0,
                       "deduplicated": 0, "relieved": 0, "relieved_bytes": 0}

    # ---- policy -----------------------------------------------------------------

    def _plugin_stats(self):
        # Called for every saved tensor: the plug-in's statistics straight
        # into one reused struct (a microsecond), not through stats()'s dict.
        if self._stats is None:
            import ctypes

            from . import torch as plugin

            if plugin._plugin is None:
                return None
            struct = plugin._Stats()
            self._stats = (plugin._plugin.leasehold_torch_stats, ctypes.byref(struct), struct)
        fill, ref, s = self._stats
        return s if fill(ref) == 0 else None

    def _budget_pressure(self, nbytes):
        s = self._plugin_stats()
        if s is None or not s.budget_bytes:
            return False
        return s.in_use_bytes + nbytes > self.high_water * s.budget_bytes

    def _plugin_in_use(self):
        s = self._plugin_stats()
        return s.in_use_bytes if s is not None else None

    def _eligible(self, t, nbytes):
        if nbytes < self.min_bytes:
            return False  # first: most saved tensors are small
        torch = self.torch
        if t.device.type not in self.device_types or t.layout != torch.strided:
            return False
        # Parameters (and views of them, such as a weight's transpose that a
        # matmul saves) stay resident: spilling them would free nothing.
        # A plain tensor's type first: Parameter's metaclass makes
        # isinstance cost more than the rest of a save together. Its
        # subclasses (frozen quantized weights) stay resident too.
        base = t._base
        if base is None:
            base = t
        if not base.is_leaf:
            return True
        kind = type(base)
        return not (base.requires_grad or kind is self._parameter or
                    (kind is not self._tensor and isinstance(base, self._parameter)))

    # ---- hooks ------------------------------------------------------------------

    def pack(self, t):
        if self.dead:
            self._reap()
        nbytes = t.numel() * t.element_size()
        if not self._eligible(t, nbytes):
            return t
        root = t._base
        if root is None:
            root = t
        # A root whose elements fill one range of memory (any dense layout:
        # contiguous, channels-last, ...): that range is what is copied. A
        # view that reads it as another type (view(dtype), view_as_real, a
        # conjugate) or reaches outside it stays as it is.
        if not self._dense(root):
            return t
        if root is not t and not self._plain_view(t, root):
            return t
        # The same root object, unchanged since (its memory may be reused by
        # a new tensor once it is gone: addresses are no identity).
        key = id(root)
        with self.lock:
            known = self.by_tensor.get(key)
            rec = None
            if known is not None:
                tensor_ref, rec_ref, version = known
                rec = rec_ref()
                if tensor_ref() is root and root._version == version and rec is not None \
                        and rec.back is None:
                    self.counts["deduplicated"] += 1
                else:
                    rec = None
            if rec is None:
                self.seq += 1
                stream = self._raw_stream(root.device.index) if root.is_cuda else None
                rec = _Saved(self, root, root.numel() * root.element_size(), self.seq, key,
                             stream)
                ref = weakref.ref(rec)
                self.records[rec.seq] = ref
                self.resident[rec.seq] = ref
                self.by_tensor[key] = (weakref.ref(root), ref, root._version)
                self.counts["saved_tensors"] += 1
                if self.pressure(0) and not self._capturing():
                    # Back under the high-water mark, oldest first; the
                    # tensor just saved is needed first in backward and
                    # goes last.
                    self._saving = True
                    try:
                        self._evict(lambda freed: not self.pressure(0))
                    finally:
                        self._saving = False
        return rec if root is t else _View(rec, t, root)

    def unpack(self, packed):
        if isinstance(packed, _View):
            rec = packed.rec
        elif isinstance(packed, _Saved):
            rec = packed
        else:
            return packed
        if self.dead:
            self._reap()
        with self.lock:
            if rec.dev is not None:
                # Needed now: no longer a candidate to spill.
                self.resident.pop(rec.seq, None)
                root = rec.dev
            else:
                root = self._restored(rec)
        if packed is rec:
            return root
        return root.as_strided(packed.size, packed.stride,
                               root.storage_offset() + packed.offset)

    def _restored(self, rec):
        """The root of a spilled record on the device again, with the next
        spilled ones in backward order on their way. Under self.lock."""
        if rec.back is None:
            at = bisect.bisect_left(self.pending, rec.seq)
            ahead = [self.records.get(seq) for seq in
                     self.pending[max(0, at - self.lookahead):at]]
            ahead = [ref() for ref in ahead if ref is not None]
            self._bring_back(rec)
            if not self.overlap:
                ahead = ()  # in order, a copy ahead only holds memory sooner
            for other in reversed(ahead):
                if other is not None and other.back is None and other.offset is not None \
                        and not self.pressure(other.nbytes):
                    self._bring_back(other)
                    self.counts["prefetched"] += 1
        t = rec.back
        if rec.ready is not None:
            # Used on another stream than its copy's (the copy stream, or a
            # root brought back in order for a use on another stream).
            current = self.torch.cuda.current_stream(rec.device)
            if current.cuda_stream != rec.ready_on:
                current.wait_event(rec.ready)
                t.record_stream(current)
        return t.view(rec.dtype).as_strided(rec.shape, rec.stride, 0)

    def _plain_view(self, t, root):
        if t.dtype != root.dtype or t.is_conj() != root.is_conj() or \
                t.is_neg() != root.is_neg():
            return False
        offset = t.storage_offset() - root.storage_offset()
        if offset < 0 or any(st < 0 for st in t.stride()):
            return False
        last = offset + sum((n - 1) * st for n, st in zip(t.size(), t.stride()) if n > 0)
        return t.numel() == 0 or last < root.numel()

    def _dense(self, t):
        torch = self.torch
        if t.is_contiguous():
            return True
        if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
            return True
        if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
            return True
        return False

    def relieve(self, nbytes):
        """The plug-in's pressure handler: spills records on the device,
        oldest first, until the allocator has about `nbytes` more free (or
        none is left). Returns the bytes spilled (0: nothing could be, or
        a CUDA graph is being captured: copies would join it)."""
        self._reap()
        if self._capturing():
            return 0
        with self.lock:
            before = self.in_use()
            if before is None:
                spilled = self._evict(lambda freed: freed >= nbytes)
            else:
                # Freed, by the allocator's count; or twice the bytes asked
                # spilled (other threads allocate meanwhile, and a record
                # whose tensor is held elsewhere frees nothing yet).
                spilled = self._evict(lambda freed: freed >= 2 * nbytes or
                                      before - (self.in_use() or before) >= nbytes)
            self.counts["relieved"] += 1
            self.counts["relieved_bytes"] += spilled
            return spilled

    # ---- internals --------------------------------------------------------------

    def _evict(self, enough):
        """Spills records on the device, oldest first, until enough(bytes
        spilled so far). Under self.lock. Returns the bytes spilled."""
        spilled = 0
        while self.resident and not enough(spilled):
            seq, ref = self.resident.popitem(last=False)
            rec = ref()
            if rec is None or rec.dev is None:
                continue
            if not self._spill(rec):
                # No host room, or its stream is capturing a CUDA graph: it
                # stays, and so do the rest.
                self.resident[seq] = ref
                self.resident.move_to_end(seq, last=False)
                break
            spilled += rec.nbytes
        return spilled

    def _spill(self, rec):
        """Copies a record's tensor to the host tier and lets go of its
        device memory. False when the host tier has no room for it, or
        the stream that made it captures a CUDA graph."""
        t = rec.dev
        producer = None
        if t.is_cuda:
            producer = self._external(rec.stream, t.device)
            # Spilled from another stream (a Shrink's thread, an allocation
            # on the copy stream): the caller's capture check did not see
            # the producer's, and a copy after it would join the graph.
            if rec.stream != self._raw_stream(t.device.index) and self._captures(producer):
                return False
        rec.shape, rec.stride, rec.dtype, rec.device = t.shape, t.stride(), t.dtype, t.device
        if self.host is None:
            self.host = _HostTier(self.torch, self.host_bytes, self.slab_bytes, t.is_cuda)
        got = self.host.take(rec.nbytes)
        if got is None:
            self.counts["host_full"] += 1
            return False
        rec.slab, rec.offset, rec.span = got
        # Its elements as they lie in memory (a dense root: one range).
        dst = self.host.view(rec.slab, rec.offset, rec.nbytes).view(t.dtype)
        t = t.as_strided((t.numel(),), (1,), t.storage_offset())
        if t.is_cuda and not self.overlap:
            # After the work that made it, on its stream: its block is free
            # in that stream's order once the copy is queued.
            stream = self._after_last_copy(producer)
            with self.torch.cuda.stream(stream):
                dst.copy_(t, non_blocking=True)
            t.record_stream(stream)  # nothing, unless it was allocated on another
            done = None
        elif t.is_cuda:
            stream = self._after_last_copy(self._stream(t.device))  # one device: no wait
            stream.wait_stream(producer)
            with self.torch.cuda.stream(stream):
                dst.copy_(t, non_blocking=True)
                done = self.torch.cuda.Event()
                done.record(stream)
            t.record_stream(stream)  # its block waits for the copy before reuse
        else:
            dst.copy_(t)
            done = None
        rec.dev = None
        del t
        bisect.insort(self.pending, rec.seq)
        self.counts["spilled_tensors"] += 1
        self.counts["spilled_bytes"] += rec.nbytes
        if done is not None:
            self._throttle(done, rec.nbytes)
        return True

    def _throttle(self, done, nbytes):
        if self.max_in_flight is None:
            s = self._plugin_stats()
            self.max_in_flight = s.budget_bytes // 4 if s is not None and s.budget_bytes \
                else 256 << 20
        self.in_flight.append((done, nbytes))
        self.in_flight_bytes += nbytes
        while self.in_flight and (self.in_flight_bytes > self.max_in_flight
                                  or self.in_flight[0][0].query()):
            event, size = self.in_flight.pop(0)
            if self.in_flight_bytes > self.max_in_flight:
                event.synchronize()
                self.counts["waits"] += 1
                if self._saving and self.overlap and not self._overlap_chosen:
                    self._stop_overlapping()
            self.in_flight_bytes -= size

    def _stop_overlapping(self):
        """The budget has no room for copies in flight beside the compute:
        from now on they go in the compute's order (module notes). Under
        self.lock. Every copy queued on a copy stream comes before the
        first in-order one (_after_last_copy: the last copy's stream was one)."""
        self.overlap = False

    def _capturing(self):
        """Whether this thread's stream is being captured into a CUDA graph
        (nothing may be copied, waited for or pinned then)."""
        torch = self.torch
        return "cuda" in self.device_types and torch.cuda.is_available() and \
            torch.cuda.is_current_stream_capturing()

    def _captures(self, stream):
        with self.torch.cuda.stream(stream):
            return self.torch.cuda.is_current_stream_capturing()

    def _raw_stream(self, index):
        if self._current_raw is None:
            self._current_raw = self.torch._C._cuda_getCurrentRawStream
        return self._current_raw(index)

    def _stream(self, device):
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = self.torch.cuda.Stream(device)
        return stream

    def _external(self, raw, device):
        key = (raw, device.index)
        stream = self._externals.get(key)
        if stream is None:
            stream = self._externals[key] = self.torch.cuda.ExternalStream(raw, device=device)
        return stream

    def _after_last_copy(self, stream):
        """`stream`, for the next copy to or from the host tier. Host ranges
        are reused in the order copies are queued, so a copy on another
        stream than the last one waits for that one's work first (in order
        with several streams, or copy streams of several devices; one
        stream never waits). Call it after any allocation for the copy: an
        allocation may spill (the pressure handler), and those copies come
        first."""
        last = self._last_copy
        if last is not None and last.cuda_stream != stream.cuda_stream:
            stream.wait_stream(last)
        self._last_copy = stream
        return stream

    def _bring_back(self, rec):
        # Under self.lock.
        if rec.back is not None:
            return
        torch = self.torch
        src = self.host.view(rec.slab, rec.offset, rec.nbytes)
        if rec.device.type == "cuda":
            # On the copy stream, or in order on the stream that needs it.
            stream = self._stream(rec.device) if self.overlap else \
                torch.cuda.current_stream(rec.device)
            with torch.cuda.stream(stream):
                back = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)
                self._after_last_copy(stream)
                back.copy_(src, non_blocking=True)
                rec.ready = torch.cuda.Event()
                rec.ready.record(stream)
            rec.ready_on = stream.cuda_stream
        else:
            back = src.clone()
        rec.back = back
        self.counts["restored_bytes"] += rec.nbytes
        # Its host range is free again: a later copy into it is ordered
        # after this one's on the copy stream.
        self._forget(rec.slab, rec.offset, rec.span, rec.seq, None)
        rec.offset = None

    def _reap(self):
        """Forgets the records that died, giving their host ranges back."""
        if not self.dead:
            return
        with self.lock:
            while self.dead:
                self._forget(*self.dead.popleft())

    def _forget(self, slab, offset, span, seq, key):
        # Under self.lock. `offset` None: the record had no host range.
        if offset is not None:
            self.host.give(slab, offset, span)
            at = bisect.bisect_left(self.pending, seq)
            if at < len(self.pending) and self.pending[at] == seq:
                del self.pending[at]
        if key is None:
            return  # brought back: the record lives on
        self.records.pop(seq, None)
        self.resident.pop(seq, None)
        known = self.by_tensor.get(key)
        if known is not None:
            alive = known[1]()
            if alive is None or alive.seq == seq:
                del self.by_tensor[key]

    def stats(self):
        self._reap()
        with self.lock:
            out = dict(self.counts)
            out["resident_tensors"] = len(self.resident)
            out["overlap"] = self.overlap
            out["host_bytes"] = self.host_bytes
            out["host_allocated_bytes"] = self.host.allocated if self.host else 0
            out["host_free_bytes"] = self.host.free_bytes() if self.host else self.host_bytes
        return out

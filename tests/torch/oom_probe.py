"""Out-of-memory and Shrink probe for Leasehold program jobs.

Run it as a program job (it refuses to run elsewhere, exit status 2):

  leasehold run --budget 2GiB -- python3 tests/torch/oom_probe.py [--wait-shrink 60]

Phase "oom": allocates 64 MiB tensors on the job's device until PyTorch raises
torch.OutOfMemoryError, then checks that
  - what it got before the error is at most the budget and at least half of it;
  - the plug-in's leased_bytes (and its peak) stayed within the budget;
  - after freeing everything it can allocate again and a small matmul works
    (a training loop that catches the error and lowers its batch size goes on);
  - torch.cuda.empty_cache() then gives the leases back (leased_bytes near 0,
    at most --empty-tolerance-mib: cuBLAS keeps its workspace where PyTorch
    offers no public way to drop it).
Phase "fragments": caches one segment of 3/4 of the budget, cuts it into
chunks, frees every other one (holes between live tensors) and allocates a
tensor larger than any hole and than the budget's room, which fits beside the
live bytes: the plug-in serves it from the holes' pages (expandable segments),
the live chunks keep their bytes, and leased_bytes stays within the budget.
Phase "shrink": allocates about half the budget and frees it, so the plug-in
caches it, prints {"phase": "cached", "leased_bytes": N}, then with
--wait-shrink S > 0 polls the plug-in's statistics for up to S seconds and
prints {"phase": "shrunk", "leased_bytes": N} whenever leased_bytes drops (the
coordinator sent a Shrink because another job wants memory); seeing no drop
fails the check "shrunk".

The last line is {"type": "summary", "ok": bool, "checks": {...}, ...}. Exit
status: 0 when every check held, 1 otherwise (stderr names the failed checks),
2 when not running inside a Leasehold program job with the plug-in installed.
"""

import argparse
import json
import os
import sys
import time

MIB = 1 << 20


def emit(obj):
    print(json.dumps(obj), flush=True)  # flushed: the harness reads lines as they come


def refuse(message):
    print("oom_probe: " + message, file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    env_budget = os.environ.get("LEASEHOLD_BUDGET")
    p.add_argument("--budget-bytes", type=int, default=int(env_budget) if env_budget else None,
                   help="the job's budget (default: $LEASEHOLD_BUDGET)")
    p.add_argument("--chunk-mib", type=int, default=64)
    p.add_argument("--wait-shrink", type=float, default=0.0,
                   help="seconds to wait for a Shrink in phase 2 (0: skip the wait)")
    p.add_argument("--empty-tolerance-mib", type=int, default=40,
                   help="leased MiB still allowed after empty_cache (cuBLAS workspace, "
                        "small segments)")
    return p.parse_args(argv)


def setup():
    """(leasehold, torch, job) inside a program job with the plug-in; exits 2 elsewhere."""
    try:
        import leasehold
    except ImportError:
        refuse("the leasehold package is not importable: run me as a Leasehold program job "
               "(leasehold run -- python3 %s)" % sys.argv[0])
    job = leasehold.job()
    if job is None:
        refuse("not running under Leasehold (LEASEHOLD_JOB_ID is not set): run me as a "
               "program job (leasehold run -- python3 %s)" % sys.argv[0])
    import torch  # the agent's sitecustomize installs the plug-in here
    status = leasehold.torch.install_status()
    if not status["installed"]:
        refuse("Leasehold's PyTorch allocator is not installed: %s" % status["reason"])
    return leasehold, torch, job


class Checks:
    """Named pass/fail results with a detail each."""

    def __init__(self):
        self.results = {}
        self.details = {}

    def check(self, name, ok, detail):
        self.results[name] = bool(ok)
        self.details[name] = detail
        return ok

    def failed(self):
        return [n for n, ok in self.results.items() if not ok]


def fill_until_oom(torch, device, chunk_bytes, limit_bytes):
    """Allocates chunks until an allocation fails. Returns (chunks, error or None).
    Stops past limit_bytes so that an unenforced budget cannot take the whole GPU."""
    chunks = []
    try:
        while len(chunks) * chunk_bytes <= limit_bytes:
            # No local names the tensor: the error's traceback must not keep one alive.
            chunks.append(torch.empty(chunk_bytes, dtype=torch.uint8, device=device))
            chunks[-1].zero_()  # touch it: a lease that is not really mapped faults here
    except RuntimeError as e:  # OutOfMemoryError is one; the caller tells them apart
        return chunks, e
    return chunks, None


def oom_error_type(torch):
    # One class under both names in 2.x; torch.OutOfMemoryError is the newer name.
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def small_matmul_works(torch, device):
    a = torch.randn(512, 512, device=device)
    b = (a @ a).sum().item()  # .item() synchronizes: a fault shows here
    return b == b and abs(b) != float("inf")


def clear_cublas_workspaces(torch):
    # cuBLAS workspaces come from the allocator but stay with their handles;
    # this private call (used by PyTorch's own tests) lets empty_cache return them.
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is not None:
        fn()
    return fn is not None


def phase_oom(leasehold, torch, device, budget, args, checks, summary):
    chunk = args.chunk_mib * MIB
    chunks, error = fill_until_oom(torch, device, chunk, budget + 2 * chunk)
    got = len(chunks) * chunk
    at_oom = leasehold.torch.stats()
    error_type = type(error).__name__ if error is not None else None
    summary.update(allocated_before_oom_bytes=got, oom_error_type=error_type,
                   oom_error=str(error) if error is not None else None, stats_at_oom=at_oom)
    # A training loop that lowers its batch size catches exactly this type.
    checks.check("oom_raised", isinstance(error, oom_error_type(torch)),
                 "got %s after %d bytes" % (error_type or "no error", got))
    error = None  # drop the traceback, which holds frames
    checks.check("got_at_most_budget", got <= budget, "%d bytes, budget %d" % (got, budget))
    checks.check("got_at_least_half_budget", got >= budget // 2,
                 "%d bytes, half the budget %d" % (got, budget // 2))
    checks.check("leased_within_budget", at_oom["leased_bytes"] <= budget,
                 "leased %d, budget %d" % (at_oom["leased_bytes"], budget))
    checks.check("peak_leased_within_budget", at_oom["peak_leased_bytes"] <= budget,
                 "peak leased %d, budget %d" % (at_oom["peak_leased_bytes"], budget))

    chunks.clear()  # training goes on: free, allocate again, compute
    try:
        again = torch.empty(chunk, dtype=torch.uint8, device=device)
        again.zero_()
        del again
        ok, detail = small_matmul_works(torch, device), "allocated %d bytes and multiplied" % chunk
    except RuntimeError as e:
        ok, detail = False, "%s: %s" % (type(e).__name__, e)
    checks.check("works_after_oom", ok, detail)

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    after_empty = leasehold.torch.stats()["leased_bytes"]
    cleared = clear_cublas_workspaces(torch)
    torch.cuda.empty_cache()
    after_clear = leasehold.torch.stats()["leased_bytes"]
    summary.update(leased_after_empty_cache=after_empty,
                   leased_after_clearing_cublas_workspaces=after_clear if cleared else None)
    emit({"phase": "empty_cache", "leased_bytes": after_empty,
          "leased_bytes_without_cublas_workspaces": after_clear if cleared else None})
    tolerance = args.empty_tolerance_mib * MIB
    checks.check("empty_cache_releases", after_clear <= tolerance,
                 "leased %d after empty_cache (tolerance %d)" % (after_clear, tolerance))


def phase_fragments(leasehold, torch, device, budget, args, checks, summary):
    chunk = args.chunk_mib * MIB
    torch.cuda.synchronize(device)
    clear_cublas_workspaces(torch)
    torch.cuda.empty_cache()
    n = (budget * 3 // 4) // chunk
    whole = torch.empty(n * chunk, dtype=torch.uint8, device=device)
    del whole  # cached: one segment of n chunks
    chunks = [torch.full((chunk,), i % 251, dtype=torch.uint8, device=device) for i in range(n)]
    kept = chunks[1::2]
    chunks.clear()  # every other chunk freed: holes of one chunk between live ones
    live = len(kept) * chunk
    want = budget - live - 4 * chunk  # beside the live bytes, with room to spare
    before = leasehold.torch.stats()
    try:
        big = torch.ones(want, dtype=torch.uint8, device=device)
        # min and max, not sum: a uint8 sum accumulates in int64, a copy 8 times the size.
        ok = int(big.min().item()) == 1 == int(big.max().item())
        detail = "%d bytes beside %d live in %d-byte holes, budget %d" % (want, live, chunk, budget)
        del big
    except RuntimeError as e:
        ok, detail = False, "%s: %s" % (type(e).__name__, e)
    after = leasehold.torch.stats()
    intact = all(int(t.min().item()) == int(t.max().item()) == (2 * k + 1) % 251
                 for k, t in enumerate(kept))
    kept.clear()
    summary.update(fragments_request_bytes=want, fragments_live_bytes=live,
                   fragments_stats_before=before, fragments_stats_after=after)
    emit({"phase": "fragments", "request_bytes": want, "live_bytes": live,
          "unbacked_bytes": after.get("unbacked_bytes"), "unbacks": after.get("unbacks"),
          "leased_bytes": after["leased_bytes"]})
    checks.check("fragments_request_needs_the_holes",
                 want > budget - before["leased_bytes"] and want > chunk,
                 "request %d, room %d, hole %d" % (want, budget - before["leased_bytes"], chunk))
    checks.check("fragments_served", ok, detail)
    checks.check("fragments_unbacked", after.get("unbacks", 0) > before.get("unbacks", 0),
                 "unbacks %s -> %s" % (before.get("unbacks"), after.get("unbacks")))
    checks.check("fragments_live_intact", intact, "every kept chunk holds its value")
    checks.check("fragments_within_budget", after["peak_leased_bytes"] <= budget,
                 "peak leased %d, budget %d" % (after["peak_leased_bytes"], budget))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def phase_shrink(leasehold, torch, device, budget, args, checks, summary):
    chunk = args.chunk_mib * MIB
    try:
        held = [torch.empty(chunk, dtype=torch.uint8, device=device)
                for _ in range(max(1, budget // 2 // chunk))]
    except RuntimeError as e:
        checks.check("shrink_allocation", False, "%s: %s" % (type(e).__name__, e))
        return
    torch.cuda.synchronize(device)
    held.clear()  # freed, but the plug-in keeps the leases cached
    cached = leasehold.torch.stats()["leased_bytes"]
    summary["leased_cached"] = cached
    emit({"phase": "cached", "leased_bytes": cached})
    if args.wait_shrink <= 0:
        return
    deadline = time.monotonic() + args.wait_shrink
    last, settle_until = cached, None
    while time.monotonic() < deadline:
        now = leasehold.torch.stats()["leased_bytes"]
        if now < last:
            emit({"phase": "shrunk", "leased_bytes": now})
            last = now
            if settle_until is None:  # a trim may come in parts: watch a moment longer
                settle_until = time.monotonic() + 1.0
        if settle_until is not None and time.monotonic() >= settle_until:
            break
        time.sleep(0.05)
    summary["leased_after_shrink"] = last
    checks.check("shrunk", last < cached,
                 "leased %d cached, %d after waiting up to %gs" % (cached, last, args.wait_shrink))


def main(argv=None):
    args = parse_args(argv)
    leasehold, torch, job = setup()
    budget = args.budget_bytes if args.budget_bytes is not None else job.budget_bytes
    if not budget:
        refuse("no budget: set LEASEHOLD_BUDGET or --budget-bytes")
    if not job.device.startswith("cuda"):
        refuse("the job's device is %s, not a CUDA device" % job.device)
    device = torch.device(job.device)
    checks, summary = Checks(), {"budget_bytes": budget, "device": job.device,
                                 "job_id": job.id}

    phase_oom(leasehold, torch, device, budget, args, checks, summary)
    phase_fragments(leasehold, torch, device, budget, args, checks, summary)
    phase_shrink(leasehold, torch, device, budget, args, checks, summary)

    failed = checks.failed()
    emit(dict({"type": "summary", "ok": not failed, "checks": checks.results,
               "failed": {n: checks.details[n] for n in failed}}, **summary))
    if failed:
        for name in failed:
            print("oom_probe: check %s failed: %s" % (name, checks.details[name]),
                  file=sys.stderr, flush=True)
        sys.exit(1)
    print("oom_probe: all %d checks held" % len(checks.results), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

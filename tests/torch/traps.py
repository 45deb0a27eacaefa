"""PyTorch features that a pluggable allocator can get wrong, checked as a
Leasehold program job on a GPU (docs/torch-plugin.md lists what does and
does not work through the plug-in):

  leasehold run --budget 4GiB -- python3 tests/torch/traps.py

- cudnn_benchmark: a script that sets torch.backends.cudnn.benchmark = True
  trains convolutions (the flag stays off, said once on stderr); set
  underneath, the algorithm search raises (PyTorch asks the allocator for
  cacheInfo), which is why it stays off.
- record_stream: a block freed on the main stream while a side stream still
  reads it (record_stream) is not handed out before the side stream is done.
- cross_stream_reuse: with the budget full, a block freed on one stream while
  that stream's queued work still writes it is handed to another stream only
  after that work ran.
- non_blocking: pinned host to device and back with non_blocking=True.
- cuda_graph: a forward and backward captured with torch.cuda.graph and
  replayed on new inputs give the eager results; once the graph is gone,
  torch.cuda.empty_cache() gives the memory it kept aside back.
- memory_stats: PyTorch's own statistics raise through a pluggable
  allocator; leasehold.torch.stats() has the figures.

Prints one JSON line per check and a summary; exit status 0 when every
check held, 1 otherwise, 2 outside a Leasehold program job.
"""
import gc
import json
import sys

import torch

import leasehold
import leasehold.torch as lt

MIB = 1 << 20
results = {}


def check(name):
    def wrap(fn):
        try:
            detail = fn()
            results[name] = True
            print(json.dumps({"check": name, "ok": True, "detail": detail}), flush=True)
        except Exception as e:  # a failed check, reported with the others
            results[name] = False
            print(json.dumps({"check": name, "ok": False, "error": "%s: %s" % (type(e).__name__, e)}),
                  flush=True)
        return fn
    return wrap


def spin(stream, ms):
    """Keeps `stream` busy for about `ms` milliseconds."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 1.5e6))  # cycles, at well over 1 GHz


def release_all():
    """empty_cache, after dropping cuBLAS's workspaces: PyTorch keeps one of
    32 MiB per stream that ran a matmul (the side and capture streams here),
    allocated through the allocator and in use until cleared."""
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


if leasehold.job() is None or not lt.install_status()["installed"]:
    print("traps: run this as a Leasehold program job on a CUDA device", file=sys.stderr)
    sys.exit(2)
torch.manual_seed(0)
device = torch.device("cuda")


@check("cudnn_benchmark")
def _():
    torch.backends.cudnn.benchmark = True  # as many training scripts do
    assert torch.backends.cudnn.benchmark is False, "the flag was left on"
    conv = torch.nn.Conv2d(3, 16, 3).to(device)
    x = torch.randn(8, 3, 32, 32, device=device)
    conv(x).sum().backward()
    torch.cuda.synchronize()
    # Underneath the guard: the search itself.
    raw = torch._C._set_cudnn_benchmark.__wrapped__
    raw(True)
    try:
        torch.nn.Conv2d(3, 8, 5).to(device)(torch.randn(4, 3, 40, 40, device=device)).sum()
        torch.cuda.synchronize()
        underneath = "works"
    except RuntimeError as e:
        underneath = "raises: " + str(e).splitlines()[0][:160]
    finally:
        raw(False)
    return {"trained_with_the_flag_set": True, "benchmark_underneath": underneath}


@check("record_stream")
def _():
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    n = 16 * MIB // 4
    a = torch.full((n,), 3.0, device=device)
    side.wait_stream(main)
    spin(side, 50)
    with torch.cuda.stream(side):
        out = a * 2  # runs after the spin, reading a
    a.record_stream(side)
    del a
    b = torch.zeros(n, device=device)  # a's size: a's block, were it reusable already
    b.add_(1)
    side.synchronize()
    torch.cuda.synchronize()
    assert bool(out.eq(6).all()), "the side stream read memory handed out again"
    assert bool(b.eq(1).all())
    return {"bytes": 4 * n}


@check("cross_stream_reuse")
def _():
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    n = 32 * MIB // 4
    spin(main, 300)
    # The whole budget in x-sized blocks: the side stream's block below can
    # only be the one main frees.
    chunks = []
    try:
        while True:
            chunks.append(torch.empty(n, device=device))
    except torch.OutOfMemoryError:
        pass
    x = chunks.pop()
    x.fill_(5)  # queued behind the spin
    del x       # freed on main while the fill is still queued
    requests = lt.stats()["lease_requests"]
    with torch.cuda.stream(side):
        y = torch.empty(n, device=device)  # main's block, once main's fill ran
        y.fill_(7)
    side.synchronize()
    torch.cuda.synchronize()
    reused = lt.stats()["lease_requests"] == requests
    del chunks  # room for the comparison's own tensor
    torch.cuda.empty_cache()
    assert bool(y.eq(7).all()), "another stream's queued write landed on a reused block"
    del y
    return {"bytes": 4 * n, "reused_the_freed_block": reused}


@check("non_blocking")
def _():
    h = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    d = h.to(device, non_blocking=True)
    back = torch.empty_like(h).pin_memory()
    back.copy_(d * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, h * 2)
    return {"elements": h.numel()}


@check("cuda_graph")
def _():
    release_all()
    baseline = lt.stats()["leased_bytes"]
    # Activations of 32 MiB: the graph's blocks lie in segments of their own.
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10)).to(device)
    static_x = torch.randn(2048, 1024, device=device)
    static_y = torch.randint(0, 10, (2048,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch asks
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)  # the capture allocates the gradients
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
    params = list(model.parameters())
    static_grads = [p.grad for p in params]  # each replay writes these
    worst = 0.0
    for _ in range(5):
        x = torch.randn(2048, 1024, device=device)
        y = torch.randint(0, 10, (2048,), device=device)
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager = loss_fn(model(x), y)
        eager_grads = torch.autograd.grad(eager, params)  # leaves p.grad alone
        torch.cuda.synchronize()
        worst = max(worst, abs(float(eager.detach()) - float(static_loss.detach())))
        for g, e in zip(static_grads, eager_grads):
            worst = max(worst, float((g - e).abs().max()))
    assert worst < 1e-3, "replay differs from eager by %g" % worst
    with_graph = lt.stats()
    leased_with_graph = with_graph["leased_bytes"]
    del graph, static_loss, static_x, static_y, static_grads, params, model, x, y, eager
    del eager_grads, g, e
    gc.collect()  # modules and autograd graphs may sit in reference cycles
    torch.cuda.synchronize()
    freed = lt.stats()
    release_all()  # once the graph is gone, as docs/torch-plugin.md asks
    after = lt.stats()
    leased_after = after["leased_bytes"]
    print(json.dumps({"cuda_graph_stats": {"before": baseline, "with_graph": with_graph,
                                           "tensors_freed": freed, "after_empty_cache": after}}),
          flush=True)
    assert leased_with_graph >= baseline + 32 * MIB, "the graph used less memory than expected"
    assert leased_after <= baseline + 8 * MIB, \
        "empty_cache after the graph kept %d bytes" % (leased_after - baseline)
    return {"worst_difference": worst, "leased_before": baseline,
            "leased_with_graph": leased_with_graph, "leased_after_empty_cache": leased_after}


@check("memory_stats")
def _():
    try:
        torch.cuda.memory_allocated()
        native = "works"
    except RuntimeError as e:
        native = "raises: " + str(e).splitlines()[0][:120]
    s = lt.stats()
    assert s["allocations"] > 0 and s["peak_leased_bytes"] > 0
    return {"torch.cuda.memory_allocated": native, "leasehold.torch.stats": s}


ok = all(results.values())
print(json.dumps({"type": "summary", "ok": ok, "checks": results}), flush=True)
sys.exit(0 if ok else 1)

"""Cost of one CUDA tensor allocation and free as PyTorch's allocator sees it:
the time of `torch.empty(n, device="cuda")` followed by its release, in a
loop, for a few sizes; and of a cudaStreamIsCapturing query (through
torch.cuda.is_current_stream_capturing). Run it alone and as a Leasehold
program job to see the per-allocation price of the plug-in.

  python3 tests/torch/alloc_cost.py [--iterations N]

Prints one JSON line: {"allocator": ..., "ns_per_pair": {size: ns}, "capture_query_ns": ns}.
"""
import argparse
import json
import time

import torch


def per_call_ns(fn, iterations):
    for _ in range(1000):  # warm the caches
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(iterations):
        fn()
    return (time.perf_counter_ns() - t0) / iterations


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=200000)
    args = p.parse_args()
    torch.cuda.init()
    empty_loop = per_call_ns(lambda: None, args.iterations)  # the loop's own cost
    pairs = {}
    for size in (512, 1 << 16, 4 << 20, 64 << 20):
        pairs[size] = round(per_call_ns(lambda: torch.empty(size, dtype=torch.uint8, device="cuda"),
                                        args.iterations) - empty_loop)
    query = per_call_ns(torch.cuda.is_current_stream_capturing, args.iterations) - empty_loop
    try:
        import leasehold.torch as lt
        allocator = "leasehold" if lt.install_status()["installed"] else "pytorch"
    except ImportError:
        allocator = "pytorch"
    print(json.dumps({"allocator": allocator, "ns_per_pair": pairs,
                      "capture_query_ns": round(query)}), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention (the flash backend, bf16) timed at
the shapes leasehold-bench-engine's "attention" section uses, for the table
in docs/benchmarks.md. JSON on stdout: milliseconds per causal forward and
per forward and backward, CUDA events, median of 30 after 5 warm-up calls.

  python3 tests/bench/attention_torch.py [--shape 64,6,256,64]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def timed(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="64,6,256,64", help="batch,heads,tokens,head size")
    args = p.parse_args()
    shape = [int(x) for x in args.shape.split(",")]
    torch.manual_seed(2)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = {"shape": shape, "torch": torch.__version__}
    backends = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}
    for name, backend in backends.items():
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                def forward():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def both():
                    q.grad = k.grad = v.grad = None
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

                out[name + "_forward_ms"] = timed(forward)
                out[name + "_forward_backward_ms"] = timed(both)
        except RuntimeError as e:  # a backend this build or GPU lacks
            out[name + "_error"] = str(e).splitlines()[0]
    json.dump(out, __import__("sys").stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

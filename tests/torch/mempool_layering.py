"""The layering Leasehold did not choose, measured: PyTorch's own caching
allocator on top, an external allocator under it through torch.cuda.MemPool
and torch.cuda.use_mem_pool (docs/torch-plugin.md, "Why PyTorch's whole
allocator"). A pool receives only what is allocated while the allocating
thread is inside use_mem_pool; this script measures how much of a training
step's memory that is, on a plain PyTorch (no Leasehold needed).

  python3 tests/torch/mempool_layering.py [--model resnet18] [--steps 20]

It builds the model, its data and its optimizer and runs the steps all
inside `with torch.cuda.use_mem_pool(pool)`, as a script would have to be
changed to do, then compares the pool's segments with everything PyTorch
reserved. Prints one JSON line.
"""
import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import train  # noqa: E402  (tests/torch/train.py: the models and their data)


def pool_bytes(pool):
    return sum(seg["total_size"] for seg in pool.snapshot())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", choices=sorted(train.DEFAULT_BATCH))
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if not hasattr(torch.cuda, "MemPool"):
        sys.exit("mempool_layering: torch %s has no torch.cuda.MemPool" % torch.__version__)
    device = torch.device("cuda")
    torch.manual_seed(0)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        model, opt, loss_fn = train.build(args.model, device)
        batches = train.make_batches(args.model, train.DEFAULT_BATCH[args.model], 0, device)
        for step in range(args.steps):
            train.train_step(model, opt, loss_fn, batches[step % len(batches)],
                             contextlib.nullcontext)
        torch.cuda.synchronize()
    in_pool = pool_bytes(pool)
    reserved = torch.cuda.memory_reserved()
    print(json.dumps({
        "model": args.model,
        "torch": torch.__version__,
        "reserved_bytes": reserved,
        "pool_bytes": in_pool,
        "outside_pool_bytes": reserved - in_pool,
        "outside_pool_share": round((reserved - in_pool) / reserved, 3) if reserved else 0,
        "why": "allocations of threads outside use_mem_pool (autograd's device threads run "
               "backward) go to PyTorch's default pool",
    }), flush=True)


if __name__ == "__main__":
    main()

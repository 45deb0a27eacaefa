"""PyTorch reference for leasehold-bench-share: trains a Leasehold job file's
model (the examples' layer types: Linear, Conv2d, ReLU, MaxPool2d, Flatten,
Dropout) on its Fashion-MNIST data, with the whole dataset in device memory
(batches gathered there, as Leasehold does with a resident dataset), batch
size, Adam or SGD and epochs from the file; full FP32 (no TF32). Eager, or
with --cuda-graph PyTorch's strongest configuration for small steps: the
whole step (the batch gather, forward, backward and a capturable optimizer's
update) captured once with torch.cuda.graph and replayed, the batch's
indices copied into the graph's input before each replay (a last, smaller
batch of an epoch runs eagerly).

  python3 tests/bench/torch_train.py JOB.json [--epochs N] [--processes P] [--cuda-graph]

Prints JSON: with one process its training throughput (samples/s, epochs
only, no evaluation, after one warm-up step); with --processes P it starts P
such processes (each its own CUDA context, like P jobs on P agents) that all
begin training at the same moment, and prints their total, the spread, and
each one's figures (late_seconds: how far one missed the common start).
"""
import argparse
import gzip
import json
import os
import struct
import subprocess
import sys
import time


def read_idx(path):
    import numpy as np
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def dataset_files(job):
    d = job["dataset"]
    base = d.get("directory", "/usr/share/datasets/" + d.get("name", "fashion-mnist"))
    return (d.get("train_images", base + "/train-images-idx3-ubyte.gz"),
            d.get("train_labels", base + "/train-labels-idx1-ubyte.gz"))


def build_model(layers):
    import torch.nn as nn
    out = []
    for l in layers:
        t = l["type"]
        if t == "Linear":
            out.append(nn.Linear(l["in"], l["out"]))
        elif t == "Conv2d":
            out.append(nn.Conv2d(l["in"], l["out"], l["kernel"], l.get("stride", 1) or 1,
                                 l.get("padding", 0)))
        elif t == "ReLU":
            out.append(nn.ReLU())
        elif t == "MaxPool2d":
            out.append(nn.MaxPool2d(l["kernel"], l.get("stride", 0) or l["kernel"]))
        elif t == "Flatten":
            out.append(nn.Flatten())
        elif t == "Dropout":
            out.append(nn.Dropout(l.get("p", 0.5)))
        else:
            raise ValueError("layer type " + t + " is not supported here")
    return nn.Sequential(*out)


def make_optimizer(job, parameters, capturable=False):
    """The job file's optimiser (Adam or SGD with its fields and defaults);
    capturable: Adam keeps its step count on the GPU, for graph capture."""
    import torch
    o = job.get("optimizer", {})
    if o.get("type", "Adam") == "SGD":
        return torch.optim.SGD(parameters, lr=o.get("lr", 1e-3), momentum=o.get("momentum", 0),
                               weight_decay=o.get("weight_decay", 0))
    return torch.optim.Adam(parameters, lr=o.get("lr", 1e-3),
                            betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0),
                            capturable=capturable)


def graphed_step(model, opt, x, y, batch):
    """The whole training step of `batch` samples at the indices in the
    returned tensor, captured as a CUDA graph (PyTorch's whole-network
    capture recipe: warm-up on a side stream, gradients set to None before
    the capture so that backward allocates them from the graph's pool)."""
    import torch
    import torch.nn.functional as F
    idx = torch.arange(batch, device=x.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return graph, idx


def train(job, epochs, start_at=0.0, cuda_graph=False):
    import torch
    dev = torch.device("cuda")
    torch.manual_seed(job.get("seed", 1))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    images, labels = dataset_files(job)
    d = job["dataset"]
    x = torch.from_numpy(read_idx(images).copy()).to(dev).float().div_(255)
    x = ((x - d.get("mean", 0.0)) / d.get("std", 1.0)).unsqueeze(1)
    y = torch.from_numpy(read_idx(labels).astype("int64")).to(dev)
    limit = d.get("train_limit", 0)
    if limit:
        x, y = x[:limit], y[:limit]
    model = build_model(job["model"]).to(dev)
    opt = make_optimizer(job, model.parameters(), capturable=cuda_graph)
    batch = job.get("batch_size", 64)
    n = x.shape[0]
    # One step first (cuBLAS and the kernels load), as a warmed-up standby
    # agent has done, or the graph's capture; then all processes start
    # together.
    graph = None
    if cuda_graph:
        graph, static_idx = graphed_step(model, opt, x, y, batch)
    else:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[:batch]), y[:batch]).backward()
        opt.step()
    torch.cuda.synchronize()
    late = time.time() - start_at if start_at else 0.0
    if late < 0:
        time.sleep(-late)
    start = time.time()
    train_seconds = 0.0
    for _ in range(epochs):
        t0 = time.perf_counter()
        order = torch.randperm(n, device=dev)
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            if graph is not None and idx.shape[0] == batch:
                static_idx.copy_(idx)
                graph.replay()
                continue
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        torch.cuda.synchronize()
        train_seconds += time.perf_counter() - t0
    return {"framework": "pytorch " + torch.__version__ + (" cuda-graph" if cuda_graph else ""),
            "device": torch.cuda.get_device_name(0),
            "job": job.get("name", "?"), "epochs": epochs, "samples": n * epochs,
            "train_seconds": train_seconds, "samples_per_second": n * epochs / train_seconds,
            "late_seconds": max(late, 0.0), "start": start, "end": time.time()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--start-at", type=float, default=0.0,
                   help="Unix time to start training at (set by --processes)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay the whole step as one CUDA graph")
    a = p.parse_args()
    job = json.load(open(a.job))
    epochs = a.epochs or job.get("epochs", 1)
    if a.processes == 1:
        print(json.dumps(train(job, epochs, a.start_at, a.cuda_graph)))
        return
    # Every process trains from the same moment, after its start-up, so
    # their rates add up (a start-up staggered by seconds would not overlap).
    start_at = time.time() + 20 + 0.5 * a.processes
    cmd = [sys.executable, os.path.abspath(__file__), a.job, "--epochs", str(epochs),
           "--start-at", str(start_at)] + (["--cuda-graph"] if a.cuda_graph else [])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(a.processes)]
    results = []
    for pr in procs:
        out, _ = pr.communicate()
        if pr.returncode != 0:
            sys.exit("a training process failed")
        results.append(json.loads(out.strip().splitlines()[-1]))
    rates = [r["samples_per_second"] for r in results]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    print(json.dumps({"framework": results[0]["framework"], "job": results[0]["job"],
                      "processes": a.processes, "total_samples_per_second": sum(rates),
                      "late_seconds": max(r["late_seconds"] for r in results),
                      "wall_samples_per_second": sum(r["samples"] for r in results) / wall,
                      "min": min(rates), "max": max(rates), "runs": results}))


if __name__ == "__main__":
    main()

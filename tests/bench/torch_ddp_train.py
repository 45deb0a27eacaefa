"""PyTorch DDP reference for leasehold-bench-data-parallel: trains a Leasehold
job file's model on its Fashion-MNIST data over N GPUs with
DistributedDataParallel (NCCL; gradient_as_bucket_view and static_graph,
DDP's fastest settings; full FP32, no TF32), one process per GPU as torchrun
starts them, at a fixed per-replica batch. Each step every replica takes its
slice of the next global batch of the epoch's order, as Leasehold's replicas
do; the dataset is in device memory.

  python3 tests/bench/torch_ddp_train.py JOB.json --replicas N [--epochs E] [--batch B]

Prints one JSON line: the replicas' total training throughput (samples/s,
epochs only, after one warm-up step) and rank 0's test accuracy.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import build_model, dataset_files, make_optimizer, read_idx  # noqa: E402


def load(job, dev, which):
    import torch
    images, labels = dataset_files(job)
    if which == "test":
        base = os.path.dirname(images)
        images, labels = base + "/t10k-images-idx3-ubyte.gz", base + "/t10k-labels-idx1-ubyte.gz"
    d = job["dataset"]
    x = torch.from_numpy(read_idx(images).copy()).to(dev).float().div_(255)
    x = ((x - d.get("mean", 0.0)) / d.get("std", 1.0)).unsqueeze(1)
    y = torch.from_numpy(read_idx(labels).astype("int64")).to(dev)
    return x, y


def replica(job, epochs, batch):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(job.get("seed", 1))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    x, y = load(job, dev, "train")
    model = build_model(job["model"]).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[rank], gradient_as_bucket_view=True, static_graph=True)
    opt = make_optimizer(job, ddp.parameters())
    n = x.shape[0]
    steps = n // (batch * world)
    # One step first (cuBLAS, cuDNN and NCCL warm up), as a standby agent has.
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(ddp(x[:batch]), y[:batch]).backward()
    opt.step()
    torch.cuda.synchronize()
    dist.barrier()
    train_seconds = 0.0
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(job.get("seed", 1) * 1000003 + epoch)
        order = torch.randperm(n, generator=g).to(dev)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(steps):
            first = s * batch * world + rank * batch
            idx = order[first:first + batch]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
        torch.cuda.synchronize()
        train_seconds += time.perf_counter() - t0
    result = None
    if rank == 0:
        tx, ty = load(job, dev, "test")
        model.eval()
        with torch.no_grad():
            correct = sum((model(tx[i:i + 1000]).argmax(1) == ty[i:i + 1000]).sum().item()
                          for i in range(0, tx.shape[0], 1000))
        result = {"framework": "pytorch " + torch.__version__ + " DDP (NCCL)",
                  "device": torch.cuda.get_device_name(0), "job": job.get("name", "?"),
                  "replicas": world, "batch_per_replica": batch, "global_batch": batch * world,
                  "epochs": epochs, "samples_per_second": steps * batch * world * epochs / train_seconds,
                  "test_accuracy": correct / tx.shape[0]}
    dist.barrier()
    dist.destroy_process_group()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--batch", type=int, default=0)
    a = p.parse_args()
    job = json.load(open(a.job))
    epochs = a.epochs or job.get("epochs", 1)
    batch = a.batch or job.get("batch_size", 64)
    if "RANK" in os.environ:
        r = replica(job, epochs, batch)
        if r:
            print(json.dumps(r), flush=True)
        return
    # torchrun's part: a free port, then one process per replica.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(a.replicas):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(a.replicas), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        cmd = [sys.executable, os.path.abspath(__file__), a.job, "--epochs", str(epochs),
               "--batch", str(batch)]
        procs.append(subprocess.Popen(cmd, env=env))
    if any(pr.wait() != 0 for pr in procs):
        sys.exit("a replica failed")


if __name__ == "__main__":
    main()

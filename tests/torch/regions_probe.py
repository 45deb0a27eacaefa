"""Shared regions from PyTorch on a GPU (tests/gpu/run-torch-extras-checks.sh):
run twice as program jobs, one after the other.

The first run builds a dataset on the GPU into region datasets/probe (its
build() runs) and publishes a module's parameters in params/probe; the
second finds both: build() does not run, the tensors are equal to a fresh
build's and live on the GPU in the region (no copy), and init_from gives
the published weights. Prints one JSON line.
"""
import json
import sys

import torch

import leasehold
from leasehold.torch import cached_dataset, init_from, publish_parameters

built = []


def build():
    built.append(True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 256, device="cuda", generator=g)
    return {"x": x, "y": (x[:, :4].sum(1) > 0).long()}


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 2)).cuda()


data = cached_dataset("probe", build)
fresh = {k: v.clone() for k, v in build().items()}
built.pop()
result = {"built": bool(built), "device": str(data["x"].device),
          "equal": all(torch.equal(data[k], fresh[k]) for k in fresh),
          "in_region": leasehold.torch.stats()["in_use_bytes"] < fresh["x"].numel() * 4 * 2}
if sys.argv[1] == "publish":
    result["digest"] = publish_parameters(net(7), "probe")
else:
    m = net(1)
    result["digest"] = init_from(m, "probe")
    result["weights_match"] = torch.equal(m[0].weight, net(7)[0].weight)
loss = torch.nn.functional.cross_entropy(net(3)(data["x"]), data["y"])
loss.backward()
result["loss"] = loss.item()
print(json.dumps(result), flush=True)

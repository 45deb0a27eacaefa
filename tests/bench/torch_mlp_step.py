"""PyTorch eager reference for leasehold-bench-engine's MLP step: the same
Fashion-MNIST MLP (784-256-128-10), batch 128, Adam lr 1e-3, on the same GPU.
Prints JSON. Run: python3 tests/bench/torch_mlp_step.py"""
import json
import time

import torch


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the engine's default: full FP32
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 1, 28, 28, device=dev)
    y = (torch.arange(128, device=dev) % 10)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()

    for _ in range(20):
        step()
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    s = times[len(times) // 2]
    print(json.dumps({"framework": "pytorch " + torch.__version__, "device": torch.cuda.get_device_name(0),
                      "batch": 128, "step_ms": s * 1e3, "samples_per_second": 128 / s}, indent=2))


if __name__ == "__main__":
    main()

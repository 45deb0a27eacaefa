"""The small PyTorch job of tests/bench/torch_standby_bench.py: builds an MLP
on the GPU, runs one training step and reports it (leasehold.report), the
moment the benchmark measures to."""
import torch
import torch.nn.functional as F

import leasehold

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10)).cuda()
optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 784, device="cuda")
y = torch.randint(0, 10, (64,), device="cuda")
loss = F.cross_entropy(model(x), y)
loss.backward()
optimiser.step()
leasehold.report(step=1, loss=loss.item())

"""An ordinary PyTorch training script: the "unmodified user script" of
Leasehold's program-job checks and of tests/bench/torch_program_bench.py.

It runs the same with or without Leasehold:

  python3 tests/torch/train.py --model lenet --steps 300
  leasehold run --budget 8GiB -- python3 tests/torch/train.py --model gpt2
  python3 tests/torch/train.py --model lenet --device cpu --steps 30   # no GPU

Models: lenet (the LeNet of deploy/jobs/fashion-mnist-lenet.json, Adam lr 1e-3)
on synthetic Fashion-MNIST-shaped data; resnet18 (torchvision) on synthetic
3x64x64 images; gpt2 (transformers, a 6-layer GPT-2 built from its config) on
synthetic token sequences of length 256. The data is deterministic from
--seed, resident on the device, and learnable (the loss falls).

Output on stdout, one JSON line each: {"step", "loss", "elapsed_s"} after step
1 and every --log-every steps (and the last step), then one
{"type": "summary", ...} line with steps/s (after --warmup steps), the final
loss, the peak device memory, start-up times and allocator statistics.
Inside a Leasehold program job it also calls leasehold.report() at each
logged step; outside it never touches Leasehold.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time


def process_age():
    """Seconds since this process started, or None where /proc is missing.

    The start is /proc/self/stat field 22 (clock ticks since boot). It is
    compared with /proc/uptime (the same boot clock, 10 ms resolution) rather
    than with /proc/stat's btime, which has whole seconds only and would put
    up to a second of error into a start-up that takes about that long."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # Field 2 (the command name) may hold spaces: count from its ')'.
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_AGE_AT_TOP = process_age()  # interpreter start-up, site and sitecustomize included
_t = time.perf_counter()
import torch  # noqa: E402  (timed: under Leasehold this also installs the plug-in)
_IMPORT_TORCH_S = time.perf_counter() - _t
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import leasehold
except ImportError:
    leasehold = None

# torch.OutOfMemoryError (2.x); older torch has it under torch.cuda only.
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or getattr(
    getattr(torch, "cuda", None), "OutOfMemoryError", MemoryError)
DEFAULT_BATCH = {"lenet": 256, "resnet18": 64, "gpt2": 8, "gpt2-small": 8}
DATA_BATCHES = 16  # distinct batches kept on the device, cycled through
GPT2_SEQ = 256
SEQ = [GPT2_SEQ]  # --seq, set in main()
GPT2_VOCAB = 8192
# leasehold.torch.spill's options that --spill-option may set.
SPILL_OPTIONS = ("min_bytes", "lookahead", "high_water", "max_in_flight", "slab_bytes", "overlap")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(DEFAULT_BATCH), default="lenet")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (default: lenet 256, resnet18 64, gpt2 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=20, help="steps excluded from the timing")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--seq", type=int, default=GPT2_SEQ,
                   help="sequence length of the GPT models (default %d)" % GPT2_SEQ)
    p.add_argument("--save-on-cpu", action="store_true",
                   help="PyTorch's own activation offload: the forward pass inside "
                        "torch.autograd.graph.save_on_cpu(pin_memory=True)")
    p.add_argument("--no-spill", action="store_true",
                   help="under Leasehold, turn its activation spilling off "
                        "(leasehold.torch.spill(False)): the plug-in alone")
    p.add_argument("--spill-option", action="append", default=[], metavar="NAME=VALUE",
                   help="under Leasehold, spill with this option of leasehold.torch.spill "
                        "(high_water=0.5, lookahead=4, ...); repeatable")
    p.add_argument("--grad-digest", action="store_true",
                   help="put a digest of the last step's gradients in the summary")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (cuDNN, cuBLAS, PyTorch's own where it has them, "
                        "the math path of attention): two runs give the same losses, so a "
                        "comparison sees memory, not atomics' order")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="let cuDNN time its algorithms (PyTorch's fastest convolutions; under "
                        "Leasehold the plug-in keeps it off)")
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = DEFAULT_BATCH[args.model]
    options = {}
    for item in args.spill_option:
        name, _, value = item.partition("=")
        if name not in SPILL_OPTIONS:
            p.error("--spill-option %r: NAME is one of %s" % (item, ", ".join(SPILL_OPTIONS)))
        try:
            options[name] = int(value)
        except ValueError:
            try:
                options[name] = float(value)
            except ValueError:
                p.error("--spill-option %r: NAME=NUMBER" % item)
    args.spill_option = options
    if args.no_spill and options:
        p.error("--no-spill and --spill-option contradict each other")
    if args.steps < 1 or args.batch < 1 or args.log_every < 1:
        p.error("--steps, --batch and --log-every must be at least 1")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be at least 0 and less than --steps")
    return args


# ---- models -----------------------------------------------------------------------


def lenet():
    # deploy/jobs/fashion-mnist-lenet.json, layer for layer.
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, 10))


def resnet18():
    try:
        import torchvision
    except ImportError:
        sys.exit("train.py: --model resnet18 needs torchvision, which is not installed")
    return torchvision.models.resnet18(num_classes=10)


def gpt2(layers=6, width=512, heads=8):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        sys.exit("train.py: --model gpt2 needs transformers, which is not installed")
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=SEQ[0],
                        vocab_size=GPT2_VOCAB, use_cache=False)  # no KV cache in training
    return GPT2LMHeadModel(config)


def gpt2_small():
    """GPT-2 small's shape (12 layers, width 768, 12 heads)."""
    return gpt2(12, 768, 12)


def build(name, device):
    """(model, optimizer, loss function of (model, batch))."""
    model = {"lenet": lenet, "resnet18": resnet18, "gpt2": gpt2,
             "gpt2-small": gpt2_small}[name]().to(device)
    model.train()
    if name == "lenet":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # the job file's optimizer
    elif name == "resnet18":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if name.startswith("gpt2"):
        def loss_fn(m, batch):
            return m(input_ids=batch, labels=batch).loss
    else:
        def loss_fn(m, batch):
            x, y = batch
            return F.cross_entropy(m(x), y)
    return model, opt, loss_fn


# ---- data -------------------------------------------------------------------------


def class_images(gen, n, shape):
    """Images = a fixed template per class + noise: a classifier can learn them."""
    templates = torch.randn((10,) + shape, generator=gen)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = 0.7 * templates[labels] + torch.randn((n,) + shape, generator=gen)
    return images, labels


def token_sequences(gen, n):
    """Sequences where each token is 5*previous + 17 + r (mod vocab), r in 0..3:
    learnable down to a loss of ln 4."""
    seq = torch.empty(n, SEQ[0], dtype=torch.long)
    seq[:, 0] = torch.randint(0, GPT2_VOCAB, (n,), generator=gen)
    noise = torch.randint(0, 4, (n, SEQ[0]), generator=gen)
    for t in range(1, SEQ[0]):
        seq[:, t] = (seq[:, t - 1] * 5 + 17 + noise[:, t]) % GPT2_VOCAB
    return seq


def make_batches(name, batch, seed, device):
    """DATA_BATCHES batches on the device. Generated on the CPU with their own
    generator, so the data does not depend on the device or on the model's
    initialization, then moved once."""
    gen = torch.Generator().manual_seed(seed + 1)
    n = batch * DATA_BATCHES
    if name.startswith("gpt2"):
        seq = token_sequences(gen, n).to(device)
        return [seq[i * batch:(i + 1) * batch] for i in range(DATA_BATCHES)]
    shape = (1, 28, 28) if name == "lenet" else (3, 64, 64)
    x, y = class_images(gen, n, shape)
    x, y = x.to(device), y.to(device)
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
            for i in range(DATA_BATCHES)]


# ---- Leasehold (only when running inside it) --------------------------------------


def leasehold_job():
    """The Leasehold program job this process runs for, or None."""
    return leasehold.job() if leasehold is not None else None


def plugin_installed():
    return leasehold is not None and leasehold.torch.install_status()["installed"]


def plugin_stats():
    return leasehold.torch.stats() if plugin_installed() else None


# ---- training ---------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, loss_fn, batch, autocast, offload):
    opt.zero_grad(set_to_none=True)
    with autocast(), offload():
        loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    return loss


def emit(obj):
    # Flushed at once: a pipe would buffer it, and the bench times the first line.
    print(json.dumps(obj), flush=True)


def start_device(device, startup):
    """Brings CUDA up, timing the context and the first allocation apart:
    under Leasehold the first allocation opens the session and maps the pool."""
    if device.type != "cuda":
        return
    t = time.perf_counter()
    torch.cuda.init()
    # torch.cuda.init() may leave the context to the first CUDA call;
    # synchronizing creates it without allocating, so its cost lands here.
    torch.cuda.synchronize(device)
    startup["cuda_init"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    startup["first_allocation"] = time.perf_counter() - t
    startup["cuda_context"] = startup["cuda_init"] + startup["first_allocation"]


def allocator_summary(device, stats_at_warmup, timed_steps):
    if not plugin_installed():
        return {"name": "pytorch" if device.type == "cuda" else "cpu"}
    end = plugin_stats() or {}
    out = {"name": "leasehold"}
    out.update(end)
    if stats_at_warmup is not None and end:
        requests = end["lease_requests"] - stats_at_warmup["lease_requests"]
        out["lease_requests_after_warmup"] = requests
        out["lease_requests_per_step"] = requests / timed_steps
        allocations = end["allocations"] - stats_at_warmup["allocations"]
        out["allocations_per_step"] = allocations / timed_steps
    return out


def grad_digest(model):
    """BLAKE2b-64 of the last step's gradients, in parameter order: equal
    digests, bit-identical gradients."""
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        if p.grad is not None:
            h.update(p.grad.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                     .tobytes())
    return h.hexdigest()


def spill_stats():
    """What Leasehold's activation spilling did (None outside Leasehold)."""
    if not plugin_installed():
        return None
    return leasehold.torch.spill_stats()


def peak_device_bytes(device):
    if device.type != "cuda":
        return None
    if plugin_installed():  # torch.cuda.memory_stats raises under a pluggable allocator
        return (plugin_stats() or {}).get("peak_leased_bytes")
    return torch.cuda.max_memory_reserved(device)


def main(argv=None):
    startup = {"interpreter": _AGE_AT_TOP, "import_torch": _IMPORT_TORCH_S,
               "interpreter_to_main": process_age()}
    args = parse_args(argv)
    SEQ[0] = args.seq
    device = torch.device(args.device)
    # Off unless asked: through a pluggable allocator the search would raise
    # (Leasehold's install keeps it off and says so).
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if args.deterministic:
        # Read when cuBLAS makes its handle (the first matmul), so not too late here.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            # Flash and memory-efficient attention accumulate their backward
            # with atomics: the GPT's attention takes the math path instead.
            for backend in ("flash", "mem_efficient", "cudnn"):
                enable = getattr(torch.backends.cuda, "enable_%s_sdp" % backend, None)
                if enable is not None:
                    enable(False)
    torch.manual_seed(args.seed)
    job = leasehold_job()
    if args.no_spill and plugin_installed():
        leasehold.torch.spill(False)
    if args.spill_option and plugin_installed():
        leasehold.torch.spill(True, **args.spill_option)  # the job's host tier, these options

    start_device(device, startup)
    t = time.perf_counter()
    model, opt, loss_fn = build(args.model, device)
    sync(device)
    startup["model_build"] = time.perf_counter() - t
    t = time.perf_counter()
    batches = make_batches(args.model, args.batch, args.seed, device)
    sync(device)
    startup["data"] = time.perf_counter() - t

    def autocast():
        if not args.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def offload():
        if not args.save_on_cpu:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")

    t_start = time.perf_counter()
    t_timed, stats_at_warmup, loss = t_start, plugin_stats(), None
    for step in range(1, args.steps + 1):
        try:
            loss = train_step(model, opt, loss_fn, batches[(step - 1) % DATA_BATCHES], autocast,
                              offload)
        except OUT_OF_MEMORY:
            # The numbers at the failure, then the error as it was.
            emit({"type": "oom", "step": step, "spill": spill_stats(),
                  "allocator": plugin_stats()})
            raise
        if step == 1:
            sync(device)
            startup["first_step"] = time.perf_counter() - t_start
        if step == args.warmup:
            sync(device)  # the clock must not run ahead of the device
            t_timed, stats_at_warmup = time.perf_counter(), plugin_stats()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            value = loss.item()
            emit({"step": step, "loss": value, "elapsed_s": time.perf_counter() - t_start})
            if job is not None:
                # report() refuses a non-finite loss; a diverged run still reports its step.
                leasehold.report(step=step, epoch=0, samples=args.batch * step,
                                 loss=value if math.isfinite(value) else None)
    sync(device)
    timed_seconds = time.perf_counter() - t_timed
    timed_steps = args.steps - args.warmup

    emit({"type": "summary", "model": args.model, "device": str(device), "batch": args.batch,
          "amp": args.amp, "torch": torch.__version__, "steps": args.steps,
          "warmup": args.warmup, "steps_per_second": timed_steps / timed_seconds,
          "final_loss": loss.item(), "peak_device_bytes": peak_device_bytes(device),
          "startup": startup, "seq": args.seq, "save_on_cpu": args.save_on_cpu,
          "grad_digest": grad_digest(model) if args.grad_digest else None,
          "spill": spill_stats(),
          "allocator": allocator_summary(device, stats_at_warmup, timed_steps)})


if __name__ == "__main__":
    main()

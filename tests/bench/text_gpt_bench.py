#!/usr/bin/env python3
"""The GPT job (deploy/jobs/text-gpt.json) in Leasehold's engine against the
same model in PyTorch, side by side in one run, on one GPU.

Leasehold: a coordinator (cuda backend) and `leasehold-agent --run-job` on
the job file, with its steps and corpus as given here (variants leasehold
and leasehold-bf16 run every step as one CUDA graph; with -op-by-op after
the name, --no-cuda-graphs; with -heuristic-gemm, --gemm-choice heuristic
(the products' algorithms not measured, kernels/matmul.h); with @SIZE,
e.g. leasehold-bf16@800MiB, the job's memory_budget, past which its
blocks recompute and its activations spill to the agent's host tier of
--spill-host-bytes; @50% is half the peak memory of the same variant
without a budget, listed before it).
PyTorch: the same
model (GPT-2's pre-norm blocks, tied output, no attention dropout), data
(the corpus cut into samples of `context` tokens at a stride of `context`,
the last 10% held out), optimiser (AdamW on matrices only, cosine schedule,
clipping) in the configurations asked for: fp32 eager, bf16 autocast eager
with scaled_dot_product_attention (bf16), the latter under torch.compile
(compile) and with its CUDA graphs (compile-graphs: mode reduce-overhead),
and the whole bf16 step captured as one CUDA graph (graph: capturable fused
AdamW, the learning rate a device tensor).

Each prints tokens/s over the steps after --warmup (Leasehold: its progress
reports after the first epoch's) and the validation loss at the end. JSON
on stdout, a table on stderr.

  python3 tests/bench/text_gpt_bench.py --bin BUILD/bin --steps 300 \\
      [--corpus-dir /usr/share/games/fortunes] [--variants fp32,bf16,compile] [--seeds 1,2,3]
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", required=True, help="folder with leasehold-coordinator and leasehold-agent")
    p.add_argument("--job", default=os.path.join(ROOT, "deploy/jobs/text-gpt.json"))
    p.add_argument("--corpus-dir", help="read the job's files from this folder instead (same names)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30, help="PyTorch steps left out of its rate")
    p.add_argument("--variants", default="leasehold,leasehold-bf16,fp32,bf16,compile")
    p.add_argument("--pool-size", default="16GiB")
    p.add_argument("--spill-host-bytes", default="4GiB",
                   help="the agent's pinned host tier, where a job past its memory budget "
                        "spills and keeps the blocks' inputs and the optimizer's state it "
                        "plans there (the agent's own default, 256 MiB, sends more spills "
                        "to the spill file and may not hold what the GPT plans at 25%%)")
    p.add_argument("--agent-log-level", default="info",
                   help="the agent's --log-level; at debug its lines on the step's CUDA graph "
                        "include what is live at the traced step's peak")
    p.add_argument("--seeds", default="1",
                   help="comma-separated: every variant runs once per seed (initialisation, "
                        "data order, dropout), and the table gives each one's losses")
    return p.parse_args(argv)


def load_job(args):
    with open(args.job) as f:
        job = json.load(f)
    files = job["dataset"]["files"]
    if args.corpus_dir:
        files = [os.path.join(args.corpus_dir, os.path.basename(f)) for f in files]
    job["dataset"]["files"] = files
    job["steps"] = args.steps
    job.pop("epochs", None)
    job["checkpoint"] = {"enabled": False}
    job["device"] = "cuda"
    job["seed"] = args.seed
    return job


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def to_bytes(text):
    """'2.51 GiB' -> bytes; 0 for anything else."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?) (B|[KMGT]iB)", text.strip())
    return int(float(m.group(1)) * UNITS[m.group(2)]) if m else 0


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- Leasehold ----

def run_leasehold(args, job, precision="Float32", graphs=True, gemm_choice="measured"):
    job = dict(job, precision=precision)
    tmp = tempfile.mkdtemp(prefix="text-gpt-bench-")
    path = os.path.join(tmp, "job.json")
    with open(path, "w") as f:
        json.dump(job, f)
    endpoint = "ipc://" + os.path.join(tmp, "coord.sock")
    coord = subprocess.Popen(
        [os.path.join(args.bin, "leasehold-coordinator"), "--backend", "cuda", "--pool-size",
         args.pool_size, "--endpoint", endpoint, "--state-dir", os.path.join(tmp, "state")],
        stdout=open(os.path.join(tmp, "coord.log"), "w"), stderr=subprocess.STDOUT)
    try:
        time.sleep(2)
        t0 = time.time()
        out = subprocess.run(
            [os.path.join(args.bin, "leasehold-agent"), "--endpoint", endpoint, "--run-job", path,
             "--spill-host-bytes", args.spill_host_bytes, "--log-level", args.agent_log_level,
             "--gemm-choice", gemm_choice]
            + ([] if graphs else ["--no-cuda-graphs"]),
            capture_output=True, text=True, timeout=3600)
        wall = time.time() - t0
    finally:
        coord.terminate()
        coord.wait()
    text = out.stdout
    for line in out.stderr.splitlines():  # whether its steps ran as CUDA graphs, and why not
        if any(w in line for w in ("CUDA graph", "op by op", "spill", "recompute", "evictions", "the peak")):
            log("  agent: " + line)
    if out.returncode != 0:
        raise RuntimeError("leasehold run failed:\n" + text[-3000:] + out.stderr[-3000:])
    rates, losses = [], []
    for line in text.splitlines():
        m = re.match(r"progress epoch=(\d+)/\d+ .*samples_per_s=(\d+)", line)
        if m and int(m.group(1)) > 1:
            rates.append(float(m.group(2)))
        m = re.search(r"validation_loss=([\d.]+)", line)
        if m:
            losses.append(float(m.group(1)))
    m = re.search(r"result .*samples_per_s=(\d+)", text)
    overall = float(m.group(1)) if m else 0.0
    memory = dict(re.findall(r"(peak_memory|spilled|restored)=(\d+(?:\.\d+)? (?:B|[KMGTPE]iB))", text))
    memory.update(re.findall(r"(recomputed_mlps|recomputed_blocks_but_attention|recomputed_blocks|recomputed_halves|recomputed_blocks_in_halves|optimizer_state_on_host|optimizer_state_host_bytes|offloaded_blocks|mlp_slices|sliced_mlps)=(\d+)", text))
    if memory:
        log("  agent: memory " + ", ".join(f"{k} {v}" for k, v in memory.items()))
    rates.sort()
    steady = rates[len(rates) // 2] if rates else overall
    return {"tokens_per_s": steady, "tokens_per_s_whole_run": overall,
            "validation_loss": losses[-1] if losses else None, "validation_losses": losses,
            "wall_s": wall, "memory": memory}


# ---- PyTorch ----

def torch_model(torch, job):
    nn = torch.nn
    F = torch.nn.functional
    layers = job["model"]
    emb = layers[0]
    blocks = [l for l in layers if l["type"] == "TransformerBlock"]
    vocab, dim, context = emb["in"], emb["out"], emb.get("context", 0)
    heads = blocks[0]["heads"]
    p = blocks[0].get("dropout", 0.0)
    first_dropout = next((l.get("p", 0.5) for l in layers if l["type"] == "Dropout"), 0.0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(p)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
            return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.zeros(context, dim))
            self.drop = nn.Dropout(first_dropout)
            self.blocks = nn.ModuleList([Block() for _ in blocks])
            self.ln = nn.LayerNorm(dim)
            for name, prm in self.named_parameters():
                if prm.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * len(blocks)) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                    nn.init.normal_(prm, 0.0, std)
                elif "ln" not in name:
                    nn.init.zeros_(prm)

        def forward(self, idx):
            x = self.drop(self.tok(idx) + self.pos[: idx.shape[1]])
            for blk in self.blocks:
                x = blk(x)
            return F.linear(self.ln(x), self.tok.weight)

    return GPT()


def run_torch(args, job, variant):
    import torch
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    data = b"".join(open(f, "rb").read() for f in job["dataset"]["files"])
    held = int(len(data) * job["dataset"].get("validation_fraction", 0.1))
    context = job["dataset"]["context"]

    def windows(buf):
        n = (len(buf) - 1) // context
        t = torch.frombuffer(bytearray(buf[: n * context + 1]), dtype=torch.uint8).long()
        x = t[: n * context].view(n, context)
        y = t[1: n * context + 1].view(n, context)
        return x.to(dev), y.to(dev)

    xtr, ytr = windows(data[: len(data) - held])
    xva, yva = windows(data[len(data) - held:])
    model = torch_model(torch, job).to(dev)
    o = job["optimizer"]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    # graph: the whole step (forward, backward, clipping, AdamW) replayed as
    # one CUDA graph, the learning rate a device tensor set before each replay.
    whole_graph = variant == "graph"
    lr_arg = torch.tensor(o["lr"], device=dev) if whole_graph else o["lr"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.get("weight_decay", 0)},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=lr_arg, betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
                            eps=o.get("eps", 1e-8), fused=True, capturable=whole_graph)
    total, warm = job["steps"], o.get("warmup_steps", 0)
    lr, min_lr = o["lr"], o.get("min_lr", 0.0)

    def lr_at(step):
        if step < warm:
            return lr * (step + 1) / warm
        if step >= total:
            return min_lr
        r = (step - warm) / max(1, total - warm)
        return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (lr - min_lr)

    bf16 = variant in ("bf16", "compile", "compile-graphs", "graph")

    def step_fn(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("clip_grad_norm", 0) or 1e9)
        return loss

    if variant == "compile":
        fn = torch.compile(step_fn)
    elif variant == "compile-graphs":  # torch.compile's own CUDA graphs (cudagraph trees)
        fn = torch.compile(step_fn, mode="reduce-overhead")
    else:
        fn = step_fn
    batch = job["batch_size"]
    graph = None
    if whole_graph:
        static_x = xtr[:batch].clone()
        static_y = ytr[:batch].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up as PyTorch's capture recipe asks (not timed)
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                step_fn(static_x, static_y)
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            step_fn(static_x, static_y)
            opt.step()
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    order = torch.randperm(xtr.shape[0], generator=g)
    pos = 0
    t_start = None
    for step in range(total):
        if pos + batch > order.numel():
            order = torch.randperm(xtr.shape[0], generator=g)
            pos = 0
        idx = order[pos: pos + batch].to(dev)
        pos += batch
        if step == args.warmup:
            torch.cuda.synchronize()
            t_start = time.time()
        if graph is not None:
            lr_arg.fill_(lr_at(step))
            static_x.copy_(xtr[idx])
            static_y.copy_(ytr[idx])
            graph.replay()
            continue
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        fn(xtr[idx], ytr[idx])
        opt.step()
    torch.cuda.synchronize()
    secs = time.time() - t_start
    tokens = (total - args.warmup) * batch * context
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        s, n = 0.0, 0
        for i in range(0, xva.shape[0], 16):
            logits = model(xva[i: i + 16]).float()
            s += torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), yva[i: i + 16].reshape(-1), reduction="sum").item()
            n += yva[i: i + 16].numel()
    return {"tokens_per_s": tokens / secs, "validation_loss": s / n,
            "peak_memory_bytes": torch.cuda.max_memory_allocated()}


def main(argv=None):
    args = parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    args.seed = seeds[0]
    job = load_job(args)
    out = {"steps": args.steps, "seeds": args.seeds, "batch_size": job["batch_size"], "context": job["dataset"]["context"],
           "runs": {}}
    try:
        import torch
        out["gpu"] = torch.cuda.get_device_name(0)
        out["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - the Leasehold run needs no PyTorch
        pass
    for seed in seeds:
        args.seed = seed
        job = load_job(args)
        for v in args.variants.split(","):
            log(f"text_gpt_bench: {v}, seed {seed} ...")
            if v.startswith("leasehold"):
                # leasehold[-bf16][-heuristic-gemm][-op-by-op][@BUDGET]: the products'
                # algorithms cuBLASLt's heuristic's first rather than measured; every
                # step one CUDA graph, or op by op; the job's memory budget, a size or a
                # percentage of the peak memory of the same run without one (listed
                # before it).
                name, _, budget = v.partition("@")
                if budget.endswith("%"):
                    base = out["runs"].get(name, [{}])[-1]
                    peak = to_bytes(base.get("memory", {}).get("peak_memory", ""))
                    if not peak:
                        raise SystemExit(f"variant {v}: run {name} without a budget first "
                                         "(its peak memory is the 100%)")
                    budget = f"{int(peak * float(budget[:-1]) / 100) >> 20}MiB"
                try:
                    r = run_leasehold(args, dict(job, memory_budget=budget) if budget else job,
                                      "BFloat16" if "-bf16" in name else "Float32",
                                      graphs=not name.endswith("-op-by-op"),
                                      gemm_choice="heuristic" if "-heuristic-gemm" in name
                                      else "measured")
                except RuntimeError as e:
                    # A budget the job cannot train in is a result (the job's own
                    # error says why), not the end of the benchmark.
                    failed = re.search(r"result job=\S+ failed: (.*)", str(e))
                    if not budget or not failed:
                        raise
                    r = {"tokens_per_s": 0.0, "validation_loss": None, "failed": failed.group(1)}
                    log(f"text_gpt_bench: {v}: the job failed: {failed.group(1)}")
            else:
                r = run_torch(args, job, v)
            r["seed"] = seed
            if v.startswith("leasehold") and budget:
                r["memory_budget"] = budget
            out["runs"].setdefault(v, []).append(r)
            log(f"text_gpt_bench: {v}, seed {seed}: {r['tokens_per_s']:.0f} tokens/s, "
                f"validation loss {r['validation_loss']}")
    names = {"leasehold": "Leasehold engine (fp32)",
             "leasehold-bf16": "Leasehold engine (bf16 autocast)",
             "leasehold-op-by-op": "Leasehold engine (fp32), steps op by op",
             "leasehold-bf16-op-by-op": "Leasehold engine (bf16 autocast), steps op by op",
             "leasehold-bf16-heuristic-gemm":
                 "Leasehold engine (bf16 autocast), cuBLASLt's heuristic's first algorithms",
             "fp32": "PyTorch eager fp32",
             "bf16": "PyTorch eager bf16 autocast + SDPA", "compile": "PyTorch torch.compile bf16",
             "compile-graphs": "PyTorch torch.compile bf16, mode reduce-overhead (CUDA graphs)",
             "graph": "PyTorch eager bf16, whole step as one CUDA graph"}
    # Tokens/s: the median over the seeds; losses: each seed's, and their mean.
    log("| run | tokens/s | validation loss (mean) | per seed " + ", ".join(map(str, seeds)) + " |")
    log("| --- | ---: | ---: | --- |")
    for v, rs in out["runs"].items():
        base, _, budget = v.partition("@")
        label = names.get(base, base)
        if budget:
            label += f", memory budget {budget}"
            if budget.endswith("%"):
                label += f" of its peak ({rs[0]['memory_budget']})"
        if any("failed" in r for r in rs):
            log(f"| {label} | fails: {rs[0].get('failed', '')} | — | — |")
            continue
        rates = sorted(r["tokens_per_s"] for r in rs)
        losses = [r["validation_loss"] for r in rs]
        mean = sum(losses) / len(losses) if all(losses) else None
        log(f"| {label} | {rates[len(rates) // 2]:.0f} | "
            + (f"{mean:.4f} | " + ", ".join(f"{x:.4f}" for x in losses) if mean else "— | —")
            + " |")
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

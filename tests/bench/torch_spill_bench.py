"""Spilling a PyTorch job's activations past its budget, side by side in one
run with PyTorch's own offload.

  python3 tests/bench/torch_spill_bench.py --bin BUNDLE/bin \\
      --python-dir BUNDLE/share/leasehold/python \\
      --torch-plugin PATH/libleasehold_torch.so \\
      [--batch 32] [--seq 1024] [--steps 30] [--fractions 0.5,0.25]

One coordinator and one agent (CUDA pool, MPS off). The workload is
tests/torch/train.py --model gpt2-small (GPT-2 small's shape built from a
config by transformers, bf16 autocast), with a batch and sequence length
that make activations most of its peak. It runs:

- pytorch: plainly (PyTorch's caching allocator), unconstrained;
- save_on_cpu: plainly, the forward inside
  torch.autograd.graph.save_on_cpu(pin_memory=True), PyTorch's offload;
- leasehold: as a program job with a budget the size of the pool
  (unconstrained), with and without the spilling hooks (what recording
  the saved tensors costs), then at each fraction of that run's peak leased bytes,
  where the plug-in's spilling (leasehold.torch.spill) keeps it within,
  and at save_on_cpu's peak (equal peak memory: the comparison that counts).

The host link's bandwidth (pinned memory, 1 GiB copies each way, outside
Leasehold) is measured first; each spilling row shows the seconds per step
its traffic alone takes over that link (bytes spilled / device-to-host +
bytes restored / host-to-device). Spilling overlaps those copies with
compute, so 1 / max(that, an unconstrained step) bounds its steps/s.

Steps/s after the warm-up, peak device memory (PyTorch's max reserved; the
plug-in's peak leased) and the bytes spilled per step. Then the gradients:
the digest of the last step's gradients (deterministic kernels) of
LeNet and of the GPT, unconstrained and spilled (the GPT at the smallest
fraction; LeNet at a budget of its peak, spilling past --lenet-high-water
of it), must be equal (spilling is exact). The plug-in's refused
allocations are counted beside them: a refused workspace makes cuDNN or
cuBLAS take another kernel, which rounds differently.
Prints one JSON object on stdout, a table on stderr; exit status 1 when a
run fails or a digest differs.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_program_bench as tpb  # noqa: E402

TRAIN = os.path.join(tpb.REPO, "tests", "torch", "train.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", required=True)
    p.add_argument("--python-dir", required=True)
    p.add_argument("--torch-plugin", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--fractions", default="0.5,0.25")
    p.add_argument("--lenet-high-water", type=float, default=0.5,
                   help="LeNet's gradient check (batch 1024) runs with a budget of its peak and "
                        "spills past this fraction of it: below its peak, cuDNN's preferred "
                        "convolution's workspace is refused and cuDNN takes another "
                        "algorithm, which rounds differently (PyTorch's own allocator under a "
                        "memory limit does the same)")
    p.add_argument("--variants", default="",
                   help="extra runs at the smallest budget with options of "
                        "leasehold.torch.spill: 'lookahead=6;high_water=0.9,lookahead=4'")
    p.add_argument("--gradient-options", default="",
                   help="options of leasehold.torch.spill for the gradient check's runs: "
                        "'overlap=0,lookahead=4'")
    p.add_argument("--variants-at", choices=("smallest", "all"), default="smallest",
                   help="the budgets the variants run at")
    p.add_argument("--pool-size", default="30GiB")
    p.add_argument("--digest-models", default="lenet,gpt2-small",
                   help="the models whose gradients are compared")
    p.add_argument("--parts", default="runs,gradients",
                   help="runs (the speed table), gradients (the digests), or both")
    p.add_argument("--run-timeout", type=float, default=600)
    args = p.parse_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    args.variants = [v.split(",") for v in args.variants.split(";") if v]
    if not args.fractions:
        p.error("--fractions: at least one")
    unknown = set(args.digest_models.split(",")) - {"lenet", "gpt2-small"}
    if unknown:
        p.error("--digest-models: unknown %s (lenet, gpt2-small)" % ", ".join(sorted(unknown)))
    args.parts = set(args.parts.split(","))
    if not args.parts or not args.parts <= {"runs", "gradients"}:
        p.error("--parts: runs, gradients or both")
    args.bin = os.path.abspath(args.bin)
    args.python_dir = os.path.abspath(args.python_dir)
    args.torch_plugin = os.path.abspath(args.torch_plugin)
    return args


def gpt_args(args, extra=()):
    return [sys.executable, TRAIN, "--model", "gpt2-small", "--amp", "--batch", str(args.batch),
            "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--log-every", "1000"] + list(extra)


def spill_options(options):
    """train.py's arguments for options of leasehold.torch.spill ("NAME=VALUE")."""
    return ["--spill-option=" + o for o in options if o]


def digest_args(model, extra=()):
    base = [sys.executable, TRAIN, "--model", model, "--steps", "4", "--warmup", "1",
            "--log-every", "1000", "--deterministic", "--grad-digest"]
    return base + list(extra)


def plain(args, env, cmd, what):
    output, _ = tpb.run_streamed(cmd, env, args.run_timeout, what)
    return tpb.summary_of(output, what)


def in_leasehold(args, env, cmd, budget, what):
    run = [os.path.join(args.bin, "leasehold"), "run", "--budget", str(budget), "--name",
           "spill-bench", "--"] + cmd
    output, _ = tpb.run_streamed(run, env, args.run_timeout, what)
    s = tpb.summary_of(output, what)
    if s["allocator"].get("name") != "leasehold":
        raise tpb.BenchError("%s did not run on the plug-in" % what, tpb.tail(output))
    return s


LINK_CODE = """
import json, torch
n = 1 << 30
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
def rate(dst, src):
    dst.copy_(src, non_blocking=True)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return 4 * n / (start.elapsed_time(end) / 1e3)
print(json.dumps({"d2h_bytes_per_s": rate(host, dev), "h2d_bytes_per_s": rate(dev, host)}))
"""


def link_bandwidth():
    """Pinned copies' bytes/s each way over the GPU's host link, from a
    child (this process never initializes CUDA)."""
    r = subprocess.run([sys.executable, "-c", LINK_CODE], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    if r.returncode != 0:
        raise tpb.BenchError("cannot measure the host link", tpb.tail(r.stdout))
    return json.loads(r.stdout.strip().splitlines()[-1])


def row(s, steps, link=None):
    """A run's figures; with `link`, the seconds per step its spilling
    traffic alone takes over the host link. Per step: the counts are the
    whole run's, warm-up included, over all its steps."""
    spill = s.get("spill") or {}
    out = {"steps_per_second": s["steps_per_second"], "peak_device_bytes": s["peak_device_bytes"],
           "peak_in_use_bytes": (s.get("allocator") or {}).get("peak_in_use_bytes"),
           "spilled_bytes_per_step": spill.get("spilled_bytes", 0) / max(1, steps),
           "restored_bytes_per_step": spill.get("restored_bytes", 0) / max(1, steps),
           "spill": spill or None, "final_loss": s["final_loss"]}
    alloc = s.get("allocator") or {}
    if alloc.get("name") == "leasehold":
        # How often the cache went to its lease source once warm: segments
        # leased (each one or more leases) and times it unbacked free pages.
        out["lease_requests_per_step"] = alloc.get("lease_requests_per_step")
        out["unbacks"] = alloc.get("unbacks")
    if link:
        out["link_seconds_per_step"] = (out["spilled_bytes_per_step"] / link["d2h_bytes_per_s"]
                                        + out["restored_bytes_per_step"] / link["h2d_bytes_per_s"])
    return out


def main(argv=None):
    args = parse_args(argv)
    return tpb.run_bench("torch_spill_bench", "lh-spill-bench-",
                         lambda env, tmp, daemons: bench(args, env, tmp, daemons))


def bench(args, env, tmp, daemons):
    """The runs and the gradient check; the exit status."""
    failed = []
    info = tpb.device_info()
    link = link_bandwidth() if "runs" in args.parts else None
    _, agent = tpb.start_leasehold(args, env, tmp, daemons)
    tpb.wait_for("the agent", lambda: tpb.agent_registered(args, env, "bench"), agent, 60)
    steps = args.steps
    rows = {}
    log = lambda m: print("torch_spill_bench: " + m, file=sys.stderr, flush=True)  # noqa
    def done(name, r):  # each row as it comes: a later failure keeps the earlier ones
        rows[name] = r
        log("%s: %s" % (name, json.dumps(r)))

    if "runs" in args.parts:
        log("pytorch")
        done("pytorch", row(plain(args, env, gpt_args(args), "pytorch"), steps))
        log("save_on_cpu")
        offload = row(plain(args, env, gpt_args(args, ["--save-on-cpu"]), "save_on_cpu"),
                      steps)
        done("save_on_cpu", offload)
        log("leasehold unconstrained")
        full = in_leasehold(args, env, gpt_args(args), args.pool_size,
                            "leasehold unconstrained")
        done("leasehold 100%", row(full, steps))
        log("leasehold unconstrained, spilling off")
        done("leasehold 100%, no hooks", row(in_leasehold(
            args, env, gpt_args(args, ["--no-spill"]), args.pool_size,
            "leasehold unconstrained without spilling"), steps))
        peak = full["peak_device_bytes"]
        budgets = [("leasehold %d%%" % (100 * f), int(peak * f)) for f in args.fractions]
        if offload["peak_device_bytes"]:  # None where PyTorch could not say
            budgets.append(("leasehold at save_on_cpu's", offload["peak_device_bytes"]))
        at = list(budgets)
        if args.variants_at == "smallest":
            at = [min(budgets, key=lambda b: b[1])]
        for label, budget in at:
            for options in args.variants:
                budgets.append(("%s %s" % (label, ",".join(options)), budget, options))
        for name, budget, *options in budgets:
            extra = spill_options(options[0] if options else [])
            log("%s (%d bytes)" % (name, budget))
            done(name, dict(row(in_leasehold(args, env, gpt_args(args, extra), budget, name),
                                steps, link), budget_bytes=budget))
    # Gradients, spilled or not: bit for bit.
    digests = {}
    if "gradients" in args.parts:
        smallest = min(args.fractions)
        for model, extra, fraction in (
                ("lenet", ["--batch", "1024",
                           "--spill-option=high_water=%g" % args.lenet_high_water], 1.0),
                ("gpt2-small", ["--amp", "--seq", str(args.seq), "--batch", str(args.batch)],
                 smallest)):
            if model not in args.digest_models.split(","):
                continue
            log("gradients of %s" % model)
            cmd = digest_args(model, extra + spill_options(args.gradient_options.split(",")))
            whole = in_leasehold(args, env, cmd, args.pool_size, model + " unconstrained")
            # Twice: a digest that differs between two plain runs would
            # make the comparison meaningless (a nondeterministic kernel).
            again = in_leasehold(args, env, cmd, args.pool_size, model + " unconstrained")
            budget = int(whole["peak_device_bytes"] * fraction)
            tight = in_leasehold(args, env, cmd, budget, model + " spilled")
            refused = (tight.get("allocator") or {}).get("refused_allocations", 0)
            digests[model] = {"unconstrained": whole["grad_digest"],
                              "unconstrained_again": again["grad_digest"],
                              "spilled": tight["grad_digest"], "budget_bytes": budget,
                              "spilled_bytes": (tight.get("spill") or {}).get("spilled_bytes"),
                              "refused_allocations": refused}
            if whole["grad_digest"] != again["grad_digest"]:
                failed.append("%s: two unconstrained runs' gradients differ" % model)
            if whole["grad_digest"] != tight["grad_digest"]:
                # A refused allocation makes cuDNN or cuBLAS take a kernel
                # with a smaller workspace, which rounds differently.
                failed.append("%s: gradients differ with spilling%s" % (
                    model, " (%d allocations refused at %d bytes: a kernel with less "
                    "workspace was chosen)" % (refused, budget)
                    if refused else ""))
            if not (tight.get("spill") or {}).get("spilled_bytes"):
                failed.append("%s: nothing was spilled at %d bytes" % (model, budget))
    result = {"device": info["device"], "torch": info["torch"], "batch": args.batch,
              "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "link": link,
              "runs": rows, "gradients": digests, "failed": failed}
    print(json.dumps(result, indent=1), flush=True)
    base = rows["leasehold 100%"]["steps_per_second"] if rows else 1
    gib = 1 << 30
    if link:
        print("\nhost link: %.1f GB/s device to host, %.1f GB/s host to device" % (
            link["d2h_bytes_per_s"] / 1e9, link["h2d_bytes_per_s"] / 1e9), file=sys.stderr)
    print("\n%-28s %8s %8s %9s %10s %10s %9s" % (
        "run", "steps/s", "vs 100%", "peak GiB", "out GiB/st", "in GiB/st", "link s/st"),
        file=sys.stderr)
    for name, r in rows.items():
        linked = r.get("link_seconds_per_step")
        print("%-28s %8.2f %7.0f%% %9.2f %10.2f %10.2f %9s" % (
            name, r["steps_per_second"], 100 * r["steps_per_second"] / base,
            (r["peak_device_bytes"] or 0) / gib, r["spilled_bytes_per_step"] / gib,
            r["restored_bytes_per_step"] / gib,
            "%.3f" % linked if linked is not None else "-"), file=sys.stderr)
    for model, d in digests.items():
        print("gradients %s: %s unconstrained (%s again), %s spilled (%s)" % (
            model, d["unconstrained"], d["unconstrained_again"], d["spilled"],
            "equal" if d["unconstrained"] == d["spilled"] else "DIFFERENT"), file=sys.stderr)
    print("targets: >= 90% at 50%, >= 75% at 25%; faster than save_on_cpu at its peak",
          file=sys.stderr)
    if failed:
        print("torch_spill_bench: FAILED: %s" % "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
  where the plug-in's spilling (leasehold.torch.spill) keeps it within.

Steps/s after the warm-up, peak device memory (PyTorch's max reserved; the
plug-in's peak leased) and the bytes spilled per step. Then the gradients:
the digest of the last step's gradients (deterministic kernels) of
LeNet and of the GPT, unconstrained and spilled (the GPT at the smallest
fraction, LeNet at --lenet-fraction), must be equal (spilling is exact).
Prints one JSON object on stdout, a table on stderr; exit status 1 when a
run fails or a digest differs.
"""

import argparse
import json
import os
import shutil
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
    p.add_argument("--lenet-fraction", type=float, default=0.85,
                   help="LeNet's budget for the gradient check (batch 1024), a fraction of its "
                        "peak: at 70%% its backward (restored tensors, gradients, cuBLAS's "
                        "deterministic 32 MiB workspaces) did not fit")
    p.add_argument("--pool-size", default="30GiB")
    p.add_argument("--digest-models", default="lenet,gpt2-small",
                   help="the models whose gradients are compared")
    p.add_argument("--parts", default="runs,gradients",
                   help="runs (the speed table), gradients (the digests), or both")
    p.add_argument("--run-timeout", type=float, default=600)
    args = p.parse_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
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


def row(s, steps):
    spill = s.get("spill") or {}
    timed = max(1, steps)
    return {"steps_per_second": s["steps_per_second"], "peak_device_bytes": s["peak_device_bytes"],
            "peak_in_use_bytes": (s.get("allocator") or {}).get("peak_in_use_bytes"),
            "spilled_bytes_per_step": spill.get("spilled_bytes", 0) / timed if spill else 0,
            "spill": spill or None, "final_loss": s["final_loss"]}


def main(argv=None):
    args = parse_args(argv)
    env, tmp = tpb.bench_environment("lh-spill-bench-")
    daemons = []
    failed = []
    try:
        info = tpb.device_info()
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
            done("save_on_cpu", row(plain(args, env, gpt_args(args, ["--save-on-cpu"]),
                                          "save_on_cpu"), steps))
            log("leasehold unconstrained")
            full = in_leasehold(args, env, gpt_args(args), args.pool_size, "leasehold unconstrained")
            done("leasehold 100%", row(full, steps))
            log("leasehold unconstrained, spilling off")
            done("leasehold 100%, no hooks", row(in_leasehold(
                args, env, gpt_args(args, ["--no-spill"]), args.pool_size,
                "leasehold unconstrained without spilling"), steps))
            peak = full["peak_device_bytes"]
            for f in args.fractions:
                budget = int(peak * f)
                log("leasehold at %d%% (%d bytes)" % (100 * f, budget))
                done("leasehold %d%%" % (100 * f), dict(
                    row(in_leasehold(args, env, gpt_args(args), budget, "leasehold %g" % f), steps),
                    budget_bytes=budget))
        # Gradients, spilled or not: bit for bit.
        digests = {}
        if "gradients" in args.parts:
            smallest = min(args.fractions)
            for model, extra, fraction in (
                    ("lenet", ["--batch", "1024"], args.lenet_fraction),
                    ("gpt2-small", ["--amp", "--seq", str(args.seq), "--batch", str(args.batch)],
                     smallest)):
                if model not in args.digest_models.split(","):
                    continue
                log("gradients of %s" % model)
                cmd = digest_args(model, extra)
                whole = in_leasehold(args, env, cmd, args.pool_size, model + " unconstrained")
                # Twice: a digest that differs between two plain runs would
                # make the comparison meaningless (a nondeterministic kernel).
                again = in_leasehold(args, env, cmd, args.pool_size, model + " unconstrained")
                budget = int(whole["peak_device_bytes"] * fraction)
                tight = in_leasehold(args, env, cmd, budget, model + " spilled")
                digests[model] = {"unconstrained": whole["grad_digest"],
                                  "unconstrained_again": again["grad_digest"],
                                  "spilled": tight["grad_digest"], "budget_bytes": budget,
                                  "spilled_bytes": (tight.get("spill") or {}).get("spilled_bytes")}
                if whole["grad_digest"] != again["grad_digest"]:
                    failed.append("%s: two unconstrained runs' gradients differ" % model)
                if whole["grad_digest"] != tight["grad_digest"]:
                    failed.append("%s: gradients differ with spilling" % model)
                if not (tight.get("spill") or {}).get("spilled_bytes"):
                    failed.append("%s: nothing was spilled at %d bytes" % (model, budget))
        result = {"device": info["device"], "torch": info["torch"], "batch": args.batch,
                  "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "runs": rows,
                  "gradients": digests, "failed": failed}
        print(json.dumps(result, indent=1), flush=True)
        base = rows["leasehold 100%"]["steps_per_second"] if rows else 1
        gib = 1 << 30
        print("\n%-26s %9s %9s %10s %14s" % ("run", "steps/s", "vs 100%", "peak GiB",
                                              "spilled GiB/step"), file=sys.stderr)
        for name, r in rows.items():
            print("%-26s %9.2f %8.0f%% %10.2f %14.2f" % (
                name, r["steps_per_second"], 100 * r["steps_per_second"] / base,
                (r["peak_device_bytes"] or 0) / gib, r["spilled_bytes_per_step"] / gib),
                file=sys.stderr)
        for model, d in digests.items():
            print("gradients %s: %s unconstrained (%s again), %s spilled (%s)" % (
                model, d["unconstrained"], d["unconstrained_again"], d["spilled"],
                "equal" if d["unconstrained"] == d["spilled"] else "DIFFERENT"), file=sys.stderr)
        print("targets: >= 90%% at 50%%, >= 75%% at 25%%; faster than save_on_cpu at its peak",
              file=sys.stderr)
    except tpb.BenchError as e:
        if e.output:
            print(e.output, file=sys.stderr)
        print("torch_spill_bench: FAILED: %s" % e, file=sys.stderr)
        return 1
    except subprocess.TimeoutExpired as e:
        print("torch_spill_bench: FAILED: %s" % e, file=sys.stderr)
        return 1
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        print("torch_spill_bench: FAILED: %s" % "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A PyTorch program job grown past its guaranteed share is shrunk for
another job's guarantee: what it gives back, how, and how long the other
waits.

  python3 tests/bench/torch_shrink_bench.py --bin BUNDLE/bin \\
      --python-dir BUNDLE/share/leasehold/python \\
      --torch-plugin PATH/libleasehold_torch.so \\
      [--pool-size 4608MiB] [--grower-steps 1500]

One coordinator (CUDA pool, MPS off, the occupancy policy) and two agents.
The grower, `tests/torch/train.py --model gpt2 --amp --batch 16 --seq 512`
with memory_min 1.5 GiB and memory_budget 4 GiB, runs alone until step 20
(its peak is about 3.45 GiB, past its share); then the needy job, the same
model for 100 steps with 2.5 GiB guaranteed (memory_min = memory_budget),
is submitted. The pool holds both guarantees but not the grower's growth, so
the coordinator asks the grower to Shrink: the plug-in gives back free
cached memory, then spills saved activations (python/leasehold/spill.py).
Printed: per job its state, Shrinks answered and bytes given back, bytes
spilled and restored, peak, time waiting for memory, and the grower's
spill statistics; JSON on stdout, a summary on stderr.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_program_bench as tpb  # noqa: E402  (its daemons, CLI and errors)

TERMINAL = ("succeeded", "failed", "cancelled")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--bin", required=True, help="folder of leasehold, leasehold-coordinator, "
                   "leasehold-agent")
    p.add_argument("--python-dir", required=True,
                   help="folder of Leasehold's Python package (leasehold/, leasehold_site/)")
    p.add_argument("--torch-plugin", required=True, help="path of libleasehold_torch.so")
    p.add_argument("--pool-size", default="4608MiB", help="the coordinator's pool")
    p.add_argument("--grower-steps", type=int, default=1500,
                   help="the grower's steps: enough to still run when the needy job ends")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole scenario")
    args = p.parse_args(argv)
    if args.grower_steps <= 20:
        p.error("--grower-steps must be more than 20 (the needy job comes at step 20)")
    for name in ("leasehold", "leasehold-coordinator", "leasehold-agent"):
        if not os.access(os.path.join(args.bin, name), os.X_OK):
            p.error("--bin: %s has no executable %s" % (args.bin, name))
    args.bin = os.path.abspath(args.bin)
    args.python_dir = os.path.abspath(args.python_dir)
    args.torch_plugin = os.path.abspath(args.torch_plugin)
    return args


def job_spec(name, steps, memory_min, budget):
    return {"name": name, "memory_min": memory_min, "memory_budget": budget,
            "program": {"command": ["python3", "tests/torch/train.py", "--model", "gpt2",
                                    "--amp", "--batch", "16", "--seq", "512", "--steps",
                                    str(steps), "--warmup", "5", "--log-every", "10"],
                        "directory": tpb.REPO}}


def cli(args, env, *words):
    """`leasehold WORDS`: its output, or BenchError naming what failed."""
    try:
        r = tpb.leasehold_cli(args, env, *words)
    except subprocess.TimeoutExpired:
        raise tpb.BenchError("leasehold %s did not answer in 30 s" % " ".join(words))
    if r.returncode != 0:
        raise tpb.BenchError("leasehold %s failed" % " ".join(words), r.stdout + r.stderr)
    return r.stdout


def submit(args, env, tmp, spec):
    path = os.path.join(tmp, spec["name"] + ".json")
    with open(path, "w") as f:
        json.dump(spec, f)
    out = cli(args, env, "submit", path)
    try:
        return int(out.strip())
    except ValueError:
        raise tpb.BenchError("submitting %s printed no job id" % spec["name"], out)


def jobs(args, env, daemons):
    for d in daemons:  # a dead agent or coordinator fails now, not at the timeout
        d.check_alive()
    out = cli(args, env, "jobs", "-o", "json")
    try:
        return {j["id"]: j for j in json.loads(out)}
    except (ValueError, TypeError, KeyError):
        raise tpb.BenchError("leasehold jobs -o json printed no list of jobs", out)


def scenario(args, env, tmp, daemons):
    for agent in daemons[:2]:
        tpb.wait_for("the agent '%s'" % agent.name,
                     lambda n=agent.name: tpb.agent_registered(args, env, n), agent, 60)
    deadline = time.monotonic() + args.timeout
    grower = submit(args, env, tmp, job_spec("grower", args.grower_steps, "1536MiB", "4GiB"))
    while True:  # the grower at its peak, past its share
        j = jobs(args, env, daemons)[grower]
        if j["state"] in TERMINAL:
            raise tpb.BenchError("the grower ended %s before step 20: %s"
                                 % (j["state"], j.get("reason")))
        if j["progress"].get("step", 0) >= 20:
            break
        if time.monotonic() > deadline:
            raise tpb.BenchError("the grower did not reach step 20 in %gs" % args.timeout)
        time.sleep(0.2)
    needy = submit(args, env, tmp, job_spec("needy", 100, "2560MiB", "2560MiB"))
    while True:
        all_jobs = jobs(args, env, daemons)
        if all(all_jobs[i]["state"] in TERMINAL for i in (grower, needy)):
            break
        if time.monotonic() > deadline:
            raise tpb.BenchError("the jobs ran past %gs" % args.timeout)
        time.sleep(0.5)
    result = {}
    for name, i in (("grower", grower), ("needy", needy)):
        j = all_jobs[i]
        logs = cli(args, env, "logs", str(i))
        summaries = [o for o in tpb.json_lines(logs) if o.get("type") == "summary"]
        last = summaries[-1] if summaries else {}
        result[name] = {
            "state": j["state"], "reason": j.get("reason"), "shrinks": j.get("shrinks"),
            "shrunk_bytes": j.get("shrunk_bytes"), "memory_wait_ms": j.get("memory_wait_ms"),
            "spilled_bytes": j["progress"].get("spilled_bytes"),
            "restored_bytes": j["progress"].get("restored_bytes"),
            "peak_device_bytes": j["progress"].get("peak_device_bytes"),
            "steps_per_second": last.get("steps_per_second"), "spill": last.get("spill")}
        if j["state"] != "succeeded":
            raise tpb.BenchError("%s ended %s: %s" % (name, j["state"], j.get("reason")),
                                 tpb.tail(logs))
    # What the scenario is for: a miss here is a regression, not a figure.
    if not result["grower"]["shrinks"]:
        raise tpb.BenchError("the grower was never asked to Shrink (is the pool larger than "
                             "both jobs' peaks?)")
    if not result["grower"]["spilled_bytes"]:
        raise tpb.BenchError("the grower, shrunk, spilled nothing, or its progress lost the "
                             "figure")
    return result


def main(argv=None):
    args = parse_args(argv)
    return tpb.run_bench("torch_shrink_bench", "lh-shrink-bench-",
                         lambda env, tmp, daemons: bench(args, env, tmp, daemons))


def bench(args, env, tmp, daemons):
    """The daemons, the scenario and its report; the exit status."""
    info = tpb.device_info()
    coordinator = tpb.Daemon("coordinator", [
        os.path.join(args.bin, "leasehold-coordinator"), "--backend", "cuda", "--mps", "off",
        "--policy", "occupancy", "--pool-size", args.pool_size,
        "--state-dir", os.path.join(tmp, "state")], env, tmp)
    daemons.append(coordinator)
    tpb.wait_for("the coordinator", lambda: tpb.coordinator_up(args, env), coordinator, 30)
    for name in ("a1", "a2"):  # stopped before the coordinator
        daemons.insert(0, tpb.Daemon(name, [
            os.path.join(args.bin, "leasehold-agent"), "--name", name,
            "--python-dir", args.python_dir, "--torch-plugin", args.torch_plugin], env, tmp))
    result = scenario(args, env, tmp, daemons)
    result.update(device=info["device"], torch=info["torch"], pool=args.pool_size)
    print(json.dumps(result, indent=1), flush=True)
    mib = 1 << 20
    for name in ("grower", "needy"):
        r = result[name]
        print("%-6s %s: %s Shrinks, %.0f MiB given back, spilled %.1f GiB, peak %.0f MiB, "
              "waited %.1f s for memory, %.1f steps/s" % (
                  name, r["state"], r["shrinks"], (r["shrunk_bytes"] or 0) / mib,
                  (r["spilled_bytes"] or 0) / (1 << 30), (r["peak_device_bytes"] or 0) / mib,
                  (r["memory_wait_ms"] or 0) / 1e3, r["steps_per_second"] or 0),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

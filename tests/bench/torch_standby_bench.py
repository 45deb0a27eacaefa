"""Submit -> first report of PyTorch program jobs, cold and on warm Python
standbys, side by side in one run.

  python3 tests/bench/torch_standby_bench.py --bin BUNDLE/bin \\
      --python-dir BUNDLE/share/leasehold/python \\
      --torch-plugin PATH/libleasehold_torch.so \\
      [--modes cold,process,fork] [--workloads small,resnet18,gpt2] \\
      [--jobs 15] [--model-jobs 4] [--standbys 2] [--budget 4GiB]
      [--preload torchvision,transformers]

One coordinator (CUDA pool, MPS off); per mode one agent, started alone:
`cold` keeps no standbys (every job starts a new interpreter), `process`
and `fork` keep --standbys of them in that mode (agent/python_standby.h).
Jobs are submitted one at a time with `leasehold submit`; the figure is from
just before the client starts to the agent's time stamp of the job's first
`leasehold.report` (one host, one clock), so it includes the client's own
start and the coordinator's queue. Between warm jobs the benchmark waits
until every standby is ready again (the steady state of an agent that is
not swamped). Workloads:

- small: tests/bench/torch_small_job.py (an MLP built on the GPU, one
  training step, then its report);
- resnet18, gpt2: tests/torch/train.py --model M (its data and model built
  on the GPU, then its first step's report).

Prints one JSON object on stdout and a table on stderr: p50/p99 per mode and
workload, and each warm mode's speed-up over cold at the p50.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_program_bench as tpb  # noqa: E402  (its daemons, CLI and errors)

REPO = tpb.REPO
SMALL = os.path.join(HERE, "torch_small_job.py")
TERMINAL = ("succeeded", "failed", "cancelled")
MODES = ("cold", "process", "fork")
WORKLOADS = ("small", "resnet18", "gpt2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True)
    p.add_argument("--python-dir", required=True)
    p.add_argument("--torch-plugin", required=True)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--jobs", type=int, default=15, help="small jobs per mode")
    p.add_argument("--model-jobs", type=int, default=4, help="resnet18/gpt2 jobs per mode")
    p.add_argument("--standbys", type=int, default=2)
    p.add_argument("--preload", default="torchvision,transformers",
                   help="the standbys' --python-standby-preload ('' for none)")
    p.add_argument("--pool-size", default="16GiB")
    p.add_argument("--budget", default="4GiB")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if set(args.modes) - set(MODES) or set(args.workloads) - set(WORKLOADS):
        p.error("--modes from %s, --workloads from %s" % (MODES, WORKLOADS))
    for name in ("leasehold", "leasehold-coordinator", "leasehold-agent"):
        if not os.access(os.path.join(args.bin, name), os.X_OK):
            p.error("--bin: %s has no executable %s" % (args.bin, name))
    args.bin = os.path.abspath(args.bin)
    args.python_dir = os.path.abspath(args.python_dir)
    args.torch_plugin = os.path.abspath(args.torch_plugin)
    return args


def command(workload):
    if workload == "small":
        return [sys.executable, SMALL]
    return [sys.executable, os.path.join(REPO, "tests", "torch", "train.py"), "--model",
            workload, "--steps", "25", "--warmup", "5", "--log-every", "100"]


def log_count(path, text):
    try:
        with open(path, errors="replace") as f:
            return f.read().count(text)
    except OSError:
        return 0


def job_json(args, env, job_id):
    r = tpb.leasehold_cli(args, env, "job", str(job_id), "-o", "json")
    try:
        return json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        return None


def one_job(args, env, tmp, workload, agent, timeout=300):
    """(submit -> first report s, assigned -> first report s) of one job."""
    spec = {"name": "standby-" + workload, "memory_budget": args.budget,
            "program": {"command": command(workload), "directory": REPO}}
    path = os.path.join(tmp, "job.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    t0 = time.time()
    r = tpb.leasehold_cli(args, env, "submit", path)
    if r.returncode != 0:
        raise tpb.BenchError("submit failed", r.stdout + r.stderr)
    job_id = int(r.stdout.strip())
    deadline = time.monotonic() + timeout
    while True:
        agent.check_alive()
        job = job_json(args, env, job_id)
        if job and job.get("state") in TERMINAL:
            break
        if time.monotonic() > deadline:
            raise tpb.BenchError("job %d (%s) ran past %ds" % (job_id, workload, timeout),
                                 tpb.file_tail(agent.log))
        time.sleep(0.05)
    if job["state"] != "succeeded" or not job.get("first_step_at_us"):
        logs = tpb.leasehold_cli(args, env, "logs", str(job_id))
        raise tpb.BenchError("job %d (%s) ended %s without a report: %s"
                             % (job_id, workload, job["state"], job.get("reason")),
                             tpb.tail(logs.stdout) + "\n--- agent ---\n" + tpb.file_tail(agent.log))
    if workload != "small":  # train.py says whose allocator it ran on
        logs = tpb.leasehold_cli(args, env, "logs", str(job_id)).stdout
        summaries = [o for o in tpb.json_lines(logs) if o.get("type") == "summary"]
        name = summaries[-1].get("allocator", {}).get("name") if summaries else None
        if name != "leasehold":
            raise tpb.BenchError("job %d (%s) ran on allocator %r, not the plug-in"
                                 % (job_id, workload, name), tpb.tail(logs))
    first = job["first_step_at_us"] / 1e6
    return first - t0, first - job["assigned_at_us"] / 1e6


def summary(values):
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
    return {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * pick(0.99),
            "min_ms": 1e3 * v[0], "max_ms": 1e3 * v[-1], "n": len(v)}


def run_mode(args, env, tmp, mode, daemons):
    name = "bench-" + mode
    cmd = [os.path.join(args.bin, "leasehold-agent"), "--name", name, "--python-dir",
           args.python_dir, "--torch-plugin", args.torch_plugin]
    standbys = 0 if mode == "cold" else args.standbys
    if standbys:
        cmd += ["--python-standby", str(standbys), "--python-standby-mode", mode,
                "--python-standby-python", sys.executable]
        if args.preload:
            cmd += ["--python-standby-preload", args.preload]
    agent = tpb.Daemon("agent-" + mode, cmd, env, tmp)
    daemons.insert(0, agent)
    tpb.wait_for("agent " + name, lambda: tpb.agent_registered(args, env, name), agent, 60)
    taken = 0

    def settle():
        if standbys:
            tpb.wait_for("%d standbys ready" % standbys,
                         lambda: log_count(agent.log, "is ready after") >= taken + standbys,
                         agent, 180)

    results = {}
    for workload in args.workloads:
        n = args.jobs if workload == "small" else args.model_jobs
        submit, assigned = [], []
        for i in range(n):
            settle()
            print("torch_standby_bench: %s %s job %d/%d" % (mode, workload, i + 1, n),
                  file=sys.stderr, flush=True)
            s, a = one_job(args, env, tmp, workload, agent)
            submit.append(s)
            assigned.append(a)
            if standbys:
                taken += 1
        warm = log_count(agent.log, "runs warm in Python standby")
        if standbys and warm != taken:
            raise tpb.BenchError("%d of %d jobs ran warm in %s mode" % (warm, taken, mode),
                                 tpb.file_tail(agent.log))
        results[workload] = {"submit_to_first_report": summary(submit),
                             "assigned_to_first_report": summary(assigned)}
    agent.stop()
    daemons.remove(agent)
    return results


def print_table(result):
    print("\n%-9s %-8s %12s %12s %14s %9s" % ("workload", "mode", "p50 ms", "p99 ms",
                                             "assigned p50", "vs cold"), file=sys.stderr)
    modes = result["modes"]
    for workload in result["workloads"]:
        cold = modes.get("cold", {}).get(workload)
        for mode, per in modes.items():
            r = per[workload]
            s, a = r["submit_to_first_report"], r["assigned_to_first_report"]
            ratio = (cold["submit_to_first_report"]["p50_ms"] / s["p50_ms"]) if cold else None
            print("%-9s %-8s %12.1f %12.1f %14.1f %9s" % (
                workload, mode, s["p50_ms"], s["p99_ms"], a["p50_ms"],
                "%.1fx" % ratio if ratio else "-"), file=sys.stderr)
    print("targets: small warm p50 <= 50 ms and >= 30x cold", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)

    def body(env, tmp, daemons):
        info = tpb.device_info()
        tpb.start_coordinator(args, env, tmp, daemons)
        modes = {}
        for mode in args.modes:
            modes[mode] = run_mode(args, env, tmp, mode, daemons)
        result = {"device": info["device"], "torch": info["torch"], "standbys": args.standbys,
                  "budget": args.budget, "workloads": args.workloads, "modes": modes}
        print(json.dumps(result, indent=1), flush=True)
        print_table(result)
        return 0

    return tpb.run_bench("torch_standby_bench", "lh-standby-bench-", body)


if __name__ == "__main__":
    sys.exit(main())

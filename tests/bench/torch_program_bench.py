"""The same PyTorch scripts with PyTorch's allocator and inside Leasehold,
side by side in one run.

  python3 tests/bench/torch_program_bench.py --bin BUNDLE/bin \\
      --python-dir BUNDLE/share/leasehold/python \\
      --torch-plugin PATH/libleasehold_torch.so \\
      [--models lenet,resnet18,gpt2] [--steps N] [--repeats R] \\
      [--pool-size 16GiB] [--budget 8GiB] [--amp]

It starts a coordinator (CUDA pool, MPS off) and one agent in a temporary
folder, then for every model runs tests/torch/train.py R times each way:
plainly (this Python, PyTorch's allocator) and as a program job through
`leasehold run` (the plug-in's allocator), in alternating order. It measures:

- steps/s after the script's warm-up (target: Leasehold >= 0.98x PyTorch);
- peak device memory (PyTorch's max reserved; the plug-in's peak leased);
- lease requests after the warm-up, i.e. allocations that reach the
  coordinator in the steady state (target 0), and allocations per step;
- start-up of a program job, cold: from just before `leasehold run` to the
  first {"step": ...} line of its streamed output (`leasehold run` polls the
  job's log every 200 ms, so this includes up to 0.2 s of polling), with the
  script's own breakdown (interpreter, import torch, CUDA init, first
  allocation = session and pool mapping, model build, first step).

Prints one JSON object on stdout and a table on stderr. The bench process
itself never initializes CUDA (the device is named by a child). Exit status 1,
with the last 40 lines of the failing process's output, when anything fails.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "tests", "torch", "train.py")
TAIL_LINES = 40
WARMUP = 20  # train.py's default --warmup: steps left out of its steps/s
SUBMITTED = re.compile(r"leasehold: job (\d+) '.*' submitted")


class BenchError(Exception):
    """A failure: message plus the failing process's output."""

    def __init__(self, message, output=""):
        super().__init__(message)
        self.output = output


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--bin", required=True, help="folder of leasehold, leasehold-coordinator, "
                   "leasehold-agent")
    p.add_argument("--python-dir", required=True,
                   help="folder of Leasehold's Python package (leasehold/, leasehold_site/)")
    p.add_argument("--torch-plugin", required=True, help="path of libleasehold_torch.so")
    p.add_argument("--models", default="lenet,resnet18,gpt2",
                   help="comma-separated: lenet, resnet18, gpt2")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per model and allocator")
    p.add_argument("--pool-size", default="16GiB", help="the coordinator's pool")
    p.add_argument("--budget", default="8GiB", help="each program job's memory_budget")
    p.add_argument("--amp", action="store_true", help="pass --amp (bf16 autocast) to train.py")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds per training run")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - {"lenet", "resnet18", "gpt2"}
    if unknown or not args.models:
        p.error("--models: unknown %s" % ",".join(sorted(unknown)) if unknown else
                "--models: none given")
    if args.steps <= WARMUP or args.repeats < 1:
        p.error("--steps must exceed train.py's %d warm-up steps and --repeats be at least 1"
                % WARMUP)
    for name in ("leasehold", "leasehold-coordinator", "leasehold-agent"):
        if not os.access(os.path.join(args.bin, name), os.X_OK):
            p.error("--bin: %s has no executable %s" % (args.bin, name))
    args.bin = os.path.abspath(args.bin)
    args.python_dir = os.path.abspath(args.python_dir)
    args.torch_plugin = os.path.abspath(args.torch_plugin)
    return args


def tail(text, lines=TAIL_LINES):
    return "\n".join(text.splitlines()[-lines:])


def file_tail(path):
    try:
        with open(path, errors="replace") as f:
            return tail(f.read())
    except OSError as e:
        return "(cannot read %s: %s)" % (path, e)


def json_lines(text):
    """The JSON objects among the lines of text (other lines are skipped)."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def is_step_line(line):
    """Whether line is train.py's {"step": ...} progress line."""
    for obj in json_lines(line):
        return "step" in obj and "type" not in obj
    return False


def summary_of(text, what):
    for obj in json_lines(text):
        if obj.get("type") == "summary":
            return obj
    raise BenchError("%s printed no summary line" % what, tail(text))


# ---- processes --------------------------------------------------------------------


def run_streamed(cmd, env, timeout, what):
    """Runs cmd with stdout and stderr merged, reading lines as they come.
    Returns (output, seconds from start to the first {"step": ...} line or
    None). Raises BenchError when it fails or runs past timeout."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    timed_out = threading.Event()

    def stop():  # SIGTERM first: `leasehold run` then cancels its job
        timed_out.set()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    lines, first_step = [], None
    try:
        for line in proc.stdout:
            if first_step is None and is_step_line(line):
                first_step = time.monotonic() - t0
            lines.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
    output = "".join(lines)
    if timed_out.is_set():
        raise BenchError("%s ran past %gs" % (what, timeout), tail(output))
    if rc != 0:
        raise BenchError("%s exited with status %d" % (what, rc), tail(output))
    return output, first_step


def leasehold_cli(args, env, *words, timeout=30):
    return subprocess.run([os.path.join(args.bin, "leasehold")] + list(words), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


class Daemon:
    """A background process with its output in a file."""

    def __init__(self, name, cmd, env, folder):
        self.name, self.log = name, os.path.join(folder, name + ".log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def check_alive(self):
        if self.proc.poll() is not None:
            raise BenchError("%s exited with status %d" % (self.name, self.proc.returncode),
                             file_tail(self.log))

    def stop(self, grace=20):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                print("torch_program_bench: %s ignored SIGTERM for %ds; killing it"
                      % (self.name, grace), file=sys.stderr)
                self.proc.kill()
                self.proc.wait()


def wait_for(what, predicate, daemon, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon.check_alive()
        if predicate():
            return
        time.sleep(0.2)
    raise BenchError("%s: not ready after %ds" % (what, timeout), file_tail(daemon.log))


def coordinator_up(args, env):
    try:
        return leasehold_cli(args, env, "--timeout", "200ms", "status", timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def agent_registered(args, env, name):
    try:
        r = leasehold_cli(args, env, "status", "-o", "json", timeout=10)
        status = json.loads(r.stdout) if r.returncode == 0 else {}
    except (subprocess.TimeoutExpired, ValueError):
        return False
    agents = status.get("agents") if isinstance(status, dict) else None
    return any(isinstance(a, dict) and a.get("name") == name for a in agents or [])


def device_info():
    """The GPU's name and torch's version, from a child: this process never
    initializes CUDA."""
    code = ("import json, torch; print(json.dumps({'device': torch.cuda.get_device_name(), "
            "'torch': torch.__version__, 'cuda': torch.version.cuda}))")
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    if r.returncode != 0:
        raise BenchError("cannot query the GPU with %s" % sys.executable, tail(r.stdout))
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- runs -------------------------------------------------------------------------


def train_args(args, model):
    extra = ["--amp"] if args.amp else []
    return [sys.executable, TRAIN, "--model", model, "--steps", str(args.steps)] + extra


def run_plain(args, env, model):
    output, first_step = run_streamed(train_args(args, model), env, args.run_timeout,
                                      "train.py --model %s (PyTorch's allocator)" % model)
    s = summary_of(output, "train.py --model %s" % model)
    return {"steps_per_second": s["steps_per_second"], "final_loss": s["final_loss"],
            "peak_device_bytes": s["peak_device_bytes"], "startup": s["startup"],
            "launch_to_first_report_s": first_step, "allocator": s["allocator"]}


def job_facts(args, env, output):
    """The coordinator's view of the job `leasehold run` submitted, when its id
    shows in the output; None otherwise (optional information)."""
    m = SUBMITTED.search(output)
    if not m:
        return None
    try:
        r = leasehold_cli(args, env, "job", m.group(1), "-o", "json")
        job = json.loads(r.stdout) if r.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        return None
    if not isinstance(job, dict):
        return None
    facts = {k: job.get(k) for k in ("id", "state", "agent", "memory_wait_ms",
                                     "program_memory", "exit_code")}
    assigned, first = job.get("assigned_at_us") or 0, job.get("first_step_at_us") or 0
    if assigned and first >= assigned:
        facts["assigned_to_first_step_s"] = (first - assigned) / 1e6
    return facts


def run_leasehold(args, env, model):
    cmd = [os.path.join(args.bin, "leasehold"), "run", "--budget", args.budget,
           "--name", "bench-" + model, "--"] + train_args(args, model)
    output, first_step = run_streamed(cmd, env, args.run_timeout,
                                      "leasehold run ... train.py --model %s" % model)
    s = summary_of(output, "leasehold run ... train.py --model %s" % model)
    if s["allocator"].get("name") != "leasehold":
        raise BenchError("train.py --model %s ran inside Leasehold without the plug-in as its "
                         "allocator (%s)" % (model, s["allocator"]), tail(output))
    return {"steps_per_second": s["steps_per_second"], "final_loss": s["final_loss"],
            "peak_device_bytes": s["peak_device_bytes"], "startup": s["startup"],
            "submit_to_first_report_s": first_step, "allocator": s["allocator"],
            "job": job_facts(args, env, output)}


# ---- results ----------------------------------------------------------------------


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def maximum(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def median_per_key(dicts):
    keys = sorted({k for d in dicts for k in d})
    return {k: median([d.get(k) for d in dicts]) for k in keys}


def aggregate(plain, lh):
    p_sps = median([r["steps_per_second"] for r in plain])
    l_sps = median([r["steps_per_second"] for r in lh])
    allocs = [r["allocator"] for r in lh]
    startup_plain = median_per_key([r["startup"] for r in plain])
    startup_plain["launch_to_first_report_s"] = median(
        [r["launch_to_first_report_s"] for r in plain])
    return {
        "pytorch": {"steps_per_second": p_sps,
                    "peak_device_bytes": maximum([r["peak_device_bytes"] for r in plain]),
                    "runs": plain},
        "leasehold": {"steps_per_second": l_sps,
                      "peak_device_bytes": maximum([r["peak_device_bytes"] for r in lh]),
                      # the worst run: any steady-state lease request misses the target
                      "lease_requests_after_warmup": maximum(
                          [a.get("lease_requests_after_warmup") for a in allocs]),
                      "allocations_per_step": median(
                          [a.get("allocations_per_step") for a in allocs]),
                      "runs": lh},
        "ratio": l_sps / p_sps if p_sps and l_sps else None,
        "startup": {"submit_to_first_report_s": median(
                        [r["submit_to_first_report_s"] for r in lh]),
                    "breakdown": median_per_key([r["startup"] for r in lh])},
        "startup_plain": startup_plain,
    }


def fmt(value, spec, scale=1):
    return format(value / scale, spec) if value is not None else "-"


def print_table(models):
    mib = 1 << 20
    head = "%-9s %11s %11s %6s %10s %10s %9s %8s %8s" % (
        "model", "torch st/s", "lh st/s", "ratio", "torch MiB", "lh MiB", "lease req",
        "start s", "pool s")
    print(head, file=sys.stderr)
    for name, m in models.items():
        pt, lh, st = m["pytorch"], m["leasehold"], m["startup"]
        print("%-9s %11s %11s %6s %10s %10s %9s %8s %8s" % (
            name, fmt(pt["steps_per_second"], ".1f"), fmt(lh["steps_per_second"], ".1f"),
            fmt(m["ratio"], ".3f"), fmt(pt["peak_device_bytes"], ".0f", mib),
            fmt(lh["peak_device_bytes"], ".0f", mib), fmt(lh["lease_requests_after_warmup"], ".0f"),
            fmt(st["submit_to_first_report_s"], ".2f"),
            fmt(st["breakdown"].get("first_allocation"), ".3f")), file=sys.stderr)
    print("targets: ratio >= 0.98; lease req (after warm-up) = 0. start s: submit to first "
          "report; pool s: the first allocation (session + pool mapping)", file=sys.stderr)


# ---- main -------------------------------------------------------------------------


def bench_environment(prefix):
    """(environment, temporary folder) of a benchmark run: NVLink multicast
    off, unbuffered Python output, the coordinator's socket in the folder."""
    env = dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"  # output lines arrive when printed
    tmp = tempfile.mkdtemp(prefix=prefix)
    env["LEASEHOLD_ENDPOINT"] = "ipc://" + os.path.join(tmp, "c.sock")
    return env, tmp


def run_bench(name, prefix, body):
    """body(env, tmp, daemons) -> exit status, in a benchmark environment
    (bench_environment): a BenchError, or a process that ran past its
    timeout, prints "NAME: FAILED: why" and gives 1; the daemons body
    added are stopped, in order, and the folder removed, whatever happens."""
    env, tmp = bench_environment(prefix)
    daemons = []
    try:
        return body(env, tmp, daemons)
    except BenchError as e:
        if e.output:
            print(e.output, file=sys.stderr)
        print("%s: FAILED: %s" % (name, e), file=sys.stderr)
        return 1
    except subprocess.TimeoutExpired as e:
        print("%s: FAILED: %s" % (name, e), file=sys.stderr)
        return 1
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def start_coordinator(args, env, tmp, daemons):
    """Starts a coordinator (CUDA pool of args.pool_size, MPS off), adding it
    to daemons as soon as it runs, and waits until it answers."""
    coordinator = Daemon("coordinator", [
        os.path.join(args.bin, "leasehold-coordinator"), "--backend", "cuda", "--mps", "off",
        "--pool-size", args.pool_size, "--state-dir", os.path.join(tmp, "state")], env, tmp)
    daemons.append(coordinator)
    wait_for("the coordinator", lambda: coordinator_up(args, env), coordinator, 30)
    return coordinator


def start_leasehold(args, env, tmp, daemons):
    """Starts the coordinator and the agent, adding each to daemons (in the
    order to stop them) as soon as it runs, so a failure still stops it."""
    coordinator = start_coordinator(args, env, tmp, daemons)
    agent = Daemon("agent", [
        os.path.join(args.bin, "leasehold-agent"), "--name", "bench",
        "--python-dir", args.python_dir, "--torch-plugin", args.torch_plugin], env, tmp)
    daemons.insert(0, agent)  # stopped before the coordinator
    return coordinator, agent


def bench(args, env, coordinator, agent):
    wait_for("the agent 'bench'", lambda: agent_registered(args, env, "bench"), agent, 60)
    models = {}
    for model in args.models:
        plain, lh = [], []
        for repeat in range(args.repeats):
            # ABBA: which allocator goes first alternates, so drift (clocks,
            # temperature, page cache) weighs on both alike.
            order = ("pytorch", "leasehold") if repeat % 2 == 0 else ("leasehold", "pytorch")
            for which in order:
                print("torch_program_bench: %s %s run %d/%d" % (model, which, repeat + 1,
                                                                 args.repeats), file=sys.stderr)
                if which == "pytorch":
                    plain.append(run_plain(args, env, model))
                else:
                    for d in (coordinator, agent):
                        d.check_alive()
                    try:
                        lh.append(run_leasehold(args, env, model))
                    except BenchError as e:  # the agent's side of it helps too
                        e.output += "\n--- the agent's log ---\n" + file_tail(agent.log)
                        raise
        models[model] = aggregate(plain, lh)
    return models


def main(argv=None):
    args = parse_args(argv)

    def body(env, tmp, daemons):
        info = device_info()
        coordinator, agent = start_leasehold(args, env, tmp, daemons)
        models = bench(args, env, coordinator, agent)
        result = {"device": info["device"], "torch": info["torch"], "cuda": info["cuda"],
                  "steps": args.steps, "repeats": args.repeats, "budget": args.budget,
                  "pool_size": args.pool_size, "amp": args.amp, "models": models}
        print(json.dumps(result, indent=1), flush=True)  # first: the results matter most
        print_table(models)
        return 0

    return run_bench("torch_program_bench", "lh-torch-bench-", body)


if __name__ == "__main__":
    sys.exit(main())

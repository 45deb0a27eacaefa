"""A warm standby for Python program jobs: ``python3 -m leasehold.standby``.

The agent (agent/python_standby.h) starts these ahead of any job, with the
environment a program job on its device gets minus the job's own variables,
the report pipe on fd 3 and a control pipe on fd 4. A standby warms up, says
so on the report pipe with one line ``{"type": "standby-ready", ...}``,
then waits for one job on fd 4: one JSON line

    {"argv": [SCRIPT, ARG...], "module": null | "MODULE",
     "cwd": DIR, "environ": {NAME: VALUE, ...}}

It takes the job's environment (the whole of it: what a cold start of the
same job gets), working folder and arguments, and runs the script or module
as ``__main__`` (runpy), as ``python3 SCRIPT ARG...`` or
``python3 -m MODULE ARG...`` would. The process then ends with the script's
exit status; the agent starts a new standby for the next job, since a script
may leave any state behind (docs/program-jobs.md lists what).

LEASEHOLD_STANDBY_MODE says how the job runs:

- ``process`` (the default): in this process. The warm-up imported torch,
  installed the plug-in as PyTorch's allocator, created the CUDA context and
  ran one small training step (cuBLAS and cuDNN handles, the common kernels
  loaded) in the plug-in's standby arena, then freed all of it; the job's
  memory comes from its own leases.
- ``fork``: in a child forked for the job. A CUDA context does not survive
  fork, so the warm-up stops after ``import torch`` and installing the
  plug-in; the child creates its context itself.

Either way, the modules named in LEASEHOLD_STANDBY_PRELOAD (comma-separated)
are imported during the warm-up. The job sees LEASEHOLD_WARM set to the mode. An end of file on fd 4 ends a
standby quietly (status 0).
"""

import gc
import json
import os
import runpy
import sys
import time

CONTROL_FD = 4
MODES = ("process", "fork")


def _fail(message, status=3):
    sys.stderr.write("leasehold.standby: %s\n" % message)
    sys.stderr.flush()
    os._exit(status)


def _warm_step(torch, device):
    """One small training step of a convolution and an MLP on `device`,
    everything it allocated freed afterwards. The random number generators
    are put back as they were: an unseeded script must see what a cold
    start's would."""
    devices = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        _warm_step_body(torch, device)


def _warm_step_body(torch, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10)).to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 1, 16, 16, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimiser.step()
    optimiser.zero_grad(set_to_none=True)
    loss.item()
    del model, optimiser, x, y, loss


def preload(names):
    """Imports the modules named (comma-separated; the agent's
    --python-standby-preload), such as torchvision or transformers, whose
    import would otherwise be a job's first seconds. One that cannot be
    imported is left out, with its reason; the standby goes on."""
    done = {}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        t = time.perf_counter()
        try:
            __import__(name)
            done[name] = round(time.perf_counter() - t, 4)
        except Exception as e:  # noqa: BLE001  (any import error: not preloaded)
            done[name] = "not importable: %s" % (str(e).splitlines() or [type(e).__name__])[0]
            sys.stderr.write("leasehold.standby: %s is not preloaded: %s\n" % (name, done[name]))
    return done


def warm_up(mode):
    """Everything a job would otherwise do first; returns what was done."""
    done = {}
    t = time.perf_counter()
    try:
        import torch
    except ImportError as e:  # no torch here: plain scripts still start warm
        done["torch"] = "not importable: %s" % e
        return done
    done["import_torch_s"] = round(time.perf_counter() - t, 4)
    import leasehold
    import leasehold.torch as plugin

    device = leasehold._env_device()
    cuda = device.startswith("cuda") and bool(getattr(torch.version, "cuda", None))
    installed = plugin.install(standby=True) if cuda else False
    done["plugin"] = installed
    done["preloaded"] = preload(os.environ.get("LEASEHOLD_STANDBY_PRELOAD", ""))
    if mode == "fork":
        return done  # no context, no threads: the job's child is forked from here
    t = time.perf_counter()
    if installed:
        plugin.standby_begin()
    try:
        if cuda:
            torch.cuda.init()
            torch.cuda.synchronize(device)
        _warm_step(torch, device if cuda else "cpu")
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        gc.collect()
        if cuda:
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
        if installed:
            left = plugin.standby_end()
            if left:
                _fail("%d bytes of the warm-up's memory are still allocated; a job must not "
                      "start beside memory from outside its leases" % left)
    done["warm_step_s"] = round(time.perf_counter() - t, 4)
    return done


def _read_job():
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(CONTROL_FD, 65536)
        if not chunk:
            if data:
                _fail("the agent's job line ended early (%d bytes)" % len(data))
            os._exit(0)  # the agent closed the standby
        data += chunk
    try:
        job = json.loads(data)
        argv, cwd, environ = job["argv"], job["cwd"], job["environ"]
        module = job.get("module")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv is not a non-empty list of strings")
        if not isinstance(cwd, str) or not isinstance(environ, dict):
            raise ValueError("cwd or environ has the wrong type")
        if module is not None and not isinstance(module, str):
            raise ValueError("module is neither null nor a string")
    except (ValueError, KeyError, TypeError) as e:
        _fail("the agent's job line is not valid: %s" % e)
    return argv, module, cwd, environ


def _start_spilling():
    """What the plug-in's install does for a cold job once it knows the job
    (the standby installed it before there was one): spilling by default."""
    plugin = sys.modules.get("leasehold.torch")
    if plugin is not None and plugin._plugin is not None:
        plugin._spill_by_default()


def _die_with_parent():
    """The forked job ends when its standby parent does (the parent gets
    SIGKILL when the agent dies): prctl(PR_SET_PDEATHSIG, SIGKILL)."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(137)


def run_job(argv, module, cwd, environ, mode):
    """Runs the job's script in this process; returns only through
    SystemExit (or by the script's own os._exit)."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ["LEASEHOLD_WARM"] = mode
    try:
        os.chdir(cwd)
    except OSError as e:
        _fail("cannot enter the job's folder %s: %s" % (cwd, e), 127)
    sys.argv = list(argv)
    _start_spilling()
    try:
        if module is not None:
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            if not os.path.exists(script):
                sys.stderr.write("%s: can't open file %r: [Errno 2] No such file or directory\n"
                                 % (sys.executable, os.path.abspath(script)))
                sys.exit(2)
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        sys.exit(1)
    sys.exit(0)


def main():
    mode = os.environ.get("LEASEHOLD_STANDBY_MODE") or "process"
    if mode not in MODES:
        _fail("LEASEHOLD_STANDBY_MODE=%r is neither of %s" % (mode, ", ".join(MODES)), 2)
    try:
        report_fd = int(os.environ.get("LEASEHOLD_REPORT_FD", ""))
        os.fstat(report_fd)
        os.fstat(CONTROL_FD)
    except (ValueError, OSError):
        _fail("no report pipe (LEASEHOLD_REPORT_FD) or control pipe (fd %d): the agent starts "
              "standbys" % CONTROL_FD, 2)
    t = time.perf_counter()
    done = warm_up(mode)
    ready = {"type": "standby-ready", "mode": mode, "pid": os.getpid(),
             "seconds": round(time.perf_counter() - t, 4)}
    ready.update(done)
    os.write(report_fd, (json.dumps(ready) + "\n").encode())
    argv, module, cwd, environ = _read_job()
    if mode == "fork":
        import signal

        pid = os.fork()
        if pid == 0:
            _die_with_parent()
        else:
            # The agent stops a job by signalling its group: the job handles
            # that (its grace period), and this parent waits for it.
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            os.close(CONTROL_FD)
            while True:
                try:
                    _, status = os.waitpid(pid, 0)
                    break
                except InterruptedError:
                    continue
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status)
                     else 128 + os.WTERMSIG(status))
    os.close(CONTROL_FD)
    run_job(argv, module, cwd, environ, mode)


if __name__ == "__main__":
    main()

"""The leasehold Python package (python/leasehold) and the sitecustomize of
program jobs (python/leasehold_site).

Run by ctest as `/usr/bin/python3 -m unittest discover -s tests/python`
(PYTHONPATH=python). Child processes are Debian's /usr/bin/python3, whose
python3-torch (CPU) exercises the import hook; a fake CUDA torch package and
a fake plug-in (compiled here when a C compiler is found) exercise install()
all the way to change_current_allocator.
"""

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import unittest
import warnings
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_DIR = os.path.join(ROOT, "python")
SITE_DIR = os.path.join(PYTHON_DIR, "leasehold_site")
CHILD_PYTHON = "/usr/bin/python3"

sys.path.insert(0, PYTHON_DIR)
import leasehold  # noqa: E402
import leasehold.torch  # noqa: E402

JOB_ENV = ("LEASEHOLD_JOB_ID", "LEASEHOLD_JOB_ATTEMPT", "LEASEHOLD_JOB_NAME", "LEASEHOLD_BUDGET",
           "LEASEHOLD_DEVICE", "LEASEHOLD_CHECKPOINT_DIR", "LEASEHOLD_REPORT_FD",
           "LEASEHOLD_TORCH_PLUGIN")


@contextlib.contextmanager
def job_env(**values):
    """os.environ without LEASEHOLD_* but `values` (keys without the prefix)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env.update({"LEASEHOLD_" + k: str(v) for k, v in values.items()})
    with mock.patch.dict(os.environ, env, clear=True):
        yield


def reset_reporter():
    leasehold._broken = False
    leasehold._last_memory = None


class JobTest(unittest.TestCase):
    def test_none_outside_a_job(self):
        with job_env():
            self.assertIsNone(leasehold.job())

    def test_from_the_environment(self):
        with job_env(JOB_ID=17, JOB_ATTEMPT=2, JOB_NAME="resnet", BUDGET=6 << 30,
                     DEVICE="cuda:0", CHECKPOINT_DIR="/srv/ckpt/17"):
            j = leasehold.job()
            self.assertEqual(leasehold.job(), j)
        self.assertEqual((j.id, j.attempt, j.name, j.budget_bytes, j.device, j.checkpoint_dir),
                         (17, 2, "resnet", 6 << 30, "cuda:0", "/srv/ckpt/17"))
        with self.assertRaises(AttributeError):
            j.id = 3
        self.assertIn("resnet", repr(j))

    def test_defaults(self):
        with job_env(JOB_ID=5):
            j = leasehold.job()
        self.assertEqual((j.attempt, j.name, j.budget_bytes, j.device, j.checkpoint_dir),
                         (0, "", None, "cpu", None))

    def test_malformed_values_name_the_variable(self):
        for key, value in (("JOB_ID", "x"), ("JOB_ID", "0"), ("BUDGET", "-1"),
                           ("DEVICE", "tpu:0"), ("JOB_ATTEMPT", "1.5")):
            env = {"JOB_ID": 5, key: value}
            with job_env(**env), self.assertRaises(ValueError) as cm:
                leasehold.job()
            self.assertIn("LEASEHOLD_" + key, str(cm.exception))


class ReportTest(unittest.TestCase):
    def setUp(self):
        reset_reporter()
        self.r, self.w = os.pipe()

    def tearDown(self):
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass
        reset_reporter()

    def read_lines(self):
        os.set_blocking(self.r, False)
        data = b""
        try:
            while True:
                chunk = os.read(self.r, 65536)
                if not chunk:
                    break
                data += chunk
        except BlockingIOError:
            pass
        return data.decode().splitlines(keepends=True)

    def test_one_json_line_with_the_given_fields(self):
        with job_env(JOB_ID=1, REPORT_FD=self.w):
            self.assertTrue(leasehold.report(step=10, loss=0.25))
            self.assertTrue(leasehold.report(epoch=1, samples=6000, test_accuracy=0.875))
        lines = self.read_lines()
        self.assertEqual(len(lines), 2)
        for line in lines:
            self.assertTrue(line.endswith("\n"))
            self.assertLessEqual(len(line.encode()), leasehold.MAX_LINE_BYTES)
        self.assertEqual(json.loads(lines[0]), {"type": "report", "step": 10, "loss": 0.25})
        self.assertEqual(json.loads(lines[1]), {"type": "report", "epoch": 1, "samples": 6000,
                                                "test_accuracy": 0.875})

    def test_largest_line_fits_the_atomic_size(self):
        with job_env(JOB_ID=1, REPORT_FD=self.w):
            leasehold.report(step=2**63 - 1, epoch=2**63 - 1, samples=2**63 - 1,
                             loss=-1.7976931348623157e308, test_accuracy=2.2250738585072014e-308)
        (line,) = self.read_lines()
        self.assertLessEqual(len(line.encode()), leasehold.MAX_LINE_BYTES)

    def test_false_outside_a_job_or_without_a_pipe(self):
        with job_env(REPORT_FD=self.w):
            self.assertFalse(leasehold.report(step=1))
        with job_env(JOB_ID=1):
            self.assertFalse(leasehold.report(step=1))
        self.assertEqual(self.read_lines(), [])

    def test_bad_values_are_refused_by_name(self):
        cases = [
            ({"step": "3"}, TypeError, "step"),
            ({"step": 1.0}, TypeError, "step"),
            ({"epoch": True}, TypeError, "epoch"),
            ({"samples": -1}, ValueError, "samples"),
            ({"step": 2**63}, ValueError, "step"),
            ({"loss": float("nan")}, ValueError, "loss"),
            ({"loss": float("inf")}, ValueError, "loss"),
            ({"loss": "0.1"}, TypeError, "loss"),
            ({"test_accuracy": 1.5}, ValueError, "test_accuracy"),
            ({}, TypeError, "at least one"),
        ]
        with job_env(JOB_ID=1, REPORT_FD=self.w):
            for kwargs, error, name in cases:
                with self.subTest(kwargs=kwargs):
                    with self.assertRaises(error) as cm:
                        leasehold.report(**kwargs)
                    self.assertIn(name, str(cm.exception))
        with job_env(), self.assertRaises(ValueError):
            leasehold.report(loss=float("nan"))  # refused outside a job too
        self.assertEqual(self.read_lines(), [])

    def test_lines_of_many_threads_never_interleave(self):
        threads, per_thread = 8, 400
        received = []

        def reader():
            buf = b""
            with os.fdopen(os.dup(self.r), "rb", buffering=0) as f:
                while True:
                    chunk = f.read(65536)
                    if not chunk:
                        break
                    buf += chunk
            received.extend(buf.decode().splitlines())

        def writer(k):
            for i in range(per_thread):
                leasehold.report(step=i, epoch=k, loss=k + i / 1000.0)

        t_reader = threading.Thread(target=reader)
        t_reader.start()
        with job_env(JOB_ID=1, REPORT_FD=self.w):
            workers = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
        os.close(self.w)
        os.close(self.r)
        t_reader.join()
        self.assertEqual(len(received), threads * per_thread)
        seen = {(d["epoch"], d["step"]) for d in map(json.loads, received)}
        self.assertEqual(len(seen), threads * per_thread)

    def test_a_broken_pipe_returns_false_and_warns_once(self):
        os.close(self.r)
        with job_env(JOB_ID=1, REPORT_FD=self.w), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(leasehold.report(step=1))
            self.assertFalse(leasehold.report(step=2))
        self.assertEqual(len(caught), 1)
        self.assertIn("report pipe", str(caught[0].message))

    def test_a_broken_pipe_never_raises_even_with_warnings_as_errors(self):
        os.close(self.r)
        with job_env(JOB_ID=1, REPORT_FD=self.w), warnings.catch_warnings(), \
                mock.patch("sys.stderr") as stderr:
            warnings.simplefilter("error")
            self.assertFalse(leasehold.report(step=1))
        self.assertTrue(stderr.write.called)

    def test_memory_lines_at_most_once_a_second(self):
        stats = {"leased_bytes": 64 << 20, "peak_leased_bytes": 96 << 20,
                 "in_use_bytes": 40 << 20, "peak_in_use_bytes": 80 << 20, "allocations": 1000,
                 "cache_hits": 990, "lease_requests": 10, "budget_bytes": 1 << 30}
        clock = [100.0]
        with job_env(JOB_ID=1, REPORT_FD=self.w), \
                mock.patch.object(leasehold.torch, "stats", return_value=stats), \
                mock.patch.object(leasehold, "_monotonic", side_effect=lambda: clock[0]):
            leasehold.report(step=1)
            clock[0] += 0.5
            leasehold.report(step=2)
            clock[0] += 0.6
            leasehold.report(step=3)
        lines = [json.loads(x) for x in self.read_lines()]
        self.assertEqual([d["type"] for d in lines],
                         ["report", "memory", "report", "report", "memory"])
        memory = dict(stats, spilled_bytes=0, restored_bytes=0)  # spilling is off
        del memory["budget_bytes"]
        memory["type"] = "memory"
        self.assertEqual(lines[1], memory)

    def test_the_last_memory_line_goes_out_at_exit(self):
        stats = {"leased_bytes": 64 << 20, "allocations": 1000}
        clock = [100.0]
        registered = []
        with job_env(JOB_ID=1, REPORT_FD=self.w), \
                mock.patch.object(leasehold.torch, "stats", side_effect=lambda: dict(stats)), \
                mock.patch.object(leasehold, "_monotonic", side_effect=lambda: clock[0]), \
                mock.patch.object(leasehold, "_exit_line", False), \
                mock.patch("atexit.register", side_effect=registered.append):
            leasehold.report(step=1)
            clock[0] += 0.5
            stats["leased_bytes"] = 80 << 20  # within the second: no line yet
            leasehold.report(step=2)
            self.assertEqual(registered, [leasehold._last_memory_line])  # once
            registered[0]()  # what exit runs
        lines = [json.loads(x) for x in self.read_lines()]
        self.assertEqual([d["type"] for d in lines], ["report", "memory", "report", "memory"])
        self.assertEqual(lines[1]["leased_bytes"], 64 << 20)
        self.assertEqual(lines[3]["leased_bytes"], 80 << 20)


def child_python_has_torch():
    if not os.access(CHILD_PYTHON, os.X_OK):
        return False
    r = subprocess.run([CHILD_PYTHON, "-c", "import torch"], capture_output=True)
    return r.returncode == 0


def run_child(script, pythonpath, job=None, extra=None, pass_fds=()):
    """Runs `script` in /usr/bin/python3 with site enabled; returns the
    CompletedProcess. `job`: LEASEHOLD_* variables (keys without the
    prefix); `extra`: other variables."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("LEASEHOLD_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    base["PYTHONPATH"] = os.pathsep.join(pythonpath)
    base.update({"LEASEHOLD_" + k: str(v) for k, v in (job or {}).items()})
    base.update({k: str(v) for k, v in (extra or {}).items()})
    return subprocess.run([CHILD_PYTHON, "-c", textwrap.dedent(script)], env=base,
                          capture_output=True, text=True, timeout=240, pass_fds=pass_fds)


@unittest.skipUnless(os.access(CHILD_PYTHON, os.X_OK), "%s not found" % CHILD_PYTHON)
class SiteHookTest(unittest.TestCase):
    SITE_PATH = [SITE_DIR, PYTHON_DIR]

    @classmethod
    def setUpClass(cls):
        cls.has_torch = child_python_has_torch()
        cls.tmp = tempfile.mkdtemp(prefix="leasehold-site-test-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def need_torch(self):
        if not self.has_torch:
            self.skipTest("%s has no torch" % CHILD_PYTHON)

    def result(self, proc):
        self.assertEqual(proc.returncode, 0, proc.stderr)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def test_install_is_attempted_after_import_torch_and_cpu_torch_goes_on(self):
        self.need_torch()
        proc = run_child("""
            import json, sys
            before = "torch" in sys.modules
            import torch
            import leasehold.torch as lt
            st = lt.install_status()
            print(json.dumps({
                "before": before, "attempted": st["attempted"], "installed": st["installed"],
                "reason": st["reason"], "sum": float(torch.ones(3).sum()),
                "hooks": [type(f).__name__ for f in sys.meta_path],
                "loader": type(torch.__spec__.loader).__name__,
            }))
        """, self.SITE_PATH, {"JOB_ID": 42, "DEVICE": "cuda:0",
                              "TORCH_PLUGIN": "/nonexistent/libleasehold_torch.so"})
        out = self.result(proc)
        self.assertFalse(out["before"])
        self.assertTrue(out["attempted"])
        self.assertFalse(out["installed"])
        self.assertIn("without CUDA", out["reason"])
        self.assertEqual(out["sum"], 3.0)
        self.assertNotIn("TorchImportHook", out["hooks"])
        self.assertNotEqual(out["loader"], "_Loader")
        self.assertNotIn("leasehold", proc.stderr, "a CPU torch is not an error")

    def test_cpu_job_is_not_installed(self):
        self.need_torch()
        proc = run_child("""
            import json, torch
            import leasehold.torch as lt
            print(json.dumps(lt.install_status()))
        """, self.SITE_PATH, {"JOB_ID": 42, "DEVICE": "cpu"})
        out = self.result(proc)
        self.assertTrue(out["attempted"])
        self.assertFalse(out["installed"])
        self.assertIn("cpu", out["reason"])

    def test_a_script_without_torch_never_imports_it(self):
        proc = run_child("""
            import json, sys
            print(json.dumps({"torch": "torch" in sys.modules,
                              "leasehold": "leasehold" in sys.modules,
                              "hooked": any(type(f).__name__ == "TorchImportHook"
                                            for f in sys.meta_path)}))
        """, self.SITE_PATH, {"JOB_ID": 42, "DEVICE": "cuda:0"})
        self.assertEqual(self.result(proc), {"torch": False, "leasehold": False, "hooked": True})

    def test_inactive_outside_a_job(self):
        self.need_torch()
        proc = run_child("""
            import json, sys, torch
            import leasehold.torch as lt
            print(json.dumps({"attempted": lt.install_status()["attempted"],
                              "hooked": any(type(f).__name__ == "TorchImportHook"
                                            for f in sys.meta_path)}))
        """, self.SITE_PATH)
        self.assertEqual(self.result(proc), {"attempted": False, "hooked": False})

    def test_the_next_sitecustomize_runs(self):
        other = os.path.join(self.tmp, "other_site")
        os.makedirs(other, exist_ok=True)
        with open(os.path.join(other, "sitecustomize.py"), "w") as f:
            f.write("import builtins\nbuiltins.other_sitecustomize_ran = "
                    "getattr(builtins, 'other_sitecustomize_ran', 0) + 1\n")
        script = """
            import builtins, json, sitecustomize
            print(json.dumps({"ran": getattr(builtins, "other_sitecustomize_ran", 0),
                              "ours": sitecustomize.__file__,
                              "next": getattr(sitecustomize.next_sitecustomize, "__file__", None)}))
        """
        for env in ({"JOB_ID": 7}, {}):
            with self.subTest(env=env):
                out = self.result(run_child(script, self.SITE_PATH + [other], env))
                self.assertEqual(out["ran"], 1)
                self.assertEqual(os.path.realpath(out["ours"]),
                                 os.path.realpath(os.path.join(SITE_DIR, "sitecustomize.py")))
                self.assertEqual(os.path.realpath(out["next"]),
                                 os.path.realpath(os.path.join(other, "sitecustomize.py")))


FAKE_TORCH = {
    "torch/__init__.py": """
        __version__ = "2.11.0+fake"
        class version:
            cuda = "12.8"
        from . import _C, cuda, backends
    """,
    # As in torch: the property's ContextProp holds the setter it was made
    # with; flags() looks torch._C._set_cudnn_benchmark up at each call.
    "torch/_C.py": """
        _benchmark = [False]
        def _get_cudnn_benchmark():
            return _benchmark[0]
        def _set_cudnn_benchmark(on):
            _benchmark[0] = bool(on)
    """,
    "torch/backends/__init__.py": """
        import contextlib, sys, types
        import torch
        class ContextProp:
            def __init__(self, getter, setter):
                self.getter, self.setter = getter, setter
            def __get__(self, obj, objtype):
                return self.getter()
            def __set__(self, obj, val):
                self.setter(val)
        class CudnnModule(types.ModuleType):
            benchmark = ContextProp(torch._C._get_cudnn_benchmark, torch._C._set_cudnn_benchmark)
            @contextlib.contextmanager
            def flags(self, benchmark=False):
                old = torch._C._get_cudnn_benchmark()
                torch._C._set_cudnn_benchmark(benchmark)
                try:
                    yield
                finally:
                    torch._C._set_cudnn_benchmark(old)
        cudnn = CudnnModule("torch.backends.cudnn")
    """,
    "torch/cuda/__init__.py": """
        import os
        def is_initialized():
            return os.environ.get("FAKE_TORCH_CUDA_INITIALIZED") == "1"
        from . import memory
    """,
    "torch/cuda/memory.py": """
        import ctypes
        calls = []
        class _Native:
            def set_record_stream_fn(self, address):
                calls.append(["record_stream", address])
            def set_reset_fn(self, address):
                calls.append(["reset", address])
        class CUDAPluggableAllocator:
            def __init__(self, path, alloc_fn_name, free_fn_name):
                lib = ctypes.CDLL(path)
                calls.append(["create", path,
                              ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value,
                              ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value])
                self._allocator = _Native()
            def allocator(self):
                return self._allocator
        def change_current_allocator(allocator):
            calls.append(["change"])
    """,
}

FAKE_PLUGIN_C = r"""
#include <stdint.h>
#include <stddef.h>
struct leasehold_torch_stats { uint64_t v[11]; };
void* leasehold_torch_alloc(long size, int device, void* stream) { return NULL; }
void leasehold_torch_free(void* p, long size, int device, void* stream) {}
void leasehold_torch_record_stream(void* p, void* stream) {}
void leasehold_torch_empty_cache(void) {}
int leasehold_torch_stats(struct leasehold_torch_stats* out) {
  for (int i = 0; i < 11; ++i) out->v[i] = 1000 + i;
  return 0;
}
int leasehold_torch_standby_begin(void) { return 0; }
uint64_t leasehold_torch_standby_end(void) { return 0; }
static uint64_t (*pressure_fn)(uint64_t, void*);
static void* pressure_ctx;
void leasehold_torch_set_pressure_handler(uint64_t (*fn)(uint64_t, void*), void* ctx) {
  pressure_fn = fn;
  pressure_ctx = ctx;
}
/* What the plug-in does when an allocation finds no room (tests only). */
uint64_t fake_relieve(uint64_t bytes) { return pressure_fn ? pressure_fn(bytes, pressure_ctx) : 0; }
int leasehold_torch_abi_version(void) { return 5; }
"""


@unittest.skipUnless(os.access(CHILD_PYTHON, os.X_OK), "%s not found" % CHILD_PYTHON)
class FakeCudaTorchTest(unittest.TestCase):
    """install() against a fake CUDA torch and a fake plug-in."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="leasehold-fake-torch-")
        cls.torch_dir = os.path.join(cls.tmp, "fake_torch")
        for rel, text in FAKE_TORCH.items():
            path = os.path.join(cls.torch_dir, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(textwrap.dedent(text))
        cls.plugin = None
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc:
            src = os.path.join(cls.tmp, "fake_plugin.c")
            with open(src, "w") as f:
                f.write(FAKE_PLUGIN_C)
            so = os.path.join(cls.tmp, "libleasehold_torch.so")
            if subprocess.run([cc, "-shared", "-fPIC", "-o", so, src]).returncode == 0:
                cls.plugin = so

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        if self.plugin is None:
            self.skipTest("no C compiler to build the fake plug-in")

    def path(self):
        return [SITE_DIR, PYTHON_DIR, self.torch_dir]

    def test_install_sets_the_hooks_and_swaps_the_allocator(self):
        r, w = os.pipe()
        try:
            proc = run_child("""
                import ctypes, json, os, torch
                import leasehold, leasehold.torch as lt
                lib = ctypes.CDLL(os.environ["LEASEHOLD_TORCH_PLUGIN"])
                addr = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                ok = leasehold.report(step=5)
                print(json.dumps({
                    "status": lt.install_status(), "again": lt.install(),
                    "calls": torch.cuda.memory.calls, "ok": ok,
                    "want": {n: addr("leasehold_torch_" + n)
                             for n in ("alloc", "free", "record_stream", "empty_cache")},
                    "stats": lt.stats()}))
            """, self.path(), {"JOB_ID": 9, "DEVICE": "cuda:0", "TORCH_PLUGIN": self.plugin,
                               "REPORT_FD": w}, pass_fds=(w,))
        finally:
            os.close(w)
        with os.fdopen(r, "rb") as f:
            lines = [json.loads(x) for x in f.read().decode().splitlines()]
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stderr, "")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertTrue(out["status"]["installed"], out["status"])
        self.assertTrue(out["again"])
        want = out["want"]
        self.assertEqual(out["calls"], [
            ["create", self.plugin, want["alloc"], want["free"]],
            ["record_stream", want["record_stream"]],
            ["reset", want["empty_cache"]],
            ["change"],
        ])
        self.assertTrue(out["ok"])
        self.assertEqual(out["stats"]["leased_bytes"], 1000)
        self.assertEqual(out["stats"]["budget_bytes"], 1007)
        self.assertEqual(out["stats"]["unbacks"], 1009)
        self.assertEqual(out["stats"]["refused_allocations"], 1010)
        memory = {"type": "memory", "leased_bytes": 1000, "peak_leased_bytes": 1001,
                  "in_use_bytes": 1002, "peak_in_use_bytes": 1003, "allocations": 1004,
                  "cache_hits": 1005, "lease_requests": 1006, "spilled_bytes": 0,
                  "restored_bytes": 0}
        # The memory line after the report, and the last one at exit.
        self.assertEqual(lines, [{"type": "report", "step": 5}, memory, memory])

    def test_cudnn_benchmark_stays_off_and_says_so_once(self):
        proc = run_child("""
            import json, torch
            torch.backends.cudnn.benchmark = True
            after_property = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = True
            with torch.backends.cudnn.flags(benchmark=True):
                inside_flags = torch.backends.cudnn.benchmark
            print(json.dumps([after_property, inside_flags]))
        """, self.path(), {"JOB_ID": 9, "DEVICE": "cuda:0", "TORCH_PLUGIN": self.plugin})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(json.loads(proc.stdout.strip().splitlines()[-1]), [False, False])
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertIn("cudnn.benchmark stays off", lines[0])
        self.assertIn("cacheInfo", lines[0])

    def test_cudnn_benchmark_is_left_alone_outside_a_job(self):
        proc = run_child("""
            import torch
            torch.backends.cudnn.benchmark = True
            print(torch.backends.cudnn.benchmark)
        """, self.path(), {})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip().splitlines()[-1], "True")
        self.assertEqual(proc.stderr, "")

    def test_too_late_stops_the_script_with_one_line(self):
        proc = run_child("""
            import torch
            print("went on")
        """, self.path(), {"JOB_ID": 9, "DEVICE": "cuda:0", "TORCH_PLUGIN": self.plugin},
                           {"FAKE_TORCH_CUDA_INITIALIZED": "1"})
        self.assertEqual(proc.returncode, 1)
        self.assertNotIn("went on", proc.stdout)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertIn("already initialized", lines[0])
        self.assertIn("before the first CUDA allocation", lines[0])

    def test_an_unloadable_plugin_stops_the_script_with_one_line(self):
        proc = run_child("""
            import torch
            print("went on")
        """, self.path(), {"JOB_ID": 9, "DEVICE": "cuda:0",
                           "TORCH_PLUGIN": os.path.join(self.tmp, "missing.so")})
        self.assertEqual(proc.returncode, 1, proc.stderr)
        self.assertNotIn("went on", proc.stdout)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertTrue(lines[0].startswith("leasehold: cannot load the plug-in"), lines[0])
        self.assertIn("must come from its leases", lines[0])

    def test_explicit_install_before_import_does_not_install_twice(self):
        proc = run_child("""
            import json
            import leasehold.torch as lt
            first = lt.install()  # imports torch, whose import runs the hook too
            import torch
            print(json.dumps({"first": first, "changes": sum(
                1 for c in torch.cuda.memory.calls if c[0] == "change")}))
        """, self.path(), {"JOB_ID": 9, "DEVICE": "cuda:0", "TORCH_PLUGIN": self.plugin})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(json.loads(proc.stdout.strip().splitlines()[-1]),
                         {"first": True, "changes": 1})


try:
    import torch as _torch
except ImportError:
    _torch = None


@unittest.skipIf(_torch is None, "torch is not importable here")
class RegionLayoutTest(unittest.TestCase):
    """Tensors laid out in a region's bytes (leasehold.regions), as engine
    jobs lay theirs out, without a coordinator: a CPU byte tensor stands in
    for the region."""

    def layout(self, items):
        from leasehold import regions

        specs = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in items]
        _, total = regions._layout(specs)
        memory = _torch.zeros(total, dtype=_torch.uint8)
        regions._write(memory, items)
        return memory

    def test_tensors_of_every_kept_dtype_come_back_in_place(self):
        from leasehold import regions

        g = _torch.Generator().manual_seed(3)
        items = [("images", (_torch.rand(5, 1, 4, 4, generator=g) * 255).to(_torch.uint8)),
                 ("labels", _torch.arange(5)),
                 ("w", _torch.randn(3, 7, generator=g)),
                 ("half", _torch.randn(9, generator=g).to(_torch.bfloat16)),
                 ("mask", _torch.tensor([True, False, True])),
                 ("scalar", _torch.tensor(2.5, dtype=_torch.float64))]
        memory = self.layout(items)
        back = regions._read("t", memory)
        self.assertEqual([n for n, _ in back], [n for n, _ in items])
        for (_, want), (_, got) in zip(items, back):
            self.assertEqual(got.dtype, want.dtype)
            self.assertEqual(tuple(got.shape), tuple(want.shape))
            self.assertTrue(_torch.equal(got, want))
            self.assertEqual(got.data_ptr() % regions.ALIGN, memory.data_ptr() % regions.ALIGN)
        # Views, not copies: the region's bytes are the tensors' bytes.
        memory[back[1][1].data_ptr() - memory.data_ptr()] = 9
        self.assertEqual(int(back[1][1][0]), 9)
        self.assertEqual(regions.digest(back), regions.digest(back))
        self.assertNotEqual(regions.digest(back[:2]), regions.digest(back[1:3]))

    def test_the_engine_layout_is_kept(self):
        memory = self.layout([("fc.weight", _torch.ones(2, 3))])
        head = bytes(memory[:24].numpy().tobytes())
        self.assertEqual(head[:8], b"LHREGN1\n")
        # One entry (136 bytes) after the 24-byte head, then the CRC; the
        # tensor at the first 256-byte boundary; dtype 0 is the engine's float32.
        self.assertEqual(int(memory[24 + 64]), 0)
        self.assertEqual(int.from_bytes(bytes(memory[24 + 120:24 + 128].numpy()), "little"), 256)
        self.assertEqual(memory.numel(), 512)

    def test_a_damaged_header_or_an_odd_dtype_is_refused_by_name(self):
        from leasehold import regions

        memory = self.layout([("x", _torch.ones(4))])
        memory[30] ^= 1
        with self.assertRaisesRegex(regions.RegionError, "'ds'.*checksum"):
            regions._read("ds", memory)
        good = self.layout([("x", _torch.ones(4))])
        import struct
        import zlib
        header = bytearray(good[:24 + 136].numpy().tobytes())
        header[24 + 72:24 + 80] = struct.pack("<q", 5)  # dims[0] = 5: 20 bytes, not 16
        crc = struct.pack("<I", zlib.crc32(bytes(header)))
        good[:24 + 136] = _torch.frombuffer(bytearray(header), dtype=_torch.uint8)
        good[24 + 136:24 + 140] = _torch.frombuffer(bytearray(crc), dtype=_torch.uint8)
        with self.assertRaisesRegex(regions.RegionError, "entry 'x' is not valid .*16 bytes"):
            regions._read("ds", good)
        with self.assertRaisesRegex(regions.RegionError, "does not hold tensors"):
            regions._read("ds", _torch.zeros(1024, dtype=_torch.uint8))
        with self.assertRaisesRegex(TypeError, "complex64"):
            self.layout([("z", _torch.zeros(2, dtype=_torch.complex64))])
        with self.assertRaisesRegex(ValueError, "longer than 63"):
            self.layout([("n" * 64, _torch.zeros(2))])
        with self.assertRaisesRegex(TypeError, "dict of tensors"):
            regions._named(_torch.zeros(2), "build()")

    def test_outside_a_job_regions_say_so(self):
        from leasehold import regions

        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop("LEASEHOLD_JOB_ID", None)
            with self.assertRaisesRegex(regions.RegionError, "only inside a Leasehold program job"):
                leasehold.region("x", 16, fill=lambda t: None)


@unittest.skipIf(_torch is None, "torch is not importable here")
class SpillTest(unittest.TestCase):
    """The saved-tensor hooks of leasehold.spill on CPU tensors (CUDA ones
    on the GPU host): what is spilled comes back bit for bit."""

    def train(self, spiller, steps=3):
        _torch.manual_seed(0)
        model = _torch.nn.Sequential(_torch.nn.Linear(64, 128), _torch.nn.GELU(),
                                     _torch.nn.Linear(128, 128), _torch.nn.Tanh(),
                                     _torch.nn.Linear(128, 10))
        opt = _torch.optim.SGD(model.parameters(), lr=0.1)
        x = _torch.randn(256, 64)
        y = _torch.randint(0, 10, (256,))
        grads = []
        for _ in range(steps):
            opt.zero_grad()
            if spiller is None:
                loss = _torch.nn.functional.cross_entropy(model(x), y)
            else:
                with _torch.autograd.graph.saved_tensors_hooks(spiller.pack, spiller.unpack):
                    loss = _torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return grads

    def test_gradients_are_bit_identical_and_the_host_tier_is_given_back(self):
        from leasehold.spill import Spiller

        plain = self.train(None)
        # Pressure at every save (the forward), room for prefetches in the
        # backward.
        spiller = Spiller(8 << 20, min_bytes=1, pressure=lambda n: n == 0,
                          device_types=("cpu",), slab_bytes=64 << 10)
        spilled = self.train(spiller)
        for a, b in zip(plain, spilled):
            for ga, gb in zip(a, b):
                self.assertTrue(_torch.equal(ga, gb))
        stats = spiller.stats()
        self.assertGreater(stats["spilled_tensors"], 6)
        self.assertEqual(stats["spilled_bytes"], stats["restored_bytes"])
        self.assertGreater(stats["prefetched"], 0)
        self.assertEqual(stats["host_free_bytes"], 8 << 20)  # every range given back
        self.assertEqual(spiller.pending, [])
        # Pinned in slabs as needed, not all at once.
        self.assertGreater(stats["host_allocated_bytes"], 0)

    def test_no_pressure_or_no_room_keeps_tensors_where_they_are(self):
        from leasehold.spill import Spiller

        calm = Spiller(8 << 20, min_bytes=1, pressure=lambda n: False, device_types=("cpu",))
        self.train(calm, steps=1)
        self.assertEqual(calm.stats()["spilled_tensors"], 0)
        self.assertGreater(calm.stats()["saved_tensors"], 0)
        tight = Spiller(1024, min_bytes=1, pressure=lambda n: True, device_types=("cpu",),
                        slab_bytes=512)
        plain = self.train(None, steps=1)
        got = self.train(tight, steps=1)
        self.assertGreater(tight.stats()["host_full"], 0)
        for ga, gb in zip(plain[0], got[0]):
            self.assertTrue(_torch.equal(ga, gb))

    def test_a_graph_dropped_before_backward_gives_its_ranges_back(self):
        from leasehold.spill import Spiller

        spiller = Spiller(8 << 20, min_bytes=1, pressure=lambda n: True, device_types=("cpu",))
        model = _torch.nn.Linear(32, 32)
        with _torch.autograd.graph.saved_tensors_hooks(spiller.pack, spiller.unpack):
            out = model(_torch.randn(64, 32)).relu().sum()
        self.assertLess(spiller.stats()["host_free_bytes"], 8 << 20)
        del out
        import gc
        gc.collect()
        self.assertEqual(spiller.stats()["host_free_bytes"], 8 << 20)

    def test_a_tensor_saved_twice_is_spilled_once(self):
        from leasehold.spill import Spiller

        spiller = Spiller(8 << 20, min_bytes=1, pressure=lambda n: True, device_types=("cpu",))
        x = _torch.randn(64, 32, requires_grad=True)
        with _torch.autograd.graph.saved_tensors_hooks(spiller.pack, spiller.unpack):
            h = _torch.tanh(x)
            y = (h * h).sum() + (h @ h.t()).sum()
        y.backward()
        self.assertGreater(spiller.stats()["deduplicated"], 0)
        x2 = x.detach().clone().requires_grad_()
        h2 = _torch.tanh(x2)
        ((h2 * h2).sum() + (h2 @ h2.t()).sum()).backward()
        self.assertTrue(_torch.equal(x.grad, x2.grad))

    def test_pressure_spills_the_oldest_saved_tensors_first(self):
        from leasehold.spill import Spiller

        # Room on the device for three saved tensors: each save past that
        # spills the oldest record still there, never the one just saved.
        spiller = Spiller(8 << 20, min_bytes=1, device_types=("cpu",),
                          pressure=lambda n: len(spiller.resident) > 3)
        x = _torch.randn(64, 32, requires_grad=True)
        with _torch.autograd.graph.saved_tensors_hooks(spiller.pack, spiller.unpack):
            h = x
            for _ in range(6):
                h = _torch.tanh(h) * 1.5
            y = h.sum()
        stats = spiller.stats()
        self.assertGreater(stats["spilled_tensors"], 0)
        on_device = sorted(spiller.resident)
        self.assertEqual(len(on_device), 3)
        self.assertTrue(spiller.pending)
        self.assertLess(max(spiller.pending), min(on_device))  # oldest out, newest kept
        y.backward()
        x2 = x.detach().clone().requires_grad_()
        h2 = x2
        for _ in range(6):
            h2 = _torch.tanh(h2) * 1.5
        h2.sum().backward()
        self.assertTrue(_torch.equal(x.grad, x2.grad))
        self.assertEqual(spiller.stats()["host_free_bytes"], 8 << 20)

    def test_relieve_spills_what_the_allocator_asks_and_backward_brings_it_back(self):
        from leasehold.spill import Spiller

        # The plug-in's pressure handler, called between forward and backward
        # (where a backward's peak finds no room): nothing was spilled before.
        spiller = Spiller(8 << 20, min_bytes=1, pressure=lambda n: False, device_types=("cpu",))
        model = _torch.nn.Sequential(_torch.nn.Linear(32, 64), _torch.nn.Tanh(),
                                     _torch.nn.Linear(64, 64), _torch.nn.Tanh())
        x = _torch.randn(128, 32)
        with _torch.autograd.graph.saved_tensors_hooks(spiller.pack, spiller.unpack):
            loss = model(x).square().sum()
        self.assertEqual(spiller.stats()["spilled_tensors"], 0)
        freed = spiller.relieve(40000)
        self.assertGreaterEqual(freed, 40000)
        stats = spiller.stats()
        self.assertEqual(stats["relieved"], 1)
        self.assertEqual(stats["relieved_bytes"], freed)
        self.assertGreater(stats["resident_tensors"], 0)  # only as much as asked
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).square().sum().backward()
        for a, b in zip(got, [p.grad for p in model.parameters()]):
            self.assertTrue(_torch.equal(a, b))
        self.assertEqual(spiller.stats()["restored_bytes"], freed)
        self.assertEqual(spiller.relieve(1 << 20), 0)  # nothing left on the device

    def test_views_come_back_with_their_strides_and_share_their_root(self):
        from leasehold.spill import Spiller

        spiller = Spiller(8 << 20, min_bytes=1, pressure=lambda n: False, device_types=("cpu",))
        qkv = _torch.randn(4, 8, 3 * 16)
        q, k = qkv[..., :16].transpose(0, 1), qkv[..., 16:32].transpose(0, 1)
        pq, pk = spiller.pack(q), spiller.pack(k)
        self.assertIs(pq.rec, pk.rec)  # one record: the root's
        self.assertEqual(spiller.relieve(1), qkv.numel() * qkv.element_size())
        for view, packed in ((q, pq), (k, pk)):
            back = spiller.unpack(packed)
            self.assertEqual(back.stride(), view.stride())
            self.assertTrue(_torch.equal(back, view))
        # A view that reads its root as another type, or as its conjugate,
        # stays as it is.
        c = _torch.randn(4, 8, 16, dtype=_torch.cfloat)
        for other in (_torch.view_as_real(c)[1:], c.conj()[1:]):
            self.assertIs(other._base, c)
            self.assertIs(spiller.pack(other), other)
        # A channels-last root comes back channels-last.
        nhwc = _torch.randn(2, 3, 4, 5).to(memory_format=_torch.channels_last)
        packed = spiller.pack(nhwc)
        spiller.relieve(1)
        back = spiller.unpack(packed)
        self.assertEqual(back.stride(), nhwc.stride())
        self.assertTrue(_torch.equal(back, nhwc))

    def test_the_plug_ins_pressure_handler_reaches_relieve(self):
        cc = shutil.which("cc") or shutil.which("gcc")
        if not cc:
            self.skipTest("no C compiler to build the fake plug-in")
        tmp = tempfile.mkdtemp(prefix="leasehold-fake-plugin-")
        self.addCleanup(shutil.rmtree, tmp, True)
        src, so = os.path.join(tmp, "fake.c"), os.path.join(tmp, "libfake.so")
        with open(src, "w") as f:
            f.write(FAKE_PLUGIN_C)
        self.assertEqual(subprocess.run([cc, "-shared", "-fPIC", "-o", so, src]).returncode, 0)
        lib = ctypes.CDLL(so)
        leasehold.torch._declare(lib)
        lib.fake_relieve.argtypes, lib.fake_relieve.restype = [ctypes.c_uint64], ctypes.c_uint64
        asked = []

        def relieve(nbytes):
            asked.append(nbytes)
            if nbytes == 13:
                raise RuntimeError("cannot spill")
            return 2 * nbytes

        with mock.patch.object(leasehold.torch, "_plugin", lib):
            leasehold.torch._set_pressure_handler(relieve)
            self.assertEqual(lib.fake_relieve(1 << 40), 2 << 40)  # 64-bit both ways
            with self.assertLogs("leasehold.torch", "WARNING"):
                self.assertEqual(lib.fake_relieve(13), 0)  # a failure frees nothing
            leasehold.torch._set_pressure_handler(None)
            self.assertEqual(lib.fake_relieve(5), 0)  # removed
        self.assertEqual(asked, [1 << 40, 13])

    def test_copies_go_in_the_computes_order_once_the_forward_waited_for_them(self):
        from leasehold.spill import Spiller

        class Event:
            def __init__(self):
                self.waited = False

            def query(self):
                return False  # still copying

            def synchronize(self):
                self.waited = True

        chosen = Spiller(1 << 20, max_in_flight=100, overlap=True)
        auto = Spiller(1 << 20, max_in_flight=100)
        for spiller in (auto, chosen):
            self.assertTrue(spiller.stats()["overlap"])
            # A wait outside a save (a Shrink's relief, a backward) is no
            # forward short of room: nothing changes.
            spiller._throttle(Event(), 150)
            self.assertEqual(spiller.stats()["waits"], 1)
            self.assertTrue(spiller.stats()["overlap"])
            self.assertEqual(spiller.in_flight_bytes, 0)
            spiller._saving = True  # inside pack's spilling
            first = Event()
            spiller._throttle(first, 60)
            spiller._throttle(Event(), 30)  # 90 in flight: room still
            self.assertFalse(first.waited)
            self.assertTrue(spiller.stats()["overlap"])
            spiller._throttle(Event(), 30)  # 120: the oldest is waited for
            self.assertTrue(first.waited)
            self.assertEqual(spiller.stats()["waits"], 2)
            self.assertEqual(spiller.in_flight_bytes, 60)
        self.assertFalse(auto.stats()["overlap"])
        self.assertTrue(chosen.stats()["overlap"], "overlap=True is kept")
        self.assertFalse(Spiller(1 << 20, overlap=False).stats()["overlap"])

    def test_copies_on_several_streams_wait_for_the_one_before(self):
        from leasehold.spill import Spiller

        class Stream:
            def __init__(self, raw):
                self.cuda_stream, self.waited_for = raw, []

            def wait_stream(self, other):
                self.waited_for.append(other.cuda_stream)

        # The host tier's ranges are reused in the order copies are
        # queued: copy streams of two devices, then copies in order on
        # two compute streams.
        spiller = Spiller(1 << 20)
        copy0, copy1, a, b = Stream(10), Stream(11), Stream(1), Stream(2)
        self.assertIs(spiller._after_last_copy(copy0), copy0)
        spiller._after_last_copy(copy0)
        self.assertEqual(copy0.waited_for, [], "one stream never waits for itself")
        spiller._after_last_copy(copy1)
        self.assertEqual(copy1.waited_for, [10])
        spiller._after_last_copy(a)  # the first copy in order, after the switch
        self.assertEqual(a.waited_for, [11])  # and through it, copy0's
        spiller._after_last_copy(a)
        spiller._after_last_copy(b)
        self.assertEqual(b.waited_for, [1])
        spiller._after_last_copy(a)
        self.assertEqual(a.waited_for, [11, 2])

    def test_the_bytes_spilled_in_all_never_go_down_when_spilling_restarts(self):
        lt = leasehold.torch
        self.addCleanup(lt.spill, False)
        before = lt.spilled_bytes_total(), lt.restored_bytes_total()
        first = lt.spill(True, host_bytes=1 << 20)
        first.counts["spilled_bytes"] += 100  # as if it had spilled
        first.counts["restored_bytes"] += 60  # and brought some back
        expected = (before[0] + 100, before[1] + 60)
        self.assertEqual((lt.spilled_bytes_total(), lt.restored_bytes_total()), expected)
        lt.spill(True, host_bytes=1 << 20)  # a script turning it on again
        self.assertEqual((lt.spilled_bytes_total(), lt.restored_bytes_total()), expected)
        lt.spill(False)
        self.assertEqual((lt.spilled_bytes_total(), lt.restored_bytes_total()), expected)

    def test_the_budget_check_reads_the_plug_ins_figures(self):
        from leasehold.spill import Spiller

        spiller = Spiller(1 << 20, device_types=("cpu",))
        self.assertFalse(spiller.pressure(1))  # no plug-in here: never
        figures = leasehold.torch._Stats()
        spiller._stats = (lambda ref: 0, None, figures)
        self.assertFalse(spiller.pressure(1 << 30))  # no budget known
        figures.budget_bytes, figures.in_use_bytes = 1000, 700
        self.assertFalse(spiller.pressure(100))  # 800 = 80%: not past it
        self.assertTrue(spiller.pressure(101))
        spiller._stats = (lambda ref: -1, None, figures)
        self.assertFalse(spiller.pressure(1 << 30))  # no figures: no spilling

    def test_host_ranges_merge_when_freed(self):
        from leasehold.spill import _HostRanges

        r = _HostRanges(4096)
        a, b, c = r.take(100), r.take(1000), r.take(256)
        self.assertEqual([a[0], b[0], c[0]], [0, 256, 1280])
        self.assertIsNone(r.take(4096))
        r.give(*b)
        r.give(*a)
        r.give(*c)
        self.assertEqual(r.free, [(0, 4096)])


if __name__ == "__main__":
    unittest.main()

"""Whether AOTInductor loads and runs a package on this machine, and under which conditions.

    python scripts/aoti_load_probe.py [OUT_DIR]

Builds the package of a plain ``nn.Linear`` (nothing of mhc's), then loads and runs it in a fresh
process per variant. First two loads that skip the package loader: PyTorch's model-container
runner on the package's own ``.so`` (kernel binaries beside it), and on the ``.so`` of
``torch._inductor.aot_compile``. Then the package loader, with the native frames of a crash
(SIGSEGV) under ``gdb`` where the machine has it, else from a signal handler preloaded into the
process (built with the machine's C compiler); two steps of its load alone (reading the
package's metadata, ``dlopen`` of its ``.so``); and its variants: as it is, after a CUDA tensor
exists (the device's primary context current on the loading thread), after the saved inputs are
loaded, single-threaded, with the device index given. A crash shows as a negative exit status
and Python's fault handler's trace. Prints one line per variant with its time, and the shared
libraries the package's ``.so`` needs.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import torch

LOAD = """
import sys, torch
package, cases = sys.argv[1], sys.argv[2]
{before}
loaded = torch._inductor.aoti_load_package(package{options})
x, want = torch.load(cases)
torch.testing.assert_close(loaded(x), want)
print("ok")
"""

# steps of the load on their own: where in it the crash is
STEPS = {
    "the package's metadata only": "torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(package, 'model')",
    "dlopen of the package's .so": (
        "import ctypes, zipfile, tempfile; d = tempfile.mkdtemp(); z = zipfile.ZipFile(package);"
        "so = [n for n in z.namelist() if n.endswith('.so')][0]; z.extractall(d); ctypes.CDLL(d + '/' + so)"
    ),
}

# the model-container runner on a .so, without the package loader (argv[1] is then the .so)
RUNNER = """
import sys, torch
so, cases = sys.argv[1], sys.argv[2]
runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda", {cubin_dir!r})
x, want = torch.load(cases)
torch.testing.assert_close(runner.run([x])[0], want)
print("ok")
"""

# prints the native frames of a SIGSEGV (on a stack of its own, in case the stack overflowed)
BACKTRACE_C = r"""
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
static void on_fault(int sig) {
    void *frames[64];
    int count = backtrace(frames, 64);
    backtrace_symbols_fd(frames, count, 2);
    _exit(128 + sig);
}
__attribute__((constructor)) static void install(void) {
    stack_t stack = {.ss_sp = malloc(1 << 16), .ss_size = 1 << 16, .ss_flags = 0};
    sigaltstack(&stack, 0);
    struct sigaction action = {0};
    action.sa_handler = on_fault;
    action.sa_flags = SA_ONSTACK;
    sigaction(SIGSEGV, &action, 0);
}
"""

VARIANTS = {
    "as it is": ("", ""),
    "a CUDA tensor first": ("torch.zeros(1, device='cuda')", ""),
    "cases loaded first": ("torch.load(cases)", ""),
    "single threaded": ("", ", run_single_threaded=True"),
    "device index 0": ("", ", device_index=0"),
}


def _run(name, code, package, cases, prefix=(), env=None, native=False):
    start = time.perf_counter()
    python = [sys.executable] if native else [sys.executable, "-X", "faulthandler"]
    run = subprocess.run(
        [*prefix, *python, "-c", code, package, cases], capture_output=True, text=True, timeout=300, env=env
    )
    print(f"{name}: exit status {run.returncode} ({time.perf_counter() - start:.0f} s)", flush=True)
    if run.returncode != 0 or prefix or native:
        tail = (run.stdout + run.stderr).strip().splitlines()
        if native:
            demangle = subprocess.run(["c++filt"], input="\n".join(tail), capture_output=True, text=True)
            tail = (demangle.stdout or "\n".join(tail)).splitlines()
            keep = tail[-40:]
        else:
            keep = [line for line in tail if " in " in line or line.startswith("#")][-25:] or tail[-6:]
        print("    " + "\n    ".join(keep), flush=True)


def _backtrace_library(out_dir):
    """A shared library whose SIGSEGV handler prints the native frames, or None without a compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, library = os.path.join(out_dir, "backtrace.c"), os.path.join(out_dir, "backtrace.so")
    with open(source, "w") as f:
        f.write(BACKTRACE_C)
    built = subprocess.run([compiler, "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    return library if built.returncode == 0 else None


def main(out_dir: str) -> None:
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    print("C++ compiler of the package:", torch._inductor.config.cpp.cxx, flush=True)
    linear = torch.nn.Linear(64, 64).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        exported = torch.export.export(linear, (x,))
        package = torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(out_dir, "linear.pt2"))
        cases = os.path.join(out_dir, "cases.pt")
        torch.save((x, linear(x)), cases)
    unpacked = os.path.join(out_dir, "unpacked")
    with zipfile.ZipFile(package) as z:
        libraries = [n for n in z.namelist() if n.endswith(".so")]
        z.extractall(unpacked)
    for name in libraries:
        ldd = subprocess.run(["ldd", os.path.join(unpacked, name)], capture_output=True, text=True)
        print(f"ldd {name}:\n{ldd.stdout}{ldd.stderr}", flush=True)
    # the loads without the package loader first: they do not crash where it does
    model_so = os.path.join(unpacked, libraries[0])
    _run("the runner on the package's .so", RUNNER.format(cubin_dir=os.path.dirname(model_so)), model_so, cases)
    with torch.no_grad():
        legacy_so = torch._inductor.aot_compile(exported.module(), (x,))
    _run("the runner on aot_compile's .so", RUNNER.format(cubin_dir=""), legacy_so, cases)
    # then the native frames of the crash: each crashing load takes most of a minute
    if shutil.which("gdb"):
        _run(
            "as it is, under gdb",
            LOAD.format(before="", options=""),
            package,
            cases,
            ("gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args"),
        )
    else:
        library = _backtrace_library(out_dir)
        if library is None:
            print("no gdb and no C compiler on this machine", flush=True)
        else:
            _run(
                "as it is, native frames from a preloaded handler",
                LOAD.format(before="", options=""),
                package,
                cases,
                env={**os.environ, "LD_PRELOAD": library},
                native=True,
            )
    for name, step in STEPS.items():
        _run(
            name,
            "import sys, torch\npackage, cases = sys.argv[1], sys.argv[2]\n" + step + "\nprint('ok')",
            package,
            cases,
        )
    for name, (before, options) in VARIANTS.items():
        _run(name, LOAD.format(before=before, options=options), package, cases)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())

"""Whether AOTInductor loads and runs a package on this machine, and under which conditions.

    python scripts/aoti_load_probe.py [OUT_DIR]

Builds the package of a plain ``nn.Linear`` (nothing of mhc's), then loads and runs it in a fresh
process per variant: as it is; after a CUDA tensor exists (the device's primary context current
on the loading thread); after the saved inputs are loaded; single-threaded; with the device index
given; and two steps of the load alone (reading the package's metadata, ``dlopen`` of its
``.so``). A crash (SIGSEGV) shows as a negative exit status and Python's fault handler's trace,
with the native frames under ``gdb`` where the machine has it. Prints one line per variant, and
the shared libraries the package's ``.so`` needs.
"""

import os
import shutil
import subprocess
import sys
import tempfile
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
        "so = [n for n in z.namelist() if n.endswith('.so')][0]; z.extractall(d); ctypes.CDLL(d + '/' + so)"),
}

VARIANTS = {
    "as it is": ("", ""),
    "a CUDA tensor first": ("torch.zeros(1, device='cuda')", ""),
    "cases loaded first": ("torch.load(cases)", ""),
    "single threaded": ("", ", run_single_threaded=True"),
    "device index 0": ("", ", device_index=0"),
}


def _run(name, code, package, cases, prefix=()):
    run = subprocess.run([*prefix, sys.executable, "-X", "faulthandler", "-c", code, package, cases],
                         capture_output=True, text=True, timeout=300)
    print(f"{name}: exit status {run.returncode}", flush=True)
    if run.returncode != 0 or prefix:
        tail = (run.stdout + run.stderr).strip().splitlines()
        keep = [line for line in tail if " in " in line or line.startswith("#")][-25:] or tail[-6:]
        print("    " + "\n    ".join(keep), flush=True)


def main(out_dir: str) -> None:
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    linear = torch.nn.Linear(64, 64).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        exported = torch.export.export(linear, (x,))
        package = torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(out_dir, "linear.pt2"))
        cases = os.path.join(out_dir, "cases.pt")
        torch.save((x, linear(x)), cases)
    with zipfile.ZipFile(package) as z:
        libraries = [n for n in z.namelist() if n.endswith(".so")]
        z.extractall(os.path.join(out_dir, "unpacked"), libraries)
    for name in libraries:
        ldd = subprocess.run(["ldd", os.path.join(out_dir, "unpacked", name)], capture_output=True, text=True)
        print(f"ldd {name}:\n{ldd.stdout}{ldd.stderr}", flush=True)
    # the native frames first: each crashing variant takes most of a minute
    if shutil.which("gdb"):
        _run("as it is, under gdb", LOAD.format(before="", options=""), package, cases,
             ("gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args"))
    else:
        print("no gdb on this machine", flush=True)
    for name, step in STEPS.items():
        _run(name, "import sys, torch\npackage, cases = sys.argv[1], sys.argv[2]\n" + step + "\nprint('ok')",
             package, cases)
    for name, (before, options) in VARIANTS.items():
        _run(name, LOAD.format(before=before, options=options), package, cases)

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())

"""Launching two-process CPU (gloo) runs for the tests, with one retry of a crashed worker.

PyTorch's gloo transport occasionally kills a worker by a signal on CPU (seen: SIGSEGV inside
the full-state-dict gather of an FSDP2 run, SIGABRT "terminate called without an active
exception" at process-group teardown), about once in a few dozen launches, with nothing wrong
in the run itself. A launch whose worker died by a signal is retried once, with a warning;
a run that exits with an error or produces a wrong result is never retried.
"""

import subprocess
import sys
import warnings

CRASH_SIGNATURES = ("Signal 11 (SIGSEGV)", "Signal 6 (SIGABRT)")


def torchrun(script_and_args, *, env, cwd, timeout, nproc: int = 2) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=<nproc> ...``; raises
    ``AssertionError`` with the output's tail when the launch fails (twice if it crashed)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *map(str, script_and_args),
    ]
    for attempt in range(2):
        done = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
        if done.returncode == 0:
            return done
        crashed = any(sig in done.stderr for sig in CRASH_SIGNATURES)
        if not crashed or attempt == 1:
            break
        warnings.warn(f"a gloo worker died by a signal; retrying once:\n{done.stderr[-1500:]}")
    raise AssertionError(f"torchrun failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")

"""A 2-process run without a launcher's start: the processes are forked from a server that has already imported
torch, Accelerate, timm and common/, and get the environment that a real `accelerate launch` gives its workers
(recorded from one real launch per test session). Each runs the script as `python script.py` would (`__main__`,
its exit code, its atexit handlers), so what a test reads of such a run (files, output, exit code) is what a launch
leaves; what it saves is two interpreters with their imports and the launcher's (about 20 CPU-seconds on a 2-core
CPU). For runs a test reads; a test about the launcher itself (signals, restarts, machines, its refusals) launches
a real one (conftest.launch)."""

import atexit
import io
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# what every script imports before its first step (torch._dynamo: the optimizer's first step imports it), for the
# first step's line (psutil: the launch clock) and at its end (matplotlib: the plots)
PRELOAD = ["torch", "torch._dynamo", "torchvision", "accelerate", "timm", "common.run", "common.distributed",
           "common.checkpoint", "common.folders", "common.models", "common.reporting", "matplotlib.figure",
           "matplotlib.backends.backend_agg", "psutil", "warm"]
# torchrun's keys that name the launcher's own run: its store (rank 0 hosts one here), its error files, its port
NOT_KEPT = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT")
TERMINATE_GRACE_S = 30  # torchrun's: how long the others get after a SIGTERM when one process failed

_server = None
_environments = {}


def launch(script, *args, processes=2, env=None, cwd=None, timeout=600):
    """`accelerate launch --num_processes N script args` as the tests' launch() captures it (returncode 0, or 1 when
    a process failed, as the launcher's; stdout, stderr, output), each process forked from the warm server."""
    context, port = _context(), _free_port()
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        started = []
        for rank_env in launch_environment(processes):
            child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **rank_env, **(env or {}), "MASTER_PORT": str(port)}
            process = context.Process(target=_run_script, args=(str(script), list(map(str, args)), child_env,
                                                                  str(cwd or Path.cwd()), str(out), str(err)))
            process.start()
            started.append(process)
        codes = _wait(started, timeout)
        result = subprocess.CompletedProcess([script, *args], int(any(codes)),
                                             *(f.read_text(errors="replace") if f.exists() else "" for f in (out, err)))
    result.output, result.exit_codes = result.stdout + result.stderr, codes
    return result


def launch_environment(processes):
    """What a real `accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes N` adds to or
    changes in each worker's environment, rank by rank, measured once."""
    if processes not in _environments:
        repo = Path(__file__).resolve().parents[1]
        with tempfile.TemporaryDirectory() as folder:
            probe = Path(folder) / "probe.py"
            probe.write_text("import json, os, sys\n"
                             "with open(os.path.join(sys.argv[1], os.environ['RANK']), 'w') as f:\n"
                             "    json.dump(dict(os.environ), f)")
            subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(repo / "accelerate_configs" / "cpu.yaml"), "--num_processes", str(processes),
                            str(probe), folder], check=True, capture_output=True, cwd=repo)
            ranks = [json.loads((Path(folder) / str(rank)).read_text()) for rank in range(processes)]
        _environments[processes] = [{k: v for k, v in environ.items() if os.environ.get(k) != v and k not in NOT_KEPT}
                                    for environ in ranks]
    return _environments[processes]


def _context():
    global _server
    if _server is None:
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload(PRELOAD)
    return _server


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(processes, timeout):
    """The exit codes, once all have ended. The first failure ends the others (SIGTERM, then SIGKILL after
    TERMINATE_GRACE_S), as torchrun does; past `timeout` all are killed and it is a TimeoutError."""
    pending, deadline, stopping, late = list(processes), time.monotonic() + timeout, False, False
    while pending:
        if not multiprocessing.connection.wait([p.sentinel for p in pending], max(0, deadline - time.monotonic())):
            late = late or not stopping
            for process in pending:
                process.kill()
            deadline = math.inf
        for process in [p for p in pending if not p.is_alive()]:
            pending.remove(process)
            if process.exitcode and not stopping:
                stopping, deadline = True, min(deadline, time.monotonic() + TERMINATE_GRACE_S)
                for other in pending:
                    other.terminate()
    if late:
        raise TimeoutError(f"the processes ran past {timeout} s")
    return [process.exitcode for process in processes]


def _run_script(script, args, env, cwd, out, err):
    """In the forked process: `python script args` with `env` in `cwd`, its output onto `out` and `err`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):  # both processes append, as onto a launcher's inherited descriptors
        file = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True) for fd in (1, 2))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # a process the forkserver starts has its start method (forkserver) as the default; a launched script has the
    # platform's (fork), so its DataLoader workers are forked from it, not from a new server it would have to start
    multiprocessing.set_start_method(None, force=True)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))  # read at import, in the server
    sys.argv, sys.path[0] = [script, *args], str(Path(script).parent)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    finally:
        atexit._run_exitfuncs()  # the script's, as the interpreter's exit runs them (multiprocessing's does not)
    sys.exit(code)

"""A 2-process run without a launcher's start: the processes are forked from a server that has already imported
torch, Accelerate, timm and common/, and get the environment that a real `accelerate launch` gives its workers
(recorded from one real launch per test session). Each runs the script as `python script.py` would (`__main__`,
its exit code, its atexit handlers), so what a test reads of such a run (files, output, exit code) is what a launch
leaves; what it saves is two interpreters with their imports and the launcher's (about 20 CPU-seconds on a 2-core
CPU). For runs a test reads; a test about the launcher itself (signals, restarts, machines, its refusals) launches
a real one (conftest.launch).

`python()` is the same for the processes a tool starts (the benchmarks start training scripts, launchers and peers'
scripts as `sys.executable ...`): a stand-in `python` that has the script forked from the server with its arguments,
environment, working directory and standard streams, passes signals on and exits as it did. For the tools' tests,
which check what a tool does with its runs; the tools' timings of a fresh interpreter are measured by the benchmarks
themselves (BENCHMARKS.md), never by a test."""

import atexit
import contextlib
import io
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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

ADDRESS = "WARM_PYTHON_SERVER"  # the environment variable that tells the stand-in `python` where to ask
# The stand-in: only the standard library, started without site (a few hundredths of a second). `python [-u] SCRIPT`
# and `python [-u] -m MODULE` are forked warm; anything else (-c, as multiprocessing's spawn starts its children,
# passing them descriptors; other options) runs in the real interpreter.
STAND_IN = """#!{python} -S
import json, os, signal, socket, sys
args = sys.argv[1:]
args = args[1:] if args[:1] == ["-u"] else args
if not args or (args[0].startswith("-") and args[:1] != ["-m"]) or args == ["-m"] or {address!r} not in os.environ:
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
server = socket.socket(socket.AF_UNIX)
server.connect(os.environ[{address!r}])
channel = server.makefile("rw")
channel.write(json.dumps({{"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}}) + "\\n")
channel.flush()
pid = json.loads(channel.readline())["pid"]


def pass_on(number, frame):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(number, pass_on)
code = json.loads(channel.readline())["exit_code"]
if code < 0:  # ended by a signal: so does this process
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

_server = None
_environments = {}
_python = None
_stand_ins = {}  # a process forked for a stand-in: that stand-in
_starting = threading.Lock()  # Process.start() from the threads that serve the stand-ins


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


def python():
    """(the stand-in `python`'s path, its server's address): a tool run in the test process with sys.executable set
    to the first and os.environ[ADDRESS] to the second starts its scripts forked warm."""
    global _python
    if _python is None:
        folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(folder / "server"))
        listener.listen()
        stand_in = folder / "python"
        stand_in.write_text(STAND_IN.format(python=sys.executable, address=ADDRESS))
        stand_in.chmod(0o755)
        _python = str(stand_in), str(folder / "server")
        threading.Thread(target=_serve, args=(listener,), name="warm_python", daemon=True).start()
    return _python


def _serve(listener):
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(connection,), daemon=True).start()


def _serve_one(connection):
    """One stand-in's script, forked; killed if the stand-in ends first (killed by a tool's timeout)."""
    with connection:
        with connection.makefile() as channel:
            request = json.loads(channel.readline())
        # its parent as the script would see it started by the stand-in: the stand-in's parent, or where that is a
        # process forked here (a launcher's), the stand-in it was forked for (with the launch's start and command)
        parent = int(Path(f"/proc/{request['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
        with _starting:
            process = _context().Process(target=_run_forked, args=(request, _stand_ins.get(parent, parent),
                                                                   _python[0]))
            process.start()
            _stand_ins[process.pid] = request["pid"]
        connection.sendall(json.dumps({"pid": process.pid}).encode() + b"\n")
        if process.sentinel not in multiprocessing.connection.wait([process.sentinel, connection]):
            process.kill()  # the stand-in's end closed the connection
        process.join()
        with contextlib.suppress(OSError):  # the stand-in is gone
            connection.sendall(json.dumps({"exit_code": process.exitcode}).encode() + b"\n")
        with _starting:
            del _stand_ins[process.pid]


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
    _become(env, cwd, {1: out, 2: err})
    _run_main(script, args)


def _run_forked(request, parent, stand_in):
    """In the forked process: the stand-in's `python [-m] TARGET args`, onto the stand-in's own standard streams,
    with `parent` as its parent process (what common/ reads of its launcher: its start, command line and folder);
    sys.executable is the stand-in, so that what this one starts is forked warm too."""
    _become(request["env"], request["cwd"], {fd: f"/proc/{request['pid']}/fd/{fd}" for fd in (0, 1, 2)})
    os.getppid = lambda: parent
    sys.executable = stand_in
    args = request["args"]
    if args[0] == "-m":
        _run_main(args[1], args[2:], module=True)
    else:
        _run_main(args[0], args[1:])


def _become(env, cwd, streams):
    """`env`, `cwd`, and each descriptor of `streams` opened onto its path (the output appended, as onto a launcher's
    inherited descriptors)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in streams.items():
        file = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True) for fd in (1, 2))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # a process the forkserver starts has its start method (forkserver) as the default; a launched script has the
    # platform's (fork), so its DataLoader workers are forked from it, not from a new server it would have to start
    multiprocessing.set_start_method(None, force=True)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))  # read at import, in the server


def _run_main(target, args, *, module=False):
    """`python target args` (`module`: `python -m target args`) as `__main__`; its exit code is this process's."""
    sys.argv = [target, *args]
    sys.path[0] = os.getcwd() if module else str(Path(target).parent)
    code = 0
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # as the interpreter ends on an uncaught exception: its traceback, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        atexit._run_exitfuncs()  # the script's, as the interpreter's exit runs them (multiprocessing's does not)
    sys.exit(code)

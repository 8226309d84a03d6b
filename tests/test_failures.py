"""Failure paths: an error never hangs, a run folder has one writer, a full disk or a kill strands nothing, a damaged
checkpoint is never used, and a careless command gets one message, not a traceback."""

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from common import errors
from common.reporting import read_metrics
from conftest import (DIGITS_RUN, LAUNCHER_SIGTERM_CODE, REPO, all_gone, descendants, fill, kill_everything,
                      launch_command, process_command, process_state, refused, run_command, script, small_disk, spawn,
                      wait_for, worker_pid, worker_pids)

SEEDLINGS = REPO / "scripts" / "train_seedlings.py"
# a tiny seedlings run with one DataLoader worker per process (the files, not the decode cache, which needs none)
SMALL_SEEDLINGS = ["--model", "test_resnet", "--image_size", 32, "--epochs", 1, "--batch_size", 8, "--mixup_alpha", 0,
                   "--cutmix_alpha", 0, "--num_workers", 1, "--no-cache_images"]


# ---- an error never hangs ----

# train_seedlings.py as a user's copy with a bug in it: its evaluation raises once the training loop's workers are
# up ("raise"), or succeeds while a persistent-worker DataLoader stays referenced until the interpreter exits ("keep")
CRASHING_COPY = f"""
import sys
sys.path.insert(0, {str(REPO / 'scripts')!r})
import train_seedlings
from common.errors import run_main

kept, evaluate = [], train_seedlings.evaluate

def broken_evaluate(model, dataloader, *args, **kwargs):
    if sys.argv[1] == "raise":
        raise RuntimeError("a bug in the copied script")
    kept.append(dataloader)  # its workers stay alive until the interpreter exits
    return evaluate(model, dataloader, *args, **kwargs)

train_seedlings.evaluate = broken_evaluate
run_main(train_seedlings.main, train_seedlings.parse_args(sys.argv[2:]))
"""


# a cold decode on 3 cores whose own share is slow: its 2 forked helpers finish first, with more unreadable files to
# report than a pipe holds, and wait for it to read them
ORPHANED_HELPERS = f"""
import os, sys, time
sys.path.insert(0, {str(REPO)!r})
import numpy as np
import common.decode_cache as decode_cache

decode_cache.machine_share = lambda: (3, 1)
path = sys.argv[1]
np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(3000, 3, 2, 2)).flush()
parent = os.getpid()

def decode(item):
    if os.getpid() == parent:
        time.sleep(0.01)
    return OSError(f"cannot read {{item}}: " + "x" * 200)

decode_cache._decode_rows(decode, [f"image_{{i}}.jpg" for i in range(3000)], range(3000), path)
"""


def test_forked_decode_helpers_end_when_the_process_that_forked_them_is_killed(tmp_path):
    """SIGKILLed while its helpers wait to hand it their unreadable files, the process leaves none of them waiting
    forever on a pipe it held open in them."""
    (tmp_path / "decode.py").write_text(ORPHANED_HELPERS)
    process = spawn([sys.executable, tmp_path / "decode.py", tmp_path / "cache.npy"], log=tmp_path / "log")
    helpers = []

    def waiting_to_send():
        helpers[:] = [pid for pid in descendants(process.pid) if pid != process.pid]
        return len(helpers) == 2 and all(read_wchan(pid) == "anon_pipe_write" for pid in helpers)

    try:
        wait_for(waiting_to_send, process, timeout=60)
        process.kill()
        process.wait()
        assert all_gone(helpers, timeout=30), [process_state(pid) for pid in helpers]
        assert (tmp_path / "log").read_text() == ""  # not a traceback from a helper
    finally:
        kill_everything(process, *helpers)


def read_wchan(pid):
    try:
        return (Path("/proc") / str(pid) / "wchan").read_text()
    except OSError:
        return None


@pytest.mark.slow
def test_an_image_deleted_while_a_run_reads_its_files_is_named_and_the_run_ends_resumable(tmp_path, seedlings):
    """Without the decode cache each epoch reads the files again (in a DataLoader worker here, whose error comes back
    as its whole traceback): a file deleted (moved, unmounted) after the image check is one message naming it."""
    data = shutil.copytree(seedlings, tmp_path / "data")
    log = tmp_path / "run.log"
    process = spawn([sys.executable, REPO / "scripts" / "train_seedlings.py", "--data_dir", data, "--model",
                     "test_resnet", "--image_size", 32, "--epochs", 60, "--batch_size", 8, "--mixup_alpha", 0,
                     "--cutmix_alpha", 0, "--no-cache_images", "--num_workers", 1, "--output_dir", tmp_path / "run"],
                    log=log)
    try:
        wait_for(lambda: "epoch 1/60 " in log.read_text(), process)
        gone = sorted((data / "Maize").iterdir())
        for image in gone:
            image.unlink()
        assert process.wait(timeout=120) == 2
    finally:
        kill_everything(process)
    output = log.read_text()
    assert "Traceback" not in output and "Caught" not in output, output
    found = re.search(r"error: cannot read image (\S+) \(\[Errno 2\] No such file or directory: .*\), which the image "
                      r"check read before: it was deleted, moved or changed while the run went on, or its filesystem "
                      r"went away\. Put it back and run again \(a training run: with --resume latest, from its last "
                      r"checkpoint\)", output)
    assert found and Path(found.group(1)) in gone, output
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()  # what --resume latest continues from


SHORT_OF_MEMORY = f"""
import resource, sys
sys.path.insert(0, {str(REPO / "scripts")!r})
import timm, torch, train_seedlings  # imported first: the limit is on what the run allocates
from common.errors import run_main

size = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 3 * 2 ** 29, resource.RLIM_INFINITY))
sys.argv[0] = train_seedlings.__file__
run_main(train_seedlings.main, train_seedlings.parse_args())
"""


@pytest.mark.slow
def test_a_batch_too_large_for_the_memory_is_one_message_naming_the_fix(tmp_path, seedlings):
    """A real allocation failure (the process's address space limited to 1.5 GB more than its imports took, which the
    activations of ResNet-50 at 768 px overrun in the first step): one line, not the allocator's traceback."""
    program = tmp_path / "short_of_memory.py"
    program.write_text(SHORT_OF_MEMORY)
    data = shutil.copytree(seedlings, tmp_path / "data")
    result = run_command([sys.executable, program, "--data_dir", data, "--model", "resnet50", "--image_size", 768,
                          "--batch_size", 16, "--epochs", 1, "--mixup_alpha", 0, "--cutmix_alpha", 0, "--output_dir",
                          tmp_path / "run"], timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output
    assert re.search(r"error: out of memory \(the machine's, allocating [\d,]+ MiB more\)\. Lower --batch_size \(it is "
                     r"per process; --grad_accum keeps the global batch\) or the image size", result.output)


@pytest.mark.slow
def test_an_open_file_limit_too_low_is_raised_to_the_hard_one_or_named_with_its_fix(tmp_path, seedlings,
                                                                                      socket_tmpdir):
    """8 DataLoader workers hold more descriptors than a soft limit of 64 allows (`ulimit -Sn 64`; macOS shells
    start at 256): the run raises it to the hard limit and trains, here with a TMPDIR too deep for the workers'
    sockets (their paths at most 107 bytes), which Python 3.11 bound there all the same: the worker's bind failed and
    the run waited for its batch forever. A hard limit of 64: one line naming the fix, the run folder let go, and the
    workers' socket folder (TMPDIR/pymp-*) removed, which needs descriptors too."""
    data = shutil.copytree(seedlings, tmp_path / "data")
    command = [sys.executable, REPO / "scripts" / "train_seedlings.py", "--data_dir", data, *SMALL_SEEDLINGS[:8],
               "--num_workers", 8, "--no-cache_images"]  # with Mixup: more descriptors taken when the limit is met
    deep = tmp_path / ("a_job_s_own_temporary_folder_" * 3)
    deep.mkdir()
    result = run_command(["sh", "-c", 'ulimit -Sn 64 && exec "$@"', "sh", *command, "--output_dir", tmp_path / "run1"],
                         env={"TMPDIR": str(deep)}, timeout=120)
    assert result.returncode == 0 and (tmp_path / "run1" / "best" / "meta.json").exists(), result.output
    assert "Traceback" not in result.output and not list(deep.glob("pymp-*")), result.output

    result = run_command(["sh", "-c", 'ulimit -n 64 && exec "$@"', "sh", *command, "--output_dir", tmp_path / "run2"],
                         env={"TMPDIR": str(socket_tmpdir)}, timeout=120)
    message = "error: too many open files: this process may hold 64 at once (`ulimit -n`, already raised to the"
    assert result.returncode == 1 and result.output.count(message) == 1, result.output
    assert "pass fewer --num_workers (0: none, slower)" in result.output and "Traceback" not in result.output
    assert not list(socket_tmpdir.glob("pymp-*")) and not list((tmp_path / "run2").rglob(".lock"))


STUCK_WORKER = f"""
import os, sys, time
sys.path.insert(0, {str(REPO / "scripts")!r})
import train_seedlings
import common.folders as folders
from common.errors import run_main

main, read_image = os.getpid(), folders.read_image


def stuck(path, **kwargs):  # in a DataLoader worker: hands over nothing, ever
    if os.getpid() != main:
        open(os.environ["STUCK_PID_FILE"], "w").write(str(os.getpid()))
        time.sleep(3600)
    return read_image(path, **kwargs)


folders.read_image, folders.LOADER_TIMEOUT_S = stuck, 2
sys.argv[0] = train_seedlings.__file__
run_main(train_seedlings.main, train_seedlings.parse_args())
"""


@pytest.mark.slow
def test_a_batch_a_worker_never_hands_over_ends_the_run_after_the_loaders_timeout(tmp_path, seedlings):
    """A worker stuck, or a batch lost on its way (a worker's failed socket left a run waiting forever): after
    LOADER_TIMEOUT_S (here 2 s) one line naming it and what to do, exit 1, and the stuck worker killed."""
    program = tmp_path / "stuck_worker.py"
    program.write_text(STUCK_WORKER)
    data = shutil.copytree(seedlings, tmp_path / "data")
    result = run_command([sys.executable, program, "--data_dir", data, *SMALL_SEEDLINGS, "--output_dir",
                          tmp_path / "run"], env={"STUCK_PID_FILE": str(tmp_path / "stuck.pid")}, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output
    assert ("error: a DataLoader worker handed over no batch in 2 s: it is stuck, or the batch was lost on its way"
            in result.output and "--num_workers 0 reads the images without workers" in result.output), result.output
    assert all_gone([int((tmp_path / "stuck.pid").read_text())])
    assert not list((tmp_path / "run").rglob(".lock"))


@pytest.mark.slow
def test_a_shared_memory_too_small_for_the_loader_workers_is_one_message_naming_the_fix(tmp_path, seedlings):
    """A container's 64 MB /dev/shm (Docker's default), through which DataLoader workers hand over their batches, is
    here half a megabyte in a mount namespace of the run's own: one line naming the fix, not the workers' traceback."""
    data = shutil.copytree(seedlings, tmp_path / "data")
    command = [sys.executable, REPO / "scripts" / "train_seedlings.py", "--data_dir", data, *SMALL_SEEDLINGS,
               "--image_size", 224, "--batch_size", 16, "--output_dir", tmp_path / "run"]
    small_shm = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=512k tmpfs /dev/shm && exec "$@"', "sh"]
    if subprocess.run([*small_shm, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small /dev/shm here: needs root and unshare (util-linux)")
    result = run_command([*small_shm, *command])
    assert result.returncode == 1 and "Traceback" not in result.output, result.output
    assert ("error: the DataLoader workers ran out of shared memory (/dev/shm holds 0.5 MB, " in result.output
            and "docker run --shm-size=8g" in result.output), result.output
    assert not list(tmp_path.rglob(".lock"))  # the run folder let go (nothing was trained: nothing is kept)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "keep"])
def test_an_error_or_a_live_worker_at_exit_never_hangs_the_process(tmp_path, seedlings, mode):
    """The folder DataLoader's workers ignore SIGTERM (so that a scheduler's SIGTERM lets the run save); at exit
    Python stops them with SIGTERM and used to wait forever. Now every exit kills them first. On 2 processes, each
    of which exits as a single `python my_train_seedlings.py` does (the launcher waits for both: a hung one would
    hang it), and with the launcher's exit code for the run: 1 with the error, 0 without."""
    copy = tmp_path / "my_train_seedlings.py"
    copy.write_text(CRASHING_COPY)
    command = launch_command(copy, mode, "--data_dir", seedlings, "--output_dir", tmp_path / "run", *SMALL_SEEDLINGS)
    log = tmp_path / "log"
    process = spawn(command, log=log)
    ended = "a bug in the copied script" if mode == "raise" else "run done"
    family = set()  # the training processes and their DataLoader workers, as seen while the run went on: read
    #                 only once its last line is out, a fast exit could already have ended them (an empty family)
    try:
        wait_for(lambda: family.update(descendants(process.pid)[1:]) or ended in log.read_text(), process,
                 timeout=300)
        code = process.wait(timeout=30)  # before the fix: never (the workers ignore the SIGTERM sent at exit)
    finally:
        kill_everything(process)
    output = log.read_text()
    assert (code == 0) == (mode == "keep"), output
    if mode == "raise":
        assert "RuntimeError: a bug in the copied script" in output
    assert family and all_gone(family), output


EXITING = f"""
import atexit, sys
sys.path.insert(0, {str(REPO)!r})
from common.errors import UserError, run_main

class Torn:
    def __del__(self):
        print("torn down", flush=True)

kept = Torn()  # a module global: the interpreter's teardown would delete it
atexit.register(lambda: print("atexit ran", flush=True))

def main(how):
    print("unflushed", end="")
    if how == "error":
        raise UserError("no such folder: x")
    if how == "message":
        sys.exit("stopped: a message")

run_main(main, sys.argv[1])
"""


@pytest.mark.parametrize("how, code, says", [("done", 0, ""), ("error", 2, "error: no such folder: x"),
                                             ("message", 1, "stopped: a message")])
def test_a_script_ends_without_the_interpreters_teardown_having_done_what_its_exit_must(tmp_path, how, code, says):
    """run_main ends the process itself (common.errors.end_process): the teardown after it could abort a process
    that used gloo once everything was written (SIGABRT, "terminate called without an active exception"). Before
    ending: the atexit handlers, the output flushed, the exit code as sys.exit gives it."""
    program = tmp_path / "exiting.py"
    program.write_text(EXITING)
    # not run_command: its PYTHONUNBUFFERED would flush the print itself, and the flush at the end is checked here
    result = subprocess.run([sys.executable, program, how], capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    assert result.stdout == "unflushedatexit ran\n"  # and no "torn down": the teardown was skipped
    assert result.stderr.strip() == says


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_is_said_once_and_ends_every_process_of_the_run(tmp_path, seedlings, processes):
    """Ctrl-C reaches the terminal's foreground process group: the script and its DataLoader workers, or the
    launcher, which passes it on to each process and then dies of it with its own traceback. Each process used to
    put the message into the error file that the dying launcher never shows (and the second one first waited 5 s
    for the launcher's failure table); now the first process of the machine says it, once."""
    output_dir = tmp_path / "run"
    args = ["--data_dir", seedlings, "--output_dir", output_dir, *SMALL_SEEDLINGS, "--epochs", 500]
    command = process_command(SEEDLINGS, *args, processes=processes)
    log = tmp_path / "log"
    process = spawn(command, log=log)
    family = set()
    try:
        wait_for(lambda: family.update(descendants(process.pid)[1:]) or "epoch 2/500" in log.read_text(), process)
        os.killpg(process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code = process.wait(timeout=60)
    finally:
        kill_everything(process)
    output = log.read_text()
    assert code == 130 if processes == 1 else code != 0, output
    assert output.count("interrupted (Ctrl-C); with checkpoints, --resume latest continues from the last one") == 1
    assert "KeyboardInterrupt" not in output, output  # no traceback of the run's processes
    assert family and all_gone(family), output
    latest = (output_dir / "checkpoints" / "latest").read_text().strip()
    assert (output_dir / "checkpoints" / latest / "trainer_state.json").exists()


def start_on_a_terminal(command):
    """`command` as a login shell starts it: the leader of a session whose controlling terminal it is, SIGHUP at its
    default (not ignored as it is under `nohup make test`). Returns the process, the terminal's master end (closing it
    closes the terminal) and what the terminal has shown (its `read()` reads what is new: the process would wait on a
    full terminal)."""
    master, terminal = os.openpty()

    def on_the_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    process = subprocess.Popen(list(map(str, command)), stdin=terminal, stdout=terminal, stderr=terminal, cwd=REPO,
                               preexec_fn=on_the_terminal, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(terminal)
    os.set_blocking(master, False)

    class Shown(bytearray):
        def read(self):
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(master, 1 << 16):
                    self.extend(chunk)
            return self

    return process, master, Shown()


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_closed_terminal_saves_and_stops_the_run_as_sigterm_does(tmp_path, seedlings, processes):
    """Closing the terminal (an SSH session lost) hangs it up: SIGHUP to the processes on it, and every later write
    to it fails (EIO). They died where they stood, leaving the run folder's lock and a half-written best/; now they
    save a checkpoint and stop as on SIGTERM, what they print from then on sent to /dev/null. Under nohup SIGHUP is
    ignored, and stays so."""
    from common.errors import on_hangup

    output_dir = tmp_path / "run"
    args = ["--data_dir", seedlings, "--output_dir", output_dir, *SMALL_SEEDLINGS, "--epochs", 500]
    command = process_command(SEEDLINGS, *args, processes=processes)
    process, master, shown = start_on_a_terminal(command)
    family = set()
    try:
        wait_for(lambda: family.update(descendants(process.pid)[1:]) or b"epoch 2/500" in shown.read(), process)
    finally:
        os.close(master)  # the terminal closed
    try:
        code = process.wait(timeout=60)
    finally:
        kill_everything(process)
    assert family and all_gone(family), bytes(shown[-3000:])
    assert code == 143 if processes == 1 else code != 0, bytes(shown[-3000:])  # the launcher's own code, by its version
    assert not (output_dir / ".lock").exists() and not list(output_dir.glob(".*.tmp"))
    latest = (output_dir / "checkpoints" / "latest").read_text().strip()
    assert (output_dir / "checkpoints" / latest / "trainer_state.json").exists()
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup's
    try:
        on_hangup()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize("sighup", ["handled", "ignored"])
def test_a_print_that_meets_the_closed_terminal_before_its_sighup_is_the_hangup(tmp_path, sighup):
    """A closed terminal fails every later write to it (EIO) at once, while its SIGHUP's handler runs at the main
    thread's next Python instruction: a print under way met the closed terminal first and ended the run with a
    traceback (exit code 1, every time for a process that prints without pause, as this one until the test has closed
    its terminal), and with SIGHUP ignored (nohup) the first print after it did. Now that write moves the process off
    the terminal and the SIGHUP stops the run as SIGTERM does (143); with SIGHUP ignored, it goes on to its end (0)."""
    closed, done = tmp_path / "closed", tmp_path / "done"
    program = tmp_path / "prints.py"
    program.write_text(f"import os, signal, sys\nsys.path.insert(0, {str(REPO)!r})\n"
                       + ("signal.signal(signal.SIGHUP, signal.SIG_IGN)\n" if sighup == "ignored" else "")
                       + "from common.errors import run_main\n"
                       "def main(args):\n"
                       "    i = 0\n"
                       f"    while not os.path.exists({str(closed)!r}):\n"
                       "        i += 1\n"
                       "        print(f'line {i}', flush=True)\n"
                       f"    open({str(done)!r}, 'w').close()\n"
                       "run_main(main, None)\n")
    process, master, shown = start_on_a_terminal([sys.executable, program])
    try:
        wait_for(lambda: b"line 1000\r\n" in shown.read(), process)
    finally:
        os.close(master)  # the terminal closed
        closed.touch()
    try:
        code = process.wait(timeout=60)
    finally:
        kill_everything(process)
    assert code == {"handled": 143, "ignored": 0}[sighup] and done.exists() == (sighup == "ignored")


def pids_running(marker):
    """The live processes whose command line holds `marker` (a run folder's path)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker.encode() in cmdline.read_bytes() and process_state(int(cmdline.parent.name)) not in ("Z", None):
                found.append(int(cmdline.parent.name))
    return found


@pytest.mark.slow
def test_a_launch_under_nohup_stops_with_the_terminal_and_says_how_to_keep_it_and_setsid_keeps_it(tmp_path):
    """`nohup accelerate launch ... &` from a shell, then the terminal closes: the shell passes SIGHUP to its jobs, and
    torchrun (inside accelerate launch) passes it on to the processes even under nohup (its own handler). The run
    saves and stops, and its log says why and how to keep it: a session of its own (setsid), which the same shell's
    other job, started so, shows: it trains on after the terminal closed."""
    runs = {way: tmp_path / way for way in ("nohup", "setsid")}
    master, terminal = os.openpty()

    def on_the_terminal():  # a shell on the terminal, as an SSH login starts one
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    shell = subprocess.Popen(["bash", "--norc", "-i"], stdin=terminal, stdout=terminal, stderr=terminal, cwd=REPO,
                             preexec_fn=on_the_terminal, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(terminal)
    for way, output_dir in runs.items():
        command = launch_command(REPO / "scripts" / "train_mnist.py", "--dataset", "digits", "--output_dir",
                                 output_dir, "--epochs", 500)
        prefix = "nohup" if way == "nohup" else "setsid nohup"
        os.write(master, f"{prefix} {shlex.join(map(str, command))} > {output_dir}.log 2>&1 &\n".encode())
    logs = {way: Path(f"{output_dir}.log") for way, output_dir in runs.items()}
    try:
        wait_for(lambda: all(log.exists() and "epoch 2/500" in log.read_text() for log in logs.values()), shell)
        os.close(master)  # the terminal closed
        shell.wait(timeout=60)
        wait_for(lambda: not pids_running(str(runs["nohup"])))
        epochs_at_close = logs["setsid"].read_text().count("train_loss")
        launcher = next(pid for pid in pids_running(str(runs["setsid"]))
                        if b"accelerate.commands.launch" in Path(f"/proc/{pid}/cmdline").read_bytes())
        kept = [launcher, worker_pid(launcher, 0), worker_pid(launcher, 1)]
        wait_for(lambda: logs["setsid"].read_text().count("train_loss") > epochs_at_close + 1)
        assert all(process_state(pid) not in ("Z", None) for pid in kept)  # the same launcher and processes
    finally:
        for pid in pids_running(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(master)
    stopped = logs["nohup"].read_text()
    assert re.search(r"stopped by SIGHUP at epoch \d+, step \d+: saved \S+\. Run the same command with --resume "
                     r"latest to continue\. SIGHUP: the terminal the run was started from closed\. To train on after "
                     r"it closes, start the run in a session of its own: setsid nohup COMMAND", stopped), stopped[-999:]
    latest = (runs["nohup"] / "checkpoints" / "latest").read_text().strip()
    assert (runs["nohup"] / "checkpoints" / latest / "trainer_state.json").exists()
    assert not (runs["nohup"] / ".lock").exists()
    assert "stopped by" not in logs["setsid"].read_text()


@pytest.mark.slow
def test_a_launch_whose_output_reader_ends_saves_and_stops_as_on_sigterm(tmp_path):
    """`accelerate launch ... | head` (or a `| tee` that ended with its terminal): every print after the reader is
    gone fails (EPIPE); the run ended there with BrokenPipeError's traceback, an epoch of training lost. Now both
    processes stop at one step with a checkpoint that `latest` names (what --resume latest continues), saying so on
    stderr."""
    output_dir = tmp_path / "run"
    command = launch_command(REPO / "scripts" / "train_mnist.py", "--dataset", "digits", "--output_dir", output_dir,
                             "--epochs", 500)
    with open(tmp_path / "stderr", "w") as stderr:
        run = subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=stderr, cwd=REPO,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            for line in run.stdout:  # as `head` does: read up to a line, then go
                if b"epoch 2/500" in line:
                    break
            run.stdout.close()
            code = run.wait(timeout=120)
        finally:
            kill_everything(run)
    said = (tmp_path / "stderr").read_text()
    assert code != 0 and "BrokenPipeError" not in said, said[-3000:]
    stopped = re.search(r"stopped by SIGPIPE at epoch (\d+), step \d+: saved (\S+)\. Run the same command with "
                        r"--resume latest to continue\. SIGPIPE: the program reading the run's output", said)
    assert stopped and int(stopped[1]) >= 2, said[-3000:]
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == Path(stopped[2]).name
    assert not (output_dir / ".lock").exists() and len(re.findall(r"exitcode\s+: 143", said)) == 2  # both: 143


def test_a_sigterm_while_another_error_is_handled_ends_as_a_sigterm(capsys):
    """A launch stopped during the decode: one process can meet the shared cache file that the other one's SIGTERM
    has just removed, and its own SIGTERM lands while that error is being handled. It ends as a SIGTERM does (one
    line, exit code 143), not with Terminated's traceback on top of the file's (seen once in CI, in the test below)."""
    class Removed(FileNotFoundError):
        def __str__(self):  # read by call_main's handler: the process's own SIGTERM lands there
            os.kill(os.getpid(), signal.SIGTERM)
            return "No such file or directory: 'data/.checked-train-37px.npy.vm.357.tmp.npy'"

    def main(args):
        raise Removed()

    handler, code = signal.signal(signal.SIGTERM, errors._terminated), None  # as run_main sets it
    try:
        errors.call_main(main, None)
    except SystemExit as stop:
        code = stop.code
    except errors.Terminated:  # out of call_main: the process would end with its traceback
        code = "Terminated"
    finally:
        signal.signal(signal.SIGTERM, handler)
        errors.TERMINATED.clear()
    said = capsys.readouterr().err
    assert code == 143 and "Traceback" not in said, (code, said)
    assert said.startswith("stopped by SIGTERM (a preemption, a time limit, kill): nothing half-written was left"), said


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_before_training_ends_the_run_through_its_cleanups(tmp_path, cifar_jpegs, processes):
    """A preemption while the images are checked and decoded (before the run catches SIGTERM to save at a step):
    every process ends at once with one message, and leaves neither its half-written decode cache beside the data
    nor an empty run folder holding its lock (SIGTERM's default killed them where they stood)."""
    data = tmp_path / "data"
    for n, image in enumerate(sorted((cifar_jpegs / "train").rglob("*.jpg")) * 40):  # thousands: a decode to catch
        (data / image.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(image, data / image.parent.name / f"{n}.jpg")
    args = ["--data_dir", data, "--output_dir", tmp_path / "new" / "run", "--model", "test_resnet", "--image_size",
            32, "--epochs", 1, "--mixup_alpha", 0, "--cutmix_alpha", 0]  # the decode cache on, as by default
    command = process_command(SEEDLINGS, *args, processes=processes)
    log, family = tmp_path / "log", set()
    process = spawn(command, log=log)
    try:
        wait_for(lambda: family.update(descendants(process.pid)) or list(data.glob(".*.tmp.npy")), process)
        os.kill(process.pid, signal.SIGTERM)  # the launcher passes it on, as Slurm's or a pod's stop does
        code = process.wait(timeout=60)
    finally:
        kill_everything(process)
    output = log.read_text()
    assert code == (143 if processes == 1 else LAUNCHER_SIGTERM_CODE), output
    assert output.count("stopped by SIGTERM (a preemption, a time limit, kill): nothing half-written was left; run "
                        "the same command again") == 1, output
    assert "Terminated" not in output and family and all_gone(family), output
    assert not list(data.glob(".*tmp*")) and not (tmp_path / "new").exists()


# ---- one run writes a run folder at a time ----

MNIST = REPO / "scripts" / "train_mnist.py"


@pytest.mark.slow
def test_a_second_launch_on_a_folder_in_use_is_refused_naming_the_holder_and_the_first_run_goes_on(tmp_path):
    output_dir, log = tmp_path / "run", tmp_path / "first.log"
    first = spawn(launch_command(MNIST, *DIGITS_RUN, "--output_dir", output_dir), log=log)
    try:
        wait_for(lambda: (output_dir / "checkpoints" / "latest").exists(), first)
        workers = worker_pids(first)
        holder = workers[0]
        for pid in workers:  # held still, whatever this machine's speed: the second launch comes while it runs
            os.kill(pid, signal.SIGSTOP)
        held = (f"{output_dir} is being written by another run (process {holder} on {socket.gethostname()} holds "
                f"{output_dir.resolve() / '.lock'})")
        try:  # the typo'd Slurm array: the same 2-process launch again
            second = run_command(launch_command(MNIST, *DIGITS_RUN, "--output_dir", output_dir), timeout=120)
            assert second.returncode != 0 and held in second.output, second.output
            assert "Traceback" not in second.output.split("Root Cause")[1], second.output
            for extra in (["--resume", "auto"], ["--overwrite"]):  # enter pressed twice, or "start it over"
                assert held in refused(MNIST.name, *DIGITS_RUN, "--output_dir", output_dir, *extra)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, log.read_text()
    finally:
        kill_everything(first)
    assert [record["epoch"] for record in read_metrics(output_dir)] == [1, 2, 3, 4]  # untouched by the refused ones
    assert not (output_dir / ".lock").exists()  # released at the end
    assert not (output_dir / "previous_run").exists()


HOLDER = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
import common.outputs as outputs
outputs.LOCK_LEASE_S = 3
assert outputs.lock_output_dir(sys.argv[1]) is None
print("held", flush=True)
time.sleep(600)
"""


def test_a_lock_held_on_another_machine_is_waited_for_then_refused_or_taken_over_once_it_expires(tmp_path,
                                                                                                  monkeypatch):
    """The holder runs in a UTS namespace of its own, under another hostname: its process cannot be seen from
    here, so only its lease tells. Refreshed, it holds; its machine gone (SIGKILL), it expires after the lease."""
    import common.outputs as outputs

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("another hostname needs root and unshare")
    monkeypatch.setattr(outputs, "LOCK_LEASE_S", 3)
    (tmp_path / "holder.py").write_text(HOLDER)
    log = tmp_path / "holder.log"
    holder = spawn(["unshare", "--uts", "sh", "-c", f"hostname other-machine && exec {sys.executable} "
                    f"{tmp_path / 'holder.py'} {tmp_path}"], log=log)
    try:
        wait_for(lambda: "held" in log.read_text(), holder)
        started = time.monotonic()
        problem = outputs.lock_output_dir(tmp_path)
        assert time.monotonic() - started >= 3  # it waited out a lease, the holder refreshed it
        assert re.fullmatch(rf"{tmp_path} is being written by another run \(process \d+ on other-machine holds "
                            rf"{tmp_path / '.lock'}\)\. Wait for it to end or stop it, or choose another --output_dir\.",
                            problem), problem
        kill_everything(holder)  # its machine is lost: no refresh any more, and no process here to look at
        assert outputs.lock_output_dir(tmp_path) is None
        assert f"pid={os.getpid()}" in (tmp_path / ".lock").read_text()
    finally:
        kill_everything(holder)
        outputs.unlock_output_dirs()


# ---- a full disk: one message naming the file, nothing half-written ----

def test_the_one_writer_names_the_file_the_reason_and_the_free_space_and_leaves_nothing(tmp_path):
    """Python's own OSError and the writers that hide the reason (PyTorch's zip writer: `unexpected pos`)."""
    import torch

    from common.outputs import WriteFailed, write_atomically

    with small_disk(tmp_path / "disk", megabytes=1) as disk:
        (disk / "model.pt").write_text("the earlier file")
        fill(disk)
        for name, write in (("model.pt", lambda tmp: torch.save(torch.zeros(1 << 16), tmp)),
                            ("report.json", lambda tmp: tmp.write_text("x" * (1 << 20)))):
            with pytest.raises(WriteFailed) as failed:
                write_atomically(disk / name, write)
            assert re.fullmatch(rf"cannot write {disk / name}: No space left on device \(\d+ bytes free there\)\. "
                                r"Nothing half-written was left\. Free some space \(or choose another place\) and run "
                                r"the command again\.", str(failed.value)), str(failed.value)
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "model.pt"]
        assert (disk / "model.pt").read_text() == "the earlier file"

        def stopped_short_then_room_again(tmp):  # ext4 gives back a failed file's reserved blocks
            try:
                torch.save(torch.zeros(1 << 16), tmp)
            finally:
                (disk / "filler").unlink()

        with pytest.raises(WriteFailed) as failed:
            write_atomically(disk / "model.pt", stopped_short_then_room_again)
        assert re.match(rf"cannot write {disk / 'model.pt'}: the disk stopped the write short, full at that moment "
                        r"\(.*unexpected pos \d+ vs \d+\) \([\d.]+ [kM]B free there\)\. Nothing half-written",
                        str(failed.value)), str(failed.value)
        assert sorted(p.name for p in disk.iterdir()) == ["model.pt"]


def test_a_write_published_on_its_thread_lands_in_order_and_its_error_is_raised_in_the_callers(tmp_path, capfd):
    """best/ and checkpoints are written or flushed and renamed while the next epoch trains (`later`)."""
    from common.outputs import WriteFailed, finish_writes, write_atomically

    for text in ("first", "second"):  # the second waits for the first: the last handed over is what stays
        write_atomically(tmp_path / "best", lambda tmp, text=text: (tmp.mkdir(), (tmp / "meta.json").write_text(text)),
                         later=True)
    finish_writes()
    assert (tmp_path / "best" / "meta.json").read_text() == "second"
    (tmp_path / "report.json").mkdir()  # a folder in the way: the rename fails on the thread
    (tmp_path / "report.json" / "kept").write_text("")
    write_atomically(tmp_path / "report.json", lambda tmp: tmp.write_text("{}"), later=True)
    with pytest.raises(WriteFailed, match=rf"cannot write {tmp_path / 'report.json'}: Is a directory .*Nothing "
                                          "half-written was left"):
        finish_writes()
    finish_writes()  # said once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "report.json"]
    with small_disk(tmp_path / "disk", megabytes=1) as disk:  # a full disk, met on the thread
        fill(disk)
        write_atomically(disk / "best", lambda tmp: (tmp.mkdir(), (tmp / "model.safetensors").write_bytes(
            bytes(1 << 20))), later=True)
        with pytest.raises(WriteFailed, match=rf"cannot write {disk / 'best'}: No space left on device"):
            finish_writes()
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    assert "Traceback" not in capfd.readouterr().err


def test_best_written_while_training_goes_on_holds_the_weights_and_predictions_of_its_epoch(tmp_path, monkeypatch):
    import threading

    import numpy as np
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file, save_file

    import common.models
    from common.models import save_best_model
    from common.outputs import finish_writes

    steps_done = threading.Event()  # the thread writes the weights only once the training below has changed them
    monkeypatch.setattr(common.models, "save_file", lambda *args: (steps_done.wait(30), save_file(*args)))

    accelerator = Accelerator(cpu=True)
    try:
        model = accelerator.prepare(torch.nn.Linear(64, 2))
        saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        evaluation = {"indices": np.arange(3), "labels": np.array([0, 1, 1]),
                      "probabilities": np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]], dtype=np.float32)}
        save_best_model(accelerator, model, tmp_path, meta={"class_names": ["cat", "dog"]}, evaluation=evaluation,
                        later=True)
        with torch.no_grad():  # the next steps change the weights in place at once
            for parameter in model.parameters():
                parameter.add_(1.0)
        steps_done.set()
        finish_writes()
    finally:
        AcceleratorState._reset_state(True)  # the next in-process run builds its own
        GradientState._reset_state()
    written = load_file(tmp_path / "best" / "model.safetensors")
    assert written.keys() == saved.keys() and all(torch.equal(written[name], saved[name]) for name in saved)
    assert (tmp_path / "best" / "val_predictions.csv").read_text().splitlines() == [
        "index,label,prediction,probability", "0,cat,cat,0.900000", "1,dog,dog,0.800000", "2,dog,cat,0.600000"]


def test_a_full_disk_at_the_final_reports_says_training_is_saved_and_what_writes_them(tmp_path, monkeypatch):
    """The run's message named --resume latest, which refuses a finished run: it names evaluate.py, which works."""
    import common.run
    from common.outputs import WriteFailed

    def full(accelerator, output_dir, **kwargs):
        raise WriteFailed(output_dir / "classification_report.txt", "No space left on device")

    output_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(common.run, "write_reports", full)
        result = script("train_mnist.py", "--dataset", "digits", "--epochs", 1, "--output_dir", output_dir)
    latest = output_dir / "checkpoints" / (output_dir / "checkpoints" / "latest").read_text().strip()
    assert result.returncode == 2 and "Traceback" not in result.output, result.output
    assert (f"Training is finished and saved (best/, the last checkpoint {latest}); only its final reports are "
            f"missing: free some space, then python scripts/evaluate.py --model_dir {output_dir} writes best/'s"
            in result.output), result.output
    evaluated = script("evaluate.py", "--model_dir", output_dir)
    assert evaluated.returncode == 0 and (output_dir / "evaluation" / "report.html").is_file(), evaluated.output


@pytest.mark.slow
def test_predict_evaluate_and_compute_mean_std_on_a_full_disk_say_so_and_write_nothing(tmp_path, digits_run,
                                                                                       seedlings):
    with small_disk(tmp_path / "disk", megabytes=1) as disk:
        fill(disk)
        images = tmp_path / "images"
        images.mkdir()
        for path in sorted(seedlings.rglob("*.png"))[:3]:
            shutil.copy(path, images / path.name)
        tools = {disk / "predictions.csv": ["predict.py", "--model_dir", digits_run, "--output",
                                            disk / "predictions.csv", images],
                 disk / "eval" / "classification_report.txt": ["evaluate.py", "--model_dir", digits_run,
                                                               "--output_dir", disk / "eval"],
                 disk / "mean_std.json": ["compute_mean_std.py", images, "--output", disk / "mean_std.json"]}
        for output, command in tools.items():
            result = script(*command)
            assert result.returncode == 2, result.output
            assert f"error: cannot write {output}: No space left on device" in result.output, result.output
            assert "Traceback" not in result.output
        written = [p for p in disk.rglob("*") if p.is_file() and p.name != "filler"]
        assert not written, written


def test_what_a_killed_run_left_half_written_is_cleared_and_a_best_folder_moved_aside_comes_back(tmp_path):
    from common.outputs import remove_leftovers

    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for folder in (run / ".best.old", checkpoints / ".tmp-epoch_002_end", checkpoints / "epoch_001_end"):
        folder.mkdir(parents=True)
    (run / ".best.old" / "model.safetensors").write_text("the best model")
    (run / ".metrics.jsonl.4242.tmp.jsonl").write_text('{"epoch": 1')
    (run / ".shared-check-0123").touch()
    (run / ".notes.old").write_text("not ours")
    (run / ".lock").write_text("a lock")
    remove_leftovers(run)
    assert sorted(p.name for p in run.iterdir()) == [".lock", ".notes.old", "best", "checkpoints"]
    assert (run / "best" / "model.safetensors").read_text() == "the best model"
    assert [p.name for p in checkpoints.iterdir()] == ["epoch_001_end"]


# ---- small or odd data, careless commands: one message each ----

def test_odd_folders_are_named(tmp_path, seedlings):
    from common.errors import UserError
    from common.folders import find_splits
    from common.tools import find_images

    one_class = tmp_path / "one_class"
    shutil.copytree(seedlings / "Maize", one_class / "plant-seedlings" / "Maize")
    shutil.copytree(seedlings / "Maize", tmp_path / "split" / "train" / "Maize")
    shutil.copytree(seedlings / "Charlock", tmp_path / "split" / "train" / "Charlock")
    loop, fifo = tmp_path / "loop", tmp_path / "fifo"
    shutil.copytree(seedlings, loop)
    (loop / "Maize" / "odd.png").symlink_to("odd.png")
    shutil.copytree(seedlings, fifo)
    os.mkfifo(fifo / "Maize" / "stream.png")  # reading it would block forever
    cases = [
        (lambda: find_splits(one_class / "plant-seedlings", val_fraction=0.3, seed=0),
         "has one class folder (Maize): a classifier needs at least 2 classes"),
        (lambda: find_splits(one_class, val_fraction=0.3, seed=0),
         f"has no images (.jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff) but folders: did you mean --data_dir "
         f"{one_class / 'plant-seedlings'}?"),
        (lambda: find_splits(tmp_path / "split", val_fraction=0.3, seed=0),
         f"{tmp_path / 'split'} has train/ but no val/: add {tmp_path / 'split' / 'val'}/<class>/<image>, or pass "
         f"--data_dir {tmp_path / 'split' / 'train'} to split the training images here"),
        (lambda: find_splits(loop, val_fraction=0.3, seed=0), f"{loop / 'Maize' / 'odd.png'} is a symbolic link loop"),
        (lambda: find_splits(fifo, val_fraction=0.3, seed=0), f"{fifo / 'Maize' / 'stream.png'} is a FIFO (named pipe)"),
        (lambda: find_images([fifo / "Maize"]), f"{fifo / 'Maize' / 'stream.png'} is a FIFO (named pipe)"),
    ]
    for call, message in cases:
        with pytest.raises(UserError) as refused:
            call()
        assert message in str(refused.value), str(refused.value)


@pytest.mark.slow
def test_a_split_too_small_for_every_process_to_get_a_batch_is_one_message(tmp_path, seedlings, socket_tmpdir):
    """59 training images make one full batch of 32, and one optimizer step of 2 processes takes 2: nothing would
    be trained (before: both ended in an UnboundLocalError after '0 optimizer steps'). The process the launcher
    stops while it waits to report goes through its exit's cleanups: its DataLoader workers' folder in the
    temporary folder was left behind, one per failed launch."""
    result = run_command(launch_command(SEEDLINGS, "--data_dir", seedlings, "--output_dir", tmp_path / "run", "--model",
                                        "test_resnet", "--image_size", 32, "--batch_size", 32, "--num_workers", 1,
                                        "--no-cache_images"), env={"TMPDIR": str(socket_tmpdir)})
    assert result.returncode != 0
    assert ("59 training images make 1 full batch(es) of --batch_size 32, fewer than the 2 of one optimizer step (2 "
            "process(es) x 1 accumulation step(s)): nothing would be trained. Lower --batch_size (to 29 at most), "
            "--grad_accum, or launch fewer processes.") in result.output
    assert "Traceback" not in result.output.split("Root Cause")[1], result.output
    assert not list(socket_tmpdir.glob("pymp-*"))
    # accumulation steps that no batch size can fill: the fix is fewer of them (it said "--batch_size (to 1 at most)")
    message = refused(SEEDLINGS.name, "--data_dir", seedlings, "--output_dir", tmp_path / "one", "--model",
                      "test_resnet", "--image_size", 32, "--batch_size", 4, "--grad_accum", 100)
    assert ("59 training images make 14 full batch(es) of --batch_size 4, fewer than the 100 of one optimizer step (1 "
            "process(es) x 100 accumulation step(s)): nothing would be trained. Even at --batch_size 1 they make too "
            "few: lower --grad_accum (to 59 at most).") in message, message


def test_careless_commands_get_one_message(tmp_path, seedlings, digits_run, monkeypatch):
    import torch

    from common.exported import load_exported

    message = refused("train_seedlings.py", "--data_dir", seedlings, "--output_dir", tmp_path / "vit",
                      "--model", "vit_tiny_patch16_224", "--image_size", 32)
    assert "--model vit_tiny_patch16_224 takes only 224x224 images and this run gives it 32x32" in message

    (tmp_path / "logs_is_a_file" / "logs").parent.mkdir()
    (tmp_path / "logs_is_a_file" / "logs").write_text("my notes")
    message = refused("train_mnist.py", "--dataset", "digits", "--output_dir", tmp_path / "logs_is_a_file",
                      "--report_to", "tensorboard")
    assert f"--report_to tensorboard: {tmp_path / 'logs_is_a_file' / 'logs'} is a file" in message

    torch.save(torch.nn.Linear(2, 2), tmp_path / "whole_model.pth")
    message = refused("train_seedlings.py", "--data_dir", seedlings, "--output_dir", tmp_path / "pickled",
                      *SMALL_SEEDLINGS, "--pretrained", tmp_path / "whole_model.pth")
    assert (f"--pretrained {tmp_path / 'whole_model.pth'} holds pickled Python objects (torch.nn.modules.linear."
            "Linear), not only tensors") in message
    (tmp_path / "page.pth").write_text("<html>404 Not Found</html>")  # a download that went wrong
    message = refused("train_seedlings.py", "--data_dir", seedlings, "--output_dir", tmp_path / "page",
                      *SMALL_SEEDLINGS, "--pretrained", tmp_path / "page.pth")
    assert message.strip() == (f"error: --pretrained {tmp_path / 'page.pth'}: not a weights file (neither safetensors "
                               "nor what torch.save writes of a state dict)")
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    (tmp_path / "passwd.safetensors").write_text("root:x:0:0:root:/root:/bin/bash\n")
    for given, said in ((tmp_path / "list.pth", " is not a state dict (a dict of tensor names to tensors; a list): "
                                                "save the weights with torch.save(model.state_dict(), 'weights.pth')"),
                        (tmp_path / "passwd.safetensors", ": not a weights file (neither safetensors nor"),
                        (digits_run / "best", f" is a folder: pass its weights file, --pretrained "
                                              f"{digits_run / 'best' / 'model.safetensors'}")):
        message = refused("train_seedlings.py", "--data_dir", seedlings, "--output_dir", tmp_path / "w",
                          *SMALL_SEEDLINGS, "--pretrained", given)
        assert message.startswith(f"error: --pretrained {given}{said}"), message

    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"not read: onnxruntime is missing")
    meta = json.loads((digits_run / "best" / "meta.json").read_text())
    onnx.with_suffix(".json").write_text(json.dumps({**meta, "format": "onnx"}))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    from common.errors import UserError

    with pytest.raises(UserError, match="needs onnxruntime to run, and it is not installed: pip install -r "
                                        "requirements-export.txt"):
        load_exported(onnx)
    # export.py takes the suffix in any case, so the tools do; a best/ folder named so is a folder
    from common.exported import load_model

    shouting = onnx.rename(tmp_path / "MODEL.ONNX")
    onnx.with_suffix(".json").rename(shouting.with_suffix(".json"))
    with pytest.raises(UserError, match="needs onnxruntime"):
        load_model(shouting)
    folder = shutil.copytree(digits_run / "best", tmp_path / "digits.onnx")
    assert load_model(folder)[1:] == (meta, False)


def test_a_resumed_run_refuses_a_typed_flag_even_at_its_default_value():
    """train_mnist.py's --epochs defaults to 2: `--epochs 2` on a 4-epoch run was taken for "not given" and the
    run silently trained on to 4. The parser now records what was typed (abbreviations and --flag=value too)."""
    from common.errors import UserError
    from common.checkpoint import restore_args
    from conftest import load_script

    parse_args = load_script("train_mnist.py").parse_args
    saved = {**vars(parse_args([])), "epochs": 4, "dataset": "digits"}
    assert parse_args([]).typed == frozenset()
    assert parse_args(["--epoch", "2", "--dataset=digits"]).typed == {"epochs", "dataset"}
    assert "typed" not in vars(parse_args(["--epochs", "2"]))  # not one of the run's arguments
    for argv in (["--epochs", "2"], ["--epoch=2"]):
        with pytest.raises(UserError, match="--epochs is 2 on the command line but 4 in the checkpoint"):
            restore_args(parse_args(argv), saved, parse_args=parse_args)
    assert restore_args(parse_args(["--dataset", "digits"]), saved, parse_args=parse_args).epochs == 4
    seedlings = load_script("train_seedlings.py").parse_args
    assert seedlings(["--no-sync_bn"]).typed == {"sync_bn"}
    # --cache_images was a plain switch: a run saved with False (the files) resumes on the files, not the new default
    assert seedlings([]).cache_images is None
    old = {**vars(seedlings([])), "cache_images": False}
    assert restore_args(seedlings(["--data_dir", "elsewhere"]), old, parse_args=seedlings).cache_images is False


def test_the_lock_of_a_killed_run_is_taken_over_even_before_its_parent_collects_it(tmp_path):
    """A SIGKILLed process stays a zombie until its parent (or, its launcher dead too, the container's first
    process) collects it; filelock would count it alive, and a requeued job would be refused."""
    from common.outputs import lock_output_dir, unlock_output_dirs

    holder = subprocess.Popen([sys.executable, "-c", f"import os, sys; sys.path.insert(0, {str(REPO)!r}); "
                               "import common.outputs as o; assert o.lock_output_dir(sys.argv[1]) is None; "
                               "os.kill(os.getpid(), 9)", tmp_path])
    try:
        deadline = time.monotonic() + 60  # not holder.poll(), which would collect it
        while not (tmp_path / ".lock").exists() or process_state(holder.pid) != "Z":
            assert time.monotonic() < deadline, "the holder never ended"
            time.sleep(0.01)
        assert f"pid={holder.pid}" in (tmp_path / ".lock").read_text()
        assert lock_output_dir(tmp_path) is None  # before: "is being written by another run (process ... )"
        assert f"pid={os.getpid()}" in (tmp_path / ".lock").read_text()
    finally:
        holder.wait()
        unlock_output_dirs()


def test_an_unreadable_lock_file_is_taken_over_and_a_lock_folder_is_named(tmp_path):
    """A marker cut short (a kill while filelock wrote it) or a stray file called .lock must not refuse every
    run after it; filelock removes an unreadable marker after 2 s, which the first attempt now waits for."""
    from common.outputs import lock_output_dir, unlock_output_dirs

    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / ".lock").write_text("filelock/2\npid=12")
    (tmp_path / "folder" / ".lock").mkdir(parents=True)
    try:
        assert lock_output_dir(tmp_path / "cut") is None
        assert f"pid={os.getpid()}" in (tmp_path / "cut" / ".lock").read_text()
        assert lock_output_dir(tmp_path / "folder") == (f"{tmp_path / 'folder' / '.lock'} is a folder, where a run "
                                                        "keeps its lock file: remove it and run again")
    finally:
        unlock_output_dirs()

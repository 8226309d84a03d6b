"""User errors and exit codes: a mistake the user can fix is one `error:` line and exit code 2, never a traceback."""

import atexit
import contextlib
import ctypes
import errno
import gc
import json
import os
import re
import signal
import stat
import sys
import threading
import time
import urllib.parse
from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix (bad path, bad flag, wrong launch): printed as one message, exit code 2."""


class NothingToDo(Exception):
    """The run asked for is already done (`--resume auto` on a finished run): exit code 0, so a requeued job ends."""


class Interrupted(Exception):
    """The run saved a checkpoint and stopped because it was asked to (SIGTERM); the message is already printed."""


# what a run stopped by these signals says besides where it stopped (common.run's stop at a step, or call_main's)
STOP_HINTS = {
    signal.SIGHUP: " SIGHUP: the terminal the run was started from closed. To train on after it closes, start the "
                   "run in a session of its own: setsid nohup COMMAND > train.log 2>&1 & (nohup alone does not keep a "
                   "launch: accelerate launch and torchrun pass SIGHUP on to the processes), or in tmux or screen.",
    signal.SIGPIPE: " SIGPIPE: the program reading the run's output (| head, | tee) ended, so nothing more of it can "
                    "be shown; to keep a log, redirect the output to a file (> train.log 2>&1) and read that.",
}


class Terminated(BaseException):
    """SIGTERM before a training run takes it over (common.run.catch_sigterm: it then saves and stops at a step):
    the process ends as after Ctrl-C, through its cleanups (a half-written decode cache removed, the run folder's
    lock released), instead of dying where it stood."""


TERMINATED = []  # the SIGTERM `_terminated` raised on: a raise that lands in code which swallows it (an at-fork
# hook, a __del__) leaves this, which catch_sigterm raises again before the run's first step


def _terminated(signum, frame):
    TERMINATED.append(signum)
    raise Terminated


def _end_now(signum, frame):  # a process that is already ending with an error (exit_with_message)
    end_process(128 + signum)


@contextlib.contextmanager
def sigterm_deferred():
    """Where `Terminated` raised would be swallowed (a fork's at-fork hooks, which Python runs in this process and
    which ignore what they raise), SIGTERM is only noted, and raised once the block is done."""
    if signal.getsignal(signal.SIGTERM) is not _terminated:
        yield
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: TERMINATED.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _terminated)
    if TERMINATED:
        raise Terminated


def _default_sigterm_in_a_fork():  # a process forked meanwhile (a decode helper) ends on SIGTERM as it did
    if signal.getsignal(signal.SIGTERM) is _terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_a_fork)


# At exit the interpreter's last collections walk every object that torch, scikit-learn and matplotlib made: 2-3 s
# of a 2-process launch's teardown on 2 cores. Frozen, they are skipped; the process ends, so what they would have
# freed goes back with it. What must happen at exit is an atexit handler (the run folder's lock, unlock_output_dirs),
# not a __del__: a __del__ of an object left in a reference cycle is not run once frozen.
atexit.register(gc.freeze)

# what gloo and NCCL say when a collective's peer is gone or silent (the error must also come from the process group)
PEER_LOST = r"time ?out|timed out|closed by peer|connection reset|broken pipe"


def refuse_several_processes(tool):
    """A tool of one process, started by a launcher as several, would do its work and write its files once per
    process: one message instead."""
    processes = int(os.environ.get("WORLD_SIZE", 1))
    if processes > 1:
        raise UserError(f"{tool} runs in one process and was launched as {processes}, each of which would write the "
                        f"same files: run it with python scripts/{tool} (not accelerate launch)")


def on_another_version_of_common(script):
    """An import from common/ that fails once `script` has found it (a module or a name it lacks, whether the script
    imports it at its top or later): the script and common/ come from different versions, one updated without the
    other. Said in one line instead of the traceback; any other uncaught error is printed as before."""
    def explain(kind, error, traceback):
        if issubclass(kind, ImportError) and (getattr(error, "name", None) or "").startswith("common."):
            print(f"error: {Path(script).name} and the common/ it found ({Path(__file__).resolve().parent}) are from "
                  f"different versions ({error}): copy the script and common/ from the same version",
                  file=sys.stderr, flush=True)
        else:
            sys.__excepthook__(kind, error, traceback)
    sys.excepthook = explain


def collect_rarely():
    """The garbage collector's full collections a hundred times rarer. Each walks every object the process holds:
    torch, its _dynamo (which the optimizer's first call imports) and matplotlib make 350,000, nearly all kept to
    the end, and the default thresholds walked them 6-7 times in a run, 0.5 of a digits run's 2.5 CPU-seconds. The
    young generations are collected as often as before, which frees the cycles a run leaves (a Fashion-MNIST run's
    cyclic garbage held no array or tensor; its peak memory did not change)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1000)


def raise_open_file_limit(most=65536):
    """The soft limit of open files raised to the hard one (at most `most`), as a user would with `ulimit -n`: each
    DataLoader worker holds several descriptors, and a shell's soft limit (256 on macOS; 64 tried here) ran out as
    the third loader forked its workers, after the training. A few descriptors are then kept aside, for the
    message and the exit's cleanups should the hard limit run out all the same (`too_many_open_files`)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = most if hard == resource.RLIM_INFINITY else min(hard, most)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):  # no such limit here, or the system's own cap is lower
        pass
    _spare_descriptors.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(8 - len(_spare_descriptors)))


_spare_descriptors = []


def run_main(main, args):
    """A script's entry point: `call_main(main, args)`, then the process ends with its exit code (`end_process`)."""
    collect_rarely()
    raise_open_file_limit()
    signal.signal(signal.SIGTERM, _terminated)
    on_hangup()
    sys.stdout, sys.stderr = PipeReaderGone.wrap(sys.stdout), PipeReaderGone.wrap(sys.stderr)
    end_with_the_launcher()
    try:
        call_main(main, args)
    except SystemExit as stop:
        end_process(stop.code)
    end_process(0)


def on_hangup():
    """SIGHUP (the terminal closed: an SSH session lost, a laptop shut) handled as SIGTERM is at that moment (before
    training, a deferral, the run's stop at a step, a forked helper's default, DataLoader workers' ignoring it), once
    the descriptors on that terminal point at /dev/null: writing to a closed terminal fails (EIO), which would end the
    run at its next progress line. A SIGHUP ignored (nohup) stays ignored."""
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _hung_up)


def _hung_up(signum, frame):
    if _hangups:  # once: a launcher passes the terminal's SIGHUP on to processes that had the terminal's own
        return
    _hangups.append(signum)
    _off_the_terminal()
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(signum, frame)
    elif handler is not signal.SIG_IGN:  # SIGTERM at its default: the process ends of SIGHUP, as it did
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGHUP)


_hangups = []


def _off_the_terminal():
    """Points this process's descriptors 0-2 that are on a terminal at /dev/null."""
    nowhere = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # a terminal's, hung up: a character device still, though no longer a tty to isatty
        with contextlib.suppress(OSError):
            if stat.S_ISCHR(os.fstat(fd).st_mode):
                os.dup2(nowhere, fd)
    os.close(nowhere)


class PipeReaderGone:
    """sys.stdout or sys.stderr, whose reader going away ends no run at a print with a traceback. A pipe's reader
    gone (EPIPE: `| head` has its lines, a `| tee` ended with its terminal): the descriptor points at /dev/null from
    then on, and the run stops as on SIGTERM (a checkpoint at the next step). A terminal closed (EIO: a write under
    way before SIGHUP's handler ran, in this thread or another, or any write with SIGHUP ignored): off the terminal,
    and SIGHUP's handler, which runs next in the main thread, stops the run (or, SIGHUP ignored, it goes on)."""

    def __init__(self, stream):
        self._stream = stream

    @classmethod
    def wrap(cls, stream):
        return stream if stream is None or isinstance(stream, cls) else cls(stream)

    def write(self, text):
        with self._reader_checked():
            return self._stream.write(text)
        return len(text)

    def flush(self):
        with self._reader_checked():
            self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer...: the stream's own
        return getattr(self._stream, name)

    @contextlib.contextmanager
    def _reader_checked(self):
        try:
            yield
        except BrokenPipeError:
            self._reader_gone()
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            _off_the_terminal()  # what then happens is SIGHUP's, which the hangup sent (`_hung_up`, or ignored)

    def _reader_gone(self):
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, self._stream.fileno())
        os.close(nowhere)
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            handler(signal.SIGPIPE, None)


def parent_command():
    """The command line of this process's parent, one item per argument; None where /proc does not tell (not
    Linux)."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None


def launcher_pid():
    """The process that launched this one (its parent) where that is a launcher: torchrun (LOCAL_RANK set) or
    Accelerate's one-process launch (which sets none: told by the parent's command line); else None."""
    if "LOCAL_RANK" in os.environ:
        return os.getppid()
    command = (parent_command() or [])[:4]
    accelerate = "accelerate.commands.launch" in command or (
        "launch" in command and any(part.rsplit("/", 1)[-1] == "accelerate" for part in command))
    return os.getppid() if accelerate else None


def end_with_the_launcher():
    """A process of a launcher (`launcher_pid`) gets SIGTERM when the launcher dies without ending it (kill -9, the
    OOM killer): a run then saves a checkpoint and stops as on a preemption, instead of training on as an orphan that
    holds the run folder (and a GPU) until it ends. Linux's prctl(PR_SET_PDEATHSIG); a launcher starts its processes
    from its main thread, whose end is the signal's cue. Never for a parent that is not a launcher: a shell's end must
    not stop a run started with nohup."""
    launcher = launcher_pid() if sys.platform.startswith("linux") else None
    if launcher is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before that line
        print("the launcher of this process has ended: nothing to do", file=sys.stderr, flush=True)
        end_process(143)


def end_process(code):
    """`sys.exit(code)` without the interpreter's teardown, which can abort a process that used gloo after all its
    work is written ("terminate called without an active exception", SIGABRT; in about 1 of 13 two-process launches
    on 2 busy cores): gloo's worker thread lets go of the last collective's work just after the caller has moved on,
    and if the interpreter is being torn down by then, releasing the Python objects of that work's tensors cannot
    take the GIL, and the thread's unwinding ends the process (pytorch/pytorch#179291). What the interpreter's exit
    does before that teardown is done here: threads joined, atexit handlers run (the run folder's lock, DataLoader
    workers, logging), output flushed."""
    if code is not None and not isinstance(code, int):  # sys.exit("message"), as the interpreter shows it
        print(code, file=sys.stderr)
        code = 1
    if signal.getsignal(signal.SIGTERM) in (_terminated, _end_now):  # nothing left to stop, nor to end twice
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, replaced by None, or its pipe gone
            pass
    os._exit(code or 0)


def check_hf_endpoint():
    """An HF_ENDPOINT that urllib cannot split stops huggingface_hub's import (timm's and datasets' too) with a
    traceback, wherever a script first imports it: said before anything starts."""
    endpoint = os.environ.get("HF_ENDPOINT")
    try:
        urllib.parse.urlsplit(endpoint or "")
    except ValueError as error:
        raise UserError(f"HF_ENDPOINT={endpoint!r} is not a URL ({error}), and huggingface_hub (which timm and "
                        "datasets import) cannot start with it: set it to one such as https://huggingface.co or a "
                        "mirror's, or unset it") from None


def call_main(main, args):
    """Call `main(args)`; a UserError becomes one `error: ...` line and exit code 2. A run stopped by SIGTERM exits
    with 143, so schedulers see that it did not finish; a collective that lost its peer is one line, exit code 1."""
    try:
        return _call_main(main, args)
    except Terminated:  # also when it came while another error was being handled: a launch stopped during the decode,
        # where one process meets the cache file that the other one's SIGTERM has just removed, then its own SIGTERM
        cause = signal.Signals(TERMINATED[-1] if TERMINATED else signal.SIGTERM)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            name = "SIGTERM (a preemption, a time limit, kill)" if cause == signal.SIGTERM else cause.name
            print(f"stopped by {name}: nothing half-written was left; run the same command again"
                  + ("." + STOP_HINTS[cause] if cause in STOP_HINTS else ""),
                  file=sys.stderr, flush=True)
        sys.exit(143)


def _call_main(main, args):
    try:
        check_hf_endpoint()
        return main(args)
    except UserError as error:
        exit_with_message(f"error: {raised_in_a_worker(error) or error}", 2)
    except NothingToDo as done:
        if os.environ.get("RANK", "0") == "0":
            print(done, flush=True)
        sys.exit(0)
    except Interrupted:
        sys.exit(143)
    except KeyboardInterrupt:
        # Under a launcher Ctrl-C stops the launcher itself, which passes it on to every process and ends with its
        # own traceback, never showing their error files: said here, by one process a machine, at once; a second
        # Ctrl-C does not interrupt the exit
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print("interrupted (Ctrl-C); with checkpoints, --resume latest continues from the last one",
                  file=sys.stderr, flush=True)
        sys.exit(130)
    except (OSError, RuntimeError, MemoryError) as error:
        # out of file descriptors: this process, or a DataLoader worker (its OSError re-raised here as text)
        if (getattr(error, "errno", None) == errno.EMFILE
                or re.search(r"Too many open files|received 0 items of ancdata", str(error))):
            exit_with_message(f"error: {too_many_open_files()}", 1)
        waited = re.match(r"DataLoader timed out after (\d+) seconds", str(error))
        if waited:  # common.folders.LOADER_TIMEOUT_S
            exit_with_message(f"error: a DataLoader worker handed over no batch in {waited[1]} s: it is stuck, or the "
                              "batch was lost on its way (an error it printed would be above). Run the same command "
                              "again (with checkpoints, --resume latest continues from the last one); should it "
                              "happen again, --num_workers 0 reads the images without workers.", 1)
        memory = out_of_memory(error)
        if memory:  # a batch too large for the GPU or the machine: the user's to fix, not a bug of ours
            exit_with_message(f"error: out of memory ({memory}). Lower --batch_size (it is per process; --grad_accum "
                              "keeps the global batch) or the image size, or free the memory other programs hold; with "
                              "checkpoints, --resume latest continues from the last one.", 1)
        shared = out_of_shared_memory(error)
        if shared:  # a container's /dev/shm: the DataLoader workers hand their batches over through it
            exit_with_message(f"error: the DataLoader workers ran out of shared memory ({shared}), through which "
                              "they hand each batch over. A container's /dev/shm is 64 MB unless it is given more: "
                              "docker run --shm-size=8g (or --ipc=host; on Kubernetes an emptyDir of medium Memory at "
                              "/dev/shm); else lower --batch_size or --num_workers (0: no workers, no shared memory, "
                              "slower). With checkpoints, --resume latest continues from the last one.", 1)
        if not isinstance(error, RuntimeError):
            raise
        torch = sys.modules.get("torch")  # not imported here: a process that never imported it has no collective
        if torch is None:
            raise
        # gloo's own words without its name too: "Application timeout caused pair closure" (DDP's buffer broadcast)
        from_collective = (isinstance(error, torch.distributed.DistError)
                           or re.search(r"gloo|nccl|c10d|pair closure", str(error), re.IGNORECASE))
        if not (torch.distributed.is_initialized() and from_collective
                and re.search(PEER_LOST, str(error), re.IGNORECASE)):
            raise
        exit_with_message(f"error: lost the other processes ({' '.join(str(error).split())}): one of them failed, "
                          "hung longer than --dist_timeout, or its machine was lost; its own output says which. "
                          "Continue from the last checkpoint with --resume latest.", 1, consequence=True)


def a_neighbour_ended(wait_s):
    """Whether one of the other processes its launcher started on this machine (LOCAL_WORLD_SIZE of them: the
    parent's children with this one's command line) has ended, or ends within `wait_s`. True where that cannot be
    told."""
    import psutil  # Accelerate's dependency

    def running(process):
        try:
            return process.status() != psutil.STATUS_ZOMBIE and process.cmdline() == command
        except psutil.Error:  # ended and gone since
            return False

    others = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1
    if others < 1:
        return False
    deadline = time.monotonic() + wait_s
    try:
        me = psutil.Process()
        launcher, command = me.parent(), me.cmdline()
        while sum(running(p) for p in launcher.children() if p.pid != me.pid) >= others:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except (psutil.Error, AttributeError):  # AttributeError: no parent left (None)
        pass
    return True


def raised_in_a_worker(error):
    """The message of a UserError a DataLoader worker raised, which comes back as one whose message is the worker's
    whole traceback (torch's ExceptionWrapper): its last line, without the exception's name; else None."""
    text = str(error).rstrip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        return re.sub(r"^[\w.]+: ", "", text.splitlines()[-1])
    return None


def out_of_memory(error):
    """What ran out and how much was asked for, in a few words, if `error` is an allocation that failed (PyTorch's
    CUDA or CPU allocator, Python's MemoryError); else None."""
    if isinstance(error, MemoryError):
        return "the machine's"
    text = " ".join(str(error).split())
    found = re.search(r"CUDA out of memory\. Tried to allocate ([\d.]+ \w+)|you tried to allocate (\d+) bytes", text)
    if found and found.group(1):
        return f"the GPU's, allocating {found.group(1)} more"
    if found:
        return f"the machine's, allocating {int(found.group(2)) / 2 ** 20:,.0f} MiB more"
    torch = sys.modules.get("torch")  # an error of PyTorch's allocator only where it was imported
    return text[:300] if torch is not None and isinstance(error, torch.OutOfMemoryError) else None


def too_many_open_files():
    """The message for a process, or its DataLoader workers, out of file descriptors; the spare ones are given back
    to write it and to exit."""
    import resource

    while _spare_descriptors:
        os.close(_spare_descriptors.pop())
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f"too many open files: this process may hold {limit} at once (`ulimit -n`, already raised to the hard "
            "limit), and each DataLoader worker holds several. Raise the hard limit before the launch (ulimit -Hn "
            "65536 as root, nofile in /etc/security/limits.conf, docker run --ulimit nofile=65536), or pass fewer "
            "--num_workers (0: none, slower). With checkpoints, --resume latest continues from the last one.")


def out_of_shared_memory(error):
    """How large /dev/shm is and how much of it is free, if `error` is a DataLoader worker's failure to put a batch
    there (PyTorch's words for it: an allocation that failed, a worker's bus error); else None."""
    if not re.search(r"shared memory|\(shm\)|Bus error", str(error)):
        return None
    try:
        disk = os.statvfs("/dev/shm")
        return (f"/dev/shm holds {disk.f_blocks * disk.f_frsize / 2 ** 20:,.1f} MB, "
                f"{disk.f_bavail * disk.f_frsize / 2 ** 20:,.1f} MB of it free now")
    except OSError:
        return "no /dev/shm"


# under torchrun, how long a process that may not be the first to fail waits before it reports: long enough for
# the launcher to see the first one's exit (it looks every 0.1 s; a process ends without the interpreter's
# teardown) and stop the others
REPORT_GRACE_S = 5
# how long a process failing as a consequence waits for one of its launcher's other processes on this machine to
# end, before it takes the cause to be elsewhere (another machine, a hung process) and reports at once: a process
# that lost its peer sees it once the peer's sockets close, at its end or in its teardown
NEIGHBOUR_END_S = 2


def exit_with_message(message, code, *, consequence=False):
    """Show `message` once, then exit with `code`. Under torchrun it goes into TORCHELASTIC_ERROR_FILE, which the
    launcher's failure table shows (printing would repeat it per process); elsewhere it goes to stderr. A process
    not local rank 0, or failing as a `consequence` of a process on this machine that ended, first waits
    REPORT_GRACE_S (the launcher stops it meanwhile), so the first failure shows alone. A consequence of a failure
    elsewhere (another machine's process, a hung one) is reported at once: nothing would stop the wait, and the
    launcher would restart or end the run only after it."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        if consequence or os.environ.get("LOCAL_RANK", "0") != "0":
            # stopped by the launcher while it waits: it ends there, through its exit's cleanups (DataLoader
            # workers, the /tmp/pymp-* folder their sockets are in), not as SIGTERM's default (which left the folder)
            signal.signal(signal.SIGTERM, _end_now)
            if not consequence or a_neighbour_ended(NEIGHBOUR_END_S):
                time.sleep(REPORT_GRACE_S)
        try:  # torch.distributed.elastic's ErrorHandler format; the table shows ["message"]["message"]
            with open(error_file, "w") as file:
                json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, file)
        except OSError:
            error_file = None
    if not error_file:
        print(message, file=sys.stderr, flush=True)
    sys.exit(code)

"""Where runs and tools write: checked before anything is computed, and nothing a user has is ever lost.

Nothing is moved or replaced before everything a run reads has been checked; no output is written onto an input;
a file is replaced only by a rename of its complete successor (`write_atomically`, the one writer).
"""

import atexit
import errno
import hashlib
import os
import re
import shutil
import socket
import threading
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from filelock import SoftFileLease, Timeout

from .errors import UserError
from .images import is_hidden, run_files

# a folder holding one of these holds a run; the others are written by a run too, and go aside with it
RUN_FILES = ("metrics.jsonl", "checkpoints", "best", "classification_report.json")
RUN_OUTPUTS = (*RUN_FILES, "classification_report.txt", "confusion_matrix.png", "curves.png", "logs", "test",
               "evaluation", "report.html", "mistakes.json", "losses.csv", "label_issues.csv")
PREVIOUS_RUN = "previous_run"


def prepare_output_dir(output_dir, *, overwrite, resume, inputs, accelerator):
    """Check --output_dir before anything is built, create it and lock it for this run; deletes nothing but
    what a killed run left half-written. An earlier run there is refused unless --resume or --overwrite."""
    output_dir = Path(output_dir)
    check_not_inside(output_dir, inputs, flag="--output_dir")
    check_not_in_a_run(output_dir, flag="--output_dir")
    check_not_nested(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file: choose a folder (it is created if missing)")
    if output_dir.is_symlink() and not output_dir.exists():
        raise UserError(f"--output_dir {output_dir} is a link to {os.readlink(output_dir)}, which does not exist "
                        "(a disk not mounted?): create that folder, or choose another --output_dir")
    check_foreign_files(output_dir, accelerator)
    problem = None
    if accelerator.is_main_process:
        try:
            made = [folder for folder in (output_dir, *output_dir.parents) if not folder.exists()]
            output_dir.mkdir(parents=True, exist_ok=True)
            _made.extend(made)
            problem = lock_output_dir(output_dir)
        except OSError as error:
            problem = (f"cannot write to --output_dir {output_dir} ({error.strerror}): choose a folder on a writable "
                       "filesystem with free space")
        if problem is None:
            remove_leftovers(output_dir)
    if accelerator.num_processes > 1:
        problem = broadcast_object_list([problem])[0]
    if problem:
        raise UserError(problem)
    earlier = earlier_run(output_dir)
    if earlier and not (resume or overwrite):
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        raise UserError((f"{output_dir} already holds a run ({', '.join(earlier)}). Pass --resume latest to continue "
                         "it, --overwrite to replace it, or choose another --output_dir." if has_checkpoint(output_dir)
                         else f"{output_dir} holds the outputs of a run that never reached its first checkpoint "
                         f"({', '.join(earlier)}): there is nothing to continue. Pass --overwrite (or --resume auto) "
                         "to start it again, or choose another --output_dir.")
                        + (f" This is the launcher's restart {restart} of the run: launch with --resume auto, and a "
                           "restart continues from the last checkpoint." if restart else ""))
    if accelerator.num_processes > 1:
        check_shared(output_dir, accelerator)
    return output_dir


# ---- one run writes a run folder at a time ----

LOCK_FILE = ".lock"
LOCK_LEASE_S = 60  # a lock not refreshed for this long (its holder's machine died) may be taken over
_locks = {}  # the run folders this process holds: {resolved folder: filelock.SoftFileLease}
_made = []  # the folders this process created for its run folder, deepest first: removed at the end if still empty


def lock_output_dir(output_dir):
    """Take OUTPUT_DIR/.lock until exit or `unlock_output_dirs`; None, or why not. A lease (a marker file that a
    thread refreshes), since fcntl/flock do not exclude across NFS clients: a dead holder's is taken over at once on
    this host, from another host once unrefreshed for LOCK_LEASE_S; a holder paused longer can lose it."""
    folder = Path(output_dir).resolve()
    if folder in _locks:
        return None
    lock_file = folder / LOCK_FILE
    if lock_file.is_dir():
        return f"{lock_file} is a folder, where a run keeps its lock file: remove it and run again"
    lease = SoftFileLease(lock_file, lease_duration=LOCK_LEASE_S, heartbeat_interval=LOCK_LEASE_S / 6, timeout=0)
    try:
        lease.acquire()
    except Timeout:
        owner, wait = lease.owner, 0
        if owner is None:  # not a marker filelock can read (half-written, or not its own): it removes those after 2 s
            wait = 3
        elif owner.hostname != _lock_host_name():
            print(f"{output_dir} is locked by process {owner.pid} on {owner.hostname}: waiting up to "
                  f"{LOCK_LEASE_S} s in case that run was lost with its machine", flush=True)
            wait = LOCK_LEASE_S * 1.25
        elif _is_zombie(owner.pid):
            lease.force_break()  # it was killed, and its parent has not collected it yet: filelock sees it alive
        with suppress(Timeout):
            lease.acquire(timeout=wait)
        if not lease.is_locked:
            owner = lease.owner
            holder = f"process {owner.pid} on {owner.hostname}" if owner else "another process"
            return (f"{output_dir} is being written by another run ({holder} holds {lock_file}). Wait for it to end "
                    "or stop it, or choose another --output_dir.")
    _locks[folder] = lease
    return None


def _is_zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _lock_host_name():
    """This machine as filelock names it in a marker (its hostname, plus the PID namespace inside a container)."""
    try:
        from filelock._identity import host_name
    except ImportError:  # another filelock layout: a container's own runs then wait out the lease before a refusal
        return socket.gethostname()
    return host_name()


@atexit.register
def unlock_output_dirs():
    finish_writes(raise_error=False)  # a run that failed: what it handed over is on the disk before the folder is free
    while _locks:
        _locks.popitem()[1].release(force=True)
    while _made:  # a run that failed before it wrote anything leaves no empty folder behind
        with suppress(OSError):  # not empty: what a run wrote is never removed
            _made.pop(0).rmdir()


def remove_leftovers(output_dir):
    """Remove what a killed run left half-written, and put back what `publish` had moved aside (main process)."""
    output_dir, checkpoints = Path(output_dir), Path(output_dir) / "checkpoints"
    for path in [*output_dir.glob(".*"), *(checkpoints.glob(".*") if checkpoints.is_dir() else [])]:
        name = path.name[1:].removesuffix(".old")
        if path.name.endswith(".old") and (name in RUN_OUTPUTS or name.startswith("epoch_")):
            _put_back(path, path.with_name(name))
        elif re.fullmatch(r"\.tmp-.+|\..+\.\d+\.tmp.*|\.(shared-check|write-probe)-.+", path.name):
            remove(path)


def earlier_run(output_dir):
    """The RUN_FILES in `output_dir`; a checkpoints/ folder without `latest` holds no checkpoint, only leftovers, and
    a best/ without meta.json is not ours."""
    output_dir = Path(output_dir)
    return [name for name in RUN_FILES if (output_dir / name).exists()
            and (name != "checkpoints" or has_checkpoint(output_dir))
            and (name != "best" or (output_dir / "best" / "meta.json").is_file())]


# what a run that died before its first epoch's end leaves in its folder (its trackers' logs, checkpoints/ without a
# checkpoint, the earlier run it set aside): a folder holding these is still a run's
LEFT_BEFORE_A_RUN = ("logs", "checkpoints", PREVIOUS_RUN)


def check_foreign_files(output_dir, accelerator):
    """In a folder without a run (`earlier_run`), a file or folder of the user's named as a run's output (their
    report.html, a best/ of their own, a dataset's test/) would be replaced: refused. Others stay beside the run's
    outputs, with a line (a scheduler's log is often written there before the run starts)."""
    if not output_dir.is_dir() or earlier_run(output_dir):
        return
    foreign = sorted(entry.name for entry in os.scandir(output_dir) if not is_hidden(entry.name) and not (
        entry.name in LEFT_BEFORE_A_RUN and entry.is_dir() and (entry.name == PREVIOUS_RUN
                                                                or not earlier_run(entry.path))))
    runs = [name for name in foreign if name not in RUN_OUTPUTS and earlier_run(output_dir / name)]
    if runs:  # a folder of runs (outputs/): this one's files would lie among them, and every --overwrite mix them
        raise UserError(f"--output_dir {output_dir} is a folder of runs ({', '.join(runs[:3])}"
                        f"{', ...' if len(runs) > 3 else ''}): give this run a folder of its own, e.g. --output_dir "
                        f"{_unused(output_dir / 'run')}")
    replaced = [name for name in foreign if name in RUN_OUTPUTS]
    if replaced:
        raise UserError(f"--output_dir {output_dir} holds {', '.join(replaced)}, which no run wrote there (it holds "
                        "no metrics.jsonl, best/meta.json or checkpoint) and a run would replace: choose a new or "
                        f"empty folder (it is created), e.g. --output_dir {_unused(output_dir / 'run')}, or move "
                        f"{'them' if len(replaced) > 1 else 'it'} away.")
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        accelerator.print(f"note: --output_dir {output_dir} already holds files of yours ({shown}): the run writes "
                          "its outputs beside them and leaves them as they are")


def _unused(path):
    """`path`, or path-2, path-3, ...: the first that does not exist (a folder to suggest)."""
    return next(candidate for n in range(1, 1000) if not (candidate := path.with_name(
        path.name if n == 1 else f"{path.name}-{n}")).exists())


def check_not_nested(output_dir):
    """Not in a run's own folders (RUN_OUTPUTS, previous_run/: logs/, test/, ...), which that run sets aside with its
    other outputs, and deletes, when it is run again with --overwrite."""
    resolved = Path(output_dir).resolve()
    for folder in (resolved, *resolved.parents):
        if folder.name in (*RUN_OUTPUTS, PREVIOUS_RUN) and earlier_run(folder.parent):
            raise UserError(f"--output_dir {output_dir} {'is' if folder == resolved else 'is inside'} {folder}, the "
                            f"{folder.name}/ of the run in {folder.parent}, which that run sets aside and deletes with "
                            "its other outputs when it is run again with --overwrite. Choose a place outside it, e.g. "
                            f"--output_dir {folder.parent / 'runs' / resolved.name}.")


def has_checkpoint(output_dir):
    return (Path(output_dir) / "checkpoints" / "latest").is_file()


def latest_checkpoint(checkpoints):
    """The checkpoint folder that CHECKPOINTS/latest names (it may be gone since), or None where that file is not."""
    pointer = Path(checkpoints) / "latest"
    return pointer.parent / pointer.read_text(errors="replace").strip() if pointer.is_file() else None


def set_aside_earlier_run(output_dir, accelerator):
    """Call it once all inputs are read and checked: an earlier run's outputs (ours only) go into previous_run/,
    deleted at the new run's first checkpoint, so a run that fails before then leaves it to recover from."""
    output_dir = Path(output_dir)
    earlier = earlier_run(output_dir)
    if accelerator.is_main_process and earlier:
        previous = output_dir / PREVIOUS_RUN
        remove(previous)
        with failed_write_is_said(previous):  # a folder needs a block too
            previous.mkdir()
            for name in RUN_OUTPUTS:
                if (output_dir / name).exists():
                    os.replace(output_dir / name, previous / name)
        accelerator.print(f"the earlier run's outputs ({', '.join(earlier)}) are in {previous} until this run's first "
                          "checkpoint")
    accelerator.wait_for_everyone()


def remove_previous_run(output_dir):
    """The new run has a checkpoint of its own: the run it replaced is no longer needed (main process)."""
    remove(Path(output_dir) / PREVIOUS_RUN)


def check_shared(output_dir, accelerator):
    """Every process must see the main process's files: checkpoints hold each process's RNG state."""
    token = broadcast_object_list([uuid.uuid4().hex])[0]
    probe = output_dir / f".shared-check-{token}"
    if accelerator.is_main_process:
        probe.touch()
    accelerator.wait_for_everyone()
    seen = accelerator.gather(torch.tensor([probe.exists()], device=accelerator.device)).tolist()  # every process
    if accelerator.is_main_process:
        probe.unlink()
    if not all(seen):
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        raise UserError(f"--output_dir {output_dir} is not shared between the machines: processes {blind} do not "
                        "see the file process 0 wrote there. Put --output_dir on a filesystem every node mounts "
                        "(checkpoints hold every process's state).")


def check_not_inside(output, inputs, *, flag):
    resolved = Path(output).resolve()
    for item in inputs:
        source = Path(item).resolve()
        if resolved == source or source in resolved.parents:
            raise UserError(f"{flag} {output} is inside the input {item}: its files would be mixed into the data "
                            f"(and read as images by the next run). Choose a place outside {item}.")


# a run's folders that it replaces or deletes whole, and when
REPLACED_WHOLE = {"best": "which it replaces whole each time a later epoch scores better (a resumed run's too)",
                  "checkpoints": "where it deletes its older checkpoints, and which --overwrite sets aside",
                  PREVIOUS_RUN: "deleted whole at the first checkpoint of the run that replaced it"}


def check_not_in_a_run(output, *, flag):
    """`output` (a folder or file to write) is not in a run's best/, checkpoints/ or previous_run/, where what is
    written would be lost with the folder, without a word, when the run next writes it."""
    resolved = Path(output).resolve()
    for folder in (resolved, *resolved.parents):
        held = folder if folder.name == PREVIOUS_RUN else folder.parent  # the run's own files
        if folder.name in REPLACED_WHOLE and (has_checkpoint(held) or run_files(held)):
            shown = folder.relative_to(Path.cwd()) if Path.cwd() in folder.parents else folder
            raise UserError(f"{flag} {output} {'is' if folder == resolved else 'is inside'} {shown}, the "
                            f"{folder.name}/ folder of a run, {REPLACED_WHOLE[folder.name]}: what is written there "
                            "would be lost with it. Choose a place outside it.")


def make_folder(folder, *, inputs=(), flag="--work_dir"):
    """A tool's work or output folder (`flag`), created: not inside its `inputs` or a run's folders that it replaces
    whole, not a file, on a filesystem it can write to."""
    folder = Path(folder)
    check_not_inside(folder, inputs, flag=flag)
    check_not_in_a_run(folder, flag=flag)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file: choose a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot write to {flag} {folder} ({error.strerror}): choose a folder on a writable "
                        "filesystem") from None
    return folder


def check_ours(folder, *, marker, flag):
    """A folder a tool replaces or empties whole (a work folder, a prepared one) must be absent, empty, or hold
    `marker`, the file that tool writes into what it makes: a folder of the user's, named by mistake, is refused,
    never deleted."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file: choose a folder (it is created if missing)")
    if not (folder / marker).exists() and any(folder.iterdir()):
        raise UserError(f"{flag} {folder} holds files this tool did not write (no {marker}), which it would replace: "
                        "choose a new folder (it is created), or empty that one yourself")


# ---- what was written, checked when read back ----

def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def find_damage(folder, files):
    """What differs from the recorded {file: [size, sha256]}, or None: Accelerate would load a cut file silently."""
    for name, (size, digest) in files.items():
        file = folder / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} holds {file.stat().st_size} bytes, {size} when it was saved"
        if sha256(file) != digest:
            return f"{file} does not hold what was saved (its checksum differs)"
    return None


# ---- the one writer ----

class WriteFailed(UserError):
    """A file or folder could not be written (a full disk, a quota, permissions); `fix` says what to do, `remedy` the
    part of it for this cause: free some space, or (`denied`: read-only, permissions) write somewhere else."""

    def __init__(self, path, reason, *, denied=False):
        super().__init__(path, reason)
        self.path, self.reason, self.free, self.denied = path, reason, _free_space(path), denied
        self.remedy = "make it writable, or choose a place you can write to" if denied else "free some space"
        self.fix = ("Make it writable, or choose a place you can write to, and run the command again." if denied
                    else "Free some space (or choose another place) and run the command again.")

    def __str__(self):
        space = "" if self.denied else f" ({self.free} free there)"
        return f"cannot write {self.path}: {self.reason}{space}. Nothing half-written was left. " + self.fix


def write_atomically(path, write, *, later=False):
    """Write the file or folder `path` whole or not at all: `write(tmp)` writes a temporary beside it, which
    `publish` renames over `path`. Every file a run or tool writes goes through here. `later`: both on
    `finish_later`'s thread while the caller goes on (`write` must read nothing that changes meanwhile)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")  # the suffix: savefig, np.save read it

    def write_and_publish():
        try:
            with failed_write_is_said(path):
                write(tmp)
                publish(tmp, path)
        finally:
            remove(tmp)

    if later:
        finish_later(write_and_publish)
    else:
        write_and_publish()


_finishing = {"thread": None, "error": None}  # the write finish_later took over, and what it raised


def finish_later(finish):
    """Call `finish` (a write, or its last part: checksums, flushing to the disk, renames; it must not read what
    training changes) on a thread of its own, so that training goes on meanwhile (on one H100 a checkpoint and
    `best/` cost a third of a second an epoch, in epochs of 1.3 s). One at a time: the write handed over before
    it is finished first, so they land in order. Its error is raised by the next `finish_later` or `finish_writes`.
    Not a daemon: the process's exit (common.errors.end_process) waits for it."""
    finish_writes()

    def run():
        try:
            finish()
        except BaseException as error:  # noqa: BLE001 (raised again in the caller's thread)
            _finishing["error"] = error

    thread = _finishing["thread"] = threading.Thread(target=run, name="finish_writes")
    thread.start()


def finish_writes(*, raise_error=True):
    """Wait for the write `finish_later` took over to be on the disk under its name; raise its error here."""
    thread, _finishing["thread"] = _finishing["thread"], None
    if thread is not None:
        thread.join()
    error, _finishing["error"] = _finishing["error"], None
    if error is not None and raise_error:
        raise error


@contextmanager
def failed_write_is_said(path):
    """An error the filesystem explains (no space, quota, permissions) becomes a WriteFailed. PyTorch's and
    safetensors' errors do not say why (`unexpected pos 704 vs 598`), so a small write next to `path` asks."""
    try:
        yield
    except Exception as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else _probe_write(Path(path).parent)
        if reason is None and re.search(SHORT_WRITE, f"{error} {error.__context__}"):
            # the disk refused a block, then had room again (ext4 gives back a failed file's reservations)
            reason = f"the disk stopped the write short, full at that moment ({' '.join(str(error).split())})"
        if reason is None:
            raise
        denied = getattr(error, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM)  # not for want of space
        raise WriteFailed(path, reason, denied=denied) from None


# what PyTorch's zip writer and safetensors say when the disk refused a write, without saying why
SHORT_WRITE = r"unexpected pos|iostream error|failed writing file|StorageFull|No space left|quota"


def write_if_possible(path, write):
    """write_atomically, or nothing where the folder cannot be written (for caches that only save time): whether
    it was written."""
    try:
        write_atomically(path, write)
    except WriteFailed:
        return False
    return True


def _probe_write(folder):
    """Why 64 KiB cannot be written to disk in `folder` (the OSError's words), or None when they can."""
    probe = Path(folder) / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as file:
            file.write(bytes(1 << 16))
            file.flush()
            os.fsync(file.fileno())  # a network filesystem may say no only here
        return None
    except OSError as error:
        return error.strerror or str(error)
    finally:
        probe.unlink(missing_ok=True)


def _free_space(path):
    """The free space where `path` is (its nearest existing folder), e.g. '1.2 MB'."""
    folder = Path(path).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} bytes"


def publish(tmp, final):
    """Put the complete `tmp` in the place of `final`: flushed first, so that the atomic rename never publishes
    data still in memory. A folder takes two renames; a kill between them leaves `.final.old`, which is put back."""
    old = final.with_name(f".{final.name}.old")
    _put_back(old, final)
    for item in [*tmp.rglob("*"), tmp] if tmp.is_dir() else [tmp]:
        _fsync(item)
    if tmp.is_dir() and final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    remove(old)


def _put_back(old, final):
    if old.exists() and not final.exists():
        os.replace(old, final)
    remove(old)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path):
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():  # not unlinked blind: a read-only filesystem refuses even a missing file
        path.unlink(missing_ok=True)

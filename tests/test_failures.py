"""Failure paths: an error never hangs, a run folder has one writer, a full disk or a kill strands nothing, a damaged
checkpoint is never used, and a careless command gets one message, not a traceback."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, descendants, kill_everything, launch_command, spawn, wait_for

SEEDLINGS = REPO / "scripts" / "train_seedlings.py"
# a tiny seedlings run with one DataLoader worker per process
SMALL_SEEDLINGS = ["--model", "resnet18", "--image_size", 32, "--epochs", 1, "--batch_size", 8, "--mixup_alpha", 0,
                   "--cutmix_alpha", 0, "--num_workers", 1]


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


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("mode", ["raise", "keep"])
def test_an_error_or_a_live_worker_at_exit_never_hangs_the_process(tmp_path, seedlings, processes, mode):
    """The folder DataLoader's workers ignore SIGTERM (so that a scheduler's SIGTERM lets the run save); at exit
    Python stops them with SIGTERM and used to wait forever. Now every exit kills them first."""
    copy = tmp_path / "my_train_seedlings.py"
    copy.write_text(CRASHING_COPY)
    args = [mode, "--data_dir", seedlings, "--output_dir", tmp_path / "run", *SMALL_SEEDLINGS]
    command = launch_command(copy, *args, processes=processes) if processes > 1 else [sys.executable, copy, *args]
    log = tmp_path / "log"
    process = spawn(command, log=log)
    ended = "a bug in the copied script" if mode == "raise" else "outputs written to"
    try:
        wait_for(lambda: ended in log.read_text(), process, timeout=300)
        family = descendants(process.pid)[1:]  # the training processes and their DataLoader workers
        code = process.wait(timeout=30)  # before the fix: never (the workers ignore the SIGTERM sent at exit)
    finally:
        kill_everything(process)
    output = log.read_text()
    assert (code == 0) == (mode == "keep"), output
    if mode == "raise":
        assert "RuntimeError: a bug in the copied script" in output
    assert family and all_gone(family), output


def all_gone(pids, timeout=10):
    """Whether every process of `pids` has ended (or is a zombie waiting for its parent) within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [pid for pid in pids if _running(pid)]:
            return True
        time.sleep(0.05)
    return False


def _running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

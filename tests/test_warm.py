"""The tests' own stand-in `python` (tests/warm.py), which the tools' tests start their scripts through: what a tool
reads of a script it started (exit code, a signal's death) is what a real interpreter gives, and a script never
outlives its stand-in (a tool's timeout kills the stand-in; its script must go with it)."""

import os
import signal
import subprocess
import sys

import pytest

from conftest import all_gone, wait_for

pytestmark = pytest.mark.slow  # as the tests that use the stand-in: its server imports torch and the rest first

SCRIPT = """import os, sys, time
from pathlib import Path
Path(sys.argv[1] + ".tmp").write_text(f"{os.getpid()} {os.getppid()}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(300)  # until a signal ends it (and by itself, were a failed test to leave it behind)
"""


def test_the_stand_in_returns_the_scripts_end_and_takes_it_along_when_killed(tmp_path, warm_children):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)

    def start(name, how):
        process = subprocess.Popen([sys.executable, script, tmp_path / name, how])
        wait_for(lambda: (tmp_path / name).exists(), process)
        pid, parent = map(int, (tmp_path / name).read_text().split())
        assert pid != process.pid and parent == os.getpid()  # forked warm; its parent: the stand-in's
        return process, pid

    assert subprocess.run([sys.executable, script, tmp_path / "exits", "exit"]).returncode == 3

    process, pid = start("terminated", "wait")
    process.terminate()  # passed on: the script dies of it, and so does the stand-in
    assert process.wait(timeout=60) == -signal.SIGTERM
    assert all_gone([pid])

    process, pid = start("killed", "wait")
    process.kill()  # the stand-in cannot pass a SIGKILL on: the server kills its script
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert all_gone([pid], timeout=60), f"the script (pid {pid}) of a killed stand-in still runs"

"""Shared fixtures: real data (CIFAR-10 JPEGs of tests/fixtures, Fashion-MNIST) and a helper that runs real launches."""

import contextlib
import gzip
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

# The pytest-xdist workers share the cores: each takes its share (1 of 2). A run in a worker (or a process it starts)
# with a thread per core waits, at every operation's end, for a thread of it that the other worker's processes keep
# off its core: a 1-process digits run took 25-30 s beside two busy processes with 2 threads, 4.5 s with 1. Set
# before torch is imported (it reads it once); every process the tests start inherits it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                    // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
# A test run started as a shell's background job (`make test &`, a CI step's) inherits Ctrl-C ignored, and so would
# every process it starts: they start as a terminal starts them, with Ctrl-C at its default (tests send it).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
import torch  # noqa: E402
from accelerate.utils import compare_versions  # noqa: E402
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"  # small real images, made by tests/fixtures/make_fixtures.py
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
CPU_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"
NEEDS_GB = 4  # the largest test's folder (checkpoints of ResNet-50) and the session's shared data, with room
# `accelerate launch`'s exit code when it is sent SIGTERM: Accelerate 1.16 exits 128 + 15 like the processes it stops;
# before, torchrun's SignalException ended it with a traceback and 1
LAUNCHER_SIGTERM_CODE = 143 if compare_versions("accelerate", ">=", "1.16") else 1


def pytest_sessionstart(session):
    """A disk too full for the suite is one message before it starts, not checkpoint writes failing half an hour in.
    Hugging Face datasets are the tests' own, offline, cached in the session's folder (not the user's cache)."""
    base = Path(session.config._tmp_path_factory.getbasetemp()).parent
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(session.config._tmp_path_factory.mktemp("hf-cache")),
                      HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    free = shutil.disk_usage(base).free / 1e9
    if free < NEEDS_GB:
        pytest.exit(f"only {free:.1f} GB free in {base}, where the tests write their runs; they need about {NEEDS_GB} "
                    "GB: free some space there (or set --basetemp / TMPDIR to a roomier place)", returncode=3)


# The test files by their tests' time, longest first (the 2-core AMD EPYC with AVX2 only, 2026-12-03): pytest-xdist's
# --dist loadfile --no-loadscope-reorder (the Makefile's) hands whole files to its workers in the order they were
# collected, so the last ones handed out are short and both workers end at about the same time (by their number of
# tests, xdist's default, a file of 4 tests and 70 s came last, and one worker ended 23-42 s after the other). A file
# not named here comes after these.
LONGEST_FIRST = ["test_distributed.py", "test_failures.py", "test_launch.py", "test_checkpoint.py", "test_bench_gpu.py",
                 "test_accuracy.py", "test_seedlings.py", "test_bad_inputs.py", "test_hf.py", "test_recipe.py",
                 "test_builders.py", "test_model_folder.py", "test_predict.py", "test_report.py", "test_evaluate.py",
                 "test_docs.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests in their order


def require(path, how):
    """Real data is part of the test; outside CI a missing file skips, in CI it fails."""
    if not Path(path).exists():
        message = f"{path} missing: {how}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def launch_command(*args, processes=2, config=CPU_CONFIG):
    """`accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes N <args>` as a list (`config`:
    another config; `processes` None: the config's own count)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            *(["--num_processes", str(processes)] if processes else []), *map(str, args)]


def process_command(*command, processes):
    """`command` (a script and its arguments) launched on `processes` (launch_command), or `python SCRIPT ...` on 1."""
    return launch_command(*command, processes=processes) if processes > 1 else [sys.executable, *command]


def launch(*args, processes=2, cwd=None, env=None, timeout=600):
    """A real multi-process launch on CPU, captured."""
    return run_command(launch_command(*args, processes=processes), cwd=cwd, env=env, timeout=timeout)


def launch_warm(*args, processes=2, cwd=None, env=None, timeout=600):
    """launch(), its processes forked from a server that has imported torch, Accelerate and timm already, with the
    environment `accelerate launch` gives them (tests/warm.py): for the runs whose outputs a test reads. A test of
    the launcher itself (signals, restarts, machines, its messages) launches a real one."""
    import warm

    return warm.launch(*args, processes=processes, cwd=cwd or REPO, env=env, timeout=timeout)


@pytest.fixture
def warm_children(monkeypatch):
    """The processes a tool run by script() starts as `sys.executable SCRIPT` or `-m MODULE` (a training script, a
    launcher and its processes, a peer's script) are forked from the warm server (tests/warm.py: python): for the
    tools' tests, which check what a tool does with its runs, not how fast an interpreter starts."""
    import warm

    stand_in, address = warm.python()
    monkeypatch.setattr(sys, "executable", stand_in)
    monkeypatch.setenv(warm.ADDRESS, address)


def run_command(command, *, cwd=None, env=None, timeout=600):
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(list(map(str, command)), cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    result.output = result.stdout + result.stderr
    return result


def script(name, *args, threads=None):
    """`python scripts/NAME ARGS` as one process would run it (`threads`: as with OMP_NUM_THREADS=threads), but in this
    process: its main under call_main, what it and its DataLoader workers write to stdout and stderr captured
    (Python's and the C libraries'), SystemExit as the exit code, an uncaught exception as exit code 1 with its
    traceback; then the state a run leaves in its process (Accelerate's, the SIGTERM and SIGINT handlers, the run
    folder's lock, torch's thread count) put back. It saves each call an interpreter with torch and Accelerate to start
    (seconds on a 2-core CPU). Where a process is the point (signals, a launcher, an environment), the tests start one:
    `run_command` or `launch`."""
    from accelerate.state import AcceleratorState, GradientState

    from common import run
    from common.errors import call_main
    from common.outputs import unlock_output_dirs

    module = load_script(name)
    argv, saved = [str(REPO / "scripts" / name), *map(str, args)], (sys.argv, sys.stdout, sys.stderr,
                                                                     signal.getsignal(signal.SIGTERM),
                                                                     signal.getsignal(signal.SIGINT))
    kept_threads, code = torch.get_num_threads(), 0
    torch.set_num_threads(threads or kept_threads)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved[1].flush(), saved[2].flush()
        kept = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        # unbuffered, onto the descriptors: a forked worker's lines land in the same files
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
                                  for fd in (1, 2))
        sys.argv = argv
        try:
            with warnings.catch_warnings(record=True) as caught:  # pytest would keep them: on stderr, as a process
                warnings.simplefilter("always")
                try:
                    call_main(module.main, module.parse_args(argv[1:]))
                finally:
                    for warning in caught:
                        print(warnings.formatwarning(warning.message, warning.category, warning.filename,
                                                     warning.lineno), end="", file=sys.stderr)
        except SystemExit as stop:  # sys.exit(None | int | message), as the interpreter ends
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            os.dup2(kept[0], 1), os.dup2(kept[1], 2)
            os.close(kept[0]), os.close(kept[1])
            sys.argv, sys.stdout, sys.stderr = saved[:3]
            signal.signal(signal.SIGTERM, saved[3])
            signal.signal(signal.SIGINT, saved[4])  # a Ctrl-C's exit ignores the next (common.errors.call_main)
            run._signals_received.clear()
            unlock_output_dirs()
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            torch.set_num_threads(kept_threads)
        out.seek(0), err.seek(0)
        result = subprocess.CompletedProcess(argv, code, *(f.read().decode(errors="replace") for f in (out, err)))
    result.output = result.stdout + result.stderr
    return result


def refused(name, *args):
    """What `script(name, *args)` printed to stderr; it must stop with a UserError (exit 2)."""
    result = script(name, *args)
    assert result.returncode == 2, result.output
    return result.stderr


def load_script(name):
    """scripts/NAME as a module, to call its parse_args and main in this process."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    spec.loader.exec_module(module)
    sys.path[:] = path  # each script puts the repository first on it: once per load, the suite's hundreds of times
    return module


def spawn(command, *, log, env=None):
    """A command in the background, in a process group of its own, output to `log`."""
    return subprocess.Popen(list(map(str, command)), cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def descendants(pid):
    """`pid` and every process below it (torchrun starts each worker in a session of its own)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    family, i = [pid], 0
    while i < len(family):
        family += children.get(family[i], [])
        i += 1
    return family


def worker_pid(launcher_pid, rank):
    """The training process of global rank `rank` under a launcher (the first one whose environment says so)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no process of rank {rank} under {launcher_pid}")


def worker_pids(process, processes=2):
    """The training processes of launch `process`, rank by rank, once all have started: found before the moment a
    test waits for, so that it acts on them at once (a first checkpoint's write lasts milliseconds)."""
    found = {}

    def started():
        for rank in set(range(processes)) - set(found):
            with contextlib.suppress(AssertionError):
                found[rank] = worker_pid(process.pid, rank=rank)
        return len(found) == processes

    wait_for(started, process)
    return [found[rank] for rank in range(processes)]


def kill_everything(process, *strays):
    """SIGKILL a run: the launcher, all its workers, and `strays` (pids that may have left the tree); returns once
    they are gone (a process SIGKILLed while it writes takes a moment to end, and until then holds its run folder)."""
    family = [*descendants(process.pid), *strays]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    assert all_gone(family, timeout=30), [(pid, process_state(pid)) for pid in family]


def all_gone(pids, timeout=10):
    """Whether every process of `pids` has ended (or is a zombie waiting for its parent) within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [pid for pid in pids if process_state(pid) not in ("Z", None)]:
            return True
        time.sleep(0.05)
    return False


def process_state(pid):
    """The state letter of process `pid` (R, S, D, Z ...), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def stop_inside_an_epoch(command, *, output_dir, log, processes=2, env=None):
    """Start `command` (a script, its arguments with --epochs and --checkpoint_every 1: a SIGTERM is obeyed at the next
    step) on `processes` in the background, and send SIGTERM once epoch 1 is saved (to the launcher, with 2: torchrun
    passes it on). It saves inside a later epoch and says so: the name of that checkpoint."""
    command = process_command(*command, processes=processes)
    process = spawn(command, log=log, env=env)
    wait_for(lambda: (output_dir / "checkpoints" / "epoch_001_end").exists(), process)
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=120)
    output, epochs = log.read_text(), f"[2-{command[command.index('--epochs') + 1]}]"
    assert returncode == (143 if processes == 1 else LAUNCHER_SIGTERM_CODE), output
    assert re.search(rf"stopped by SIGTERM at epoch {epochs}, step \d+: saved \S+/checkpoints/epoch_00{epochs}_batch_"
                     r"\d{6}\. Run the same command with --resume latest to continue\.", output), output
    latest = (output_dir / "checkpoints" / "latest").read_text().strip()
    assert re.fullmatch(rf"epoch_00{epochs}_batch_\d{{6}}", latest), output  # stopped in the middle of an epoch
    assert (output_dir / "checkpoints" / latest / "trainer_state.json").exists()
    return latest


def wait_for(condition, process=None, timeout=180):
    """Until `condition()`; `process`: a run that must not end before."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process is None or process.poll() is None, "the run ended before the moment the test waits for"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextlib.contextmanager
def small_disk(path, *, megabytes=8):
    """A tmpfs of `megabytes` mounted at `path` (a real filesystem that fills up); needs root."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk):
    """Write disk/filler until the filesystem has no byte left; returns the filler."""
    filler, block = disk / "filler", bytes(1 << 16)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, block)
    except OSError:
        return filler
    finally:
        os.close(fd)


def write_idx(path, array):
    """Write a uint8 array as an IDX file (gzipped when the name ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    (gzip.open if str(path).endswith(".gz") else open)(path, "wb").write(data)


@pytest.fixture
def socket_tmpdir():
    """A TMPDIR for a run whose DataLoader workers' folder (pymp-*) a test looks for: short, under /tmp. Their
    sockets' paths may be at most 107 bytes, and tmp_path under xdist is within a few of that; a deeper TMPDIR makes
    the run put them under /tmp (common.folders.socket_folder), where the test would not look."""
    folder = Path(tempfile.mkdtemp(prefix="t"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """A finished 4-epoch digits run (one process) with its best/, for the tools that use a trained model.
    Tests read it; one that changes it works on a copy."""
    output_dir = tmp_path_factory.mktemp("digits") / "run"
    result = script("train_mnist.py", "--dataset", "digits", "--epochs", 4, "--output_dir", output_dir)
    assert result.returncode == 0, result.output
    return output_dir


# the resume tests' run: 42 steps an epoch on 2 processes, 84 on 1, long enough to stop a run in the middle of one
DIGITS_RUN = ["--dataset", "digits", "--epochs", 4, "--batch_size", 16]
FP32 = ["--mixed_precision", "no"]  # where runs on other process counts are compared (tests/test_checkpoint.py)


@pytest.fixture(scope="session")
def digits_reference(tmp_path_factory):
    """DIGITS_RUN uninterrupted (1 or 2 processes, with flags added), a checkpoint every 10 steps kept: what a stopped,
    killed or resumed run must end as. FP32 where the CPU computes no bf16 is the default run (which trains in fp32
    there): the same run, trained once."""
    from common.distributed import cpu_computes_bf16

    runs = {}

    def get(processes, *flags):
        if list(flags) == FP32 and not cpu_computes_bf16():
            flags = ()
        if (processes, *flags) not in runs:
            output_dir = tmp_path_factory.mktemp(f"reference{processes}") / "run"
            args = [*DIGITS_RUN, *flags, "--output_dir", output_dir, "--checkpoint_every", 10, "--keep_checkpoints",
                    100]
            result = (launch_warm(REPO / "scripts" / "train_mnist.py", *args, processes=processes) if processes > 1
                      else script("train_mnist.py", *args))
            assert result.returncode == 0, result.output
            runs[processes, *flags] = output_dir
        return runs[processes, *flags]

    return get


@pytest.fixture(scope="session")
def cifar_jpegs(tmp_path_factory):
    """Real CIFAR-10 JPEGs as an ImageFolder tree: train/ 151 images, test/ 101 (sizes that divide by nothing).
    A copy of tests/fixtures/cifar10 (made by tests/fixtures/make_fixtures.py) that tests may change."""
    return Path(shutil.copytree(FIXTURES / "cifar10", tmp_path_factory.mktemp("cifar_jpegs") / "cifar10"))


@pytest.fixture(scope="session")
def seedlings(tmp_path_factory):
    """Real seedling photos (RGB PNGs, 48x48): 7 per class, 8 in the first, 85 in all, as root/<class>/<image>.
    A copy of tests/fixtures/seedlings (made by tests/fixtures/make_fixtures.py) that tests may change."""
    root = Path(shutil.copytree(FIXTURES / "seedlings", tmp_path_factory.mktemp("seedlings") / "plant-seedlings"))
    assert len(list(root.iterdir())) == 12 and len(list(root.rglob("*.png"))) == 85
    return root


@pytest.fixture(scope="session")
def fashion_subset(tmp_path_factory):
    """The first 2,001 training and 1,001 test images of the real Fashion-MNIST, as IDX files (gz and plain)."""
    require(FASHION_MNIST / "train-images-idx3-ubyte.gz", "apt-get install -y dataset-fashion-mnist")
    from common.mnist import read_idx

    root = tmp_path_factory.mktemp("fashion_subset")
    for split, count, suffix in (("train", 2001, ".gz"), ("t10k", 1001, "")):
        for kind in ("images-idx3", "labels-idx1"):
            array = read_idx(FASHION_MNIST / f"{split}-{kind}-ubyte.gz")[:count]
            write_idx(root / f"{split}-{kind}-ubyte{suffix}", array)
    return root


sys.path.insert(0, str(REPO))


# ---- what a finished run must show ----

def read_run(output_dir):
    """(metrics.jsonl's records, classification_report.json) of a finished run."""
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((output_dir / "classification_report.json").read_text())
    return metrics, report


CHROMIUM = shutil.which("chromium-headless-shell") or shutil.which("chromium")


class _Page(HTMLParser):
    """What a page shows: its <body> attributes, and per <section id> the images, table rows and gallery figures."""

    def __init__(self):
        super().__init__()
        self.body, self.sections, self._section = {}, {}, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "section":
            self._section = self.sections.setdefault(attrs.get("id"), {"img": 0, "tr": 0, "figure": 0})
        elif self._section is not None and tag in self._section:
            self._section[tag] += 1

    def handle_endtag(self, tag):
        if tag == "section":
            self._section = None


def open_in_browser(page):
    """report.html as a real browser shows it (Debian's headless Chromium): the page after its load event."""
    require(CHROMIUM or "chromium-headless-shell", "apt-get install -y chromium-headless-shell")
    result = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                             "--virtual-time-budget=10000", Path(page).absolute().as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    shown = _Page()
    shown.feed(result.stdout)
    return shown


def assert_report_shows(page, *, classes, top_losses, label_issues, arguments=True):
    """Every image of the report loads in the browser; the per-class table has a row per class, the galleries
    hold `top_losses` and `label_issues` images (None: not computed), the run's arguments are listed."""
    shown = open_in_browser(page)
    assert int(shown.body["data-images"]) == int(shown.body["data-images-shown"]) > 0, shown.body  # none broken
    sections = shown.sections
    assert sections["plots"]["img"] >= 1  # the confusion matrix, and the curves of a training run
    assert sections["classes"]["tr"] == classes + 1  # the header, and a row per class
    assert sections["top-losses"]["figure"] == top_losses
    assert sections["confused"]["figure"] > 0
    assert sections["label-issues"]["figure"] == (label_issues or 0)
    assert (sections["arguments"]["tr"] > 0) == arguments and "files" in sections
    return shown

TIMES = ("images_per_s", "train_time_s", "epoch_time_s", "since_launch_s")  # metrics.jsonl's clocks
# a run continued on another process count: each process computes with one thread, as torchrun gives 2 processes on
# 2 cores (kernels on another thread count round otherwise, and Adam makes steps of the rounding noise in the zero
# gradient of a bias right before a BatchNorm: docs/checkpoints.md), and the outcome is the same
# within ACROSS_COUNTS of each tensor's largest value (the gradients are summed in another order)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ACROSS_COUNTS = 1e-5


def close(ours, theirs, rel):
    """Within `rel` of the reference's largest magnitude (a tensor, or a list of numbers); integers exactly."""
    ours, theirs = torch.as_tensor(ours), torch.as_tensor(theirs)
    if not theirs.is_floating_point():
        return torch.equal(ours, theirs)
    return ours.shape == theirs.shape and bool((ours - theirs).abs().max() <= rel * theirs.abs().max())


def same_value(ours, theirs, rel):
    """A metrics.jsonl value: numbers (and lists of them) within `rel` of the value or of 1, whichever is larger (a
    loss of 0.2 is a mean of per-image losses each rounded to about 1e-6 whatever its size: how a convolution's sums
    are split depends on the batch's shape, which the process count changes), words (`val_tta`) exactly."""
    return ours == theirs if isinstance(theirs, str) else ours == pytest.approx(theirs, rel=rel, abs=rel)


def assert_same_outcome(run, reference, *, checkpoint, rel, per_process=True):
    """Same weights (and EMA weights), optimizer state, metrics and best-model predictions as `reference`, each
    tensor within `rel` of its largest value. `per_process`: also the same samples per process (same count)."""
    for name in [f"{checkpoint}/{file.name}" for file in (reference / checkpoint).glob("*.safetensors")] + [
            "best/model.safetensors"]:
        ours, theirs = load_file(run / name), load_file(reference / name)
        assert ours.keys() == theirs.keys()
        differ = [key for key in ours if not close(ours[key], theirs[key], rel)]
        assert not differ, (name, {key: (ours[key] - theirs[key]).abs().max().item() for key in differ})
    ours, theirs = (torch.load(r / checkpoint / "optimizer.bin", weights_only=True)["state"] for r in (run, reference))
    assert all(close(ours[i][key], theirs[i][key], rel) for i in theirs for key in theirs[i])
    ours, theirs = (read_run(r)[0] for r in (run, reference))
    assert len(ours) == len(theirs)
    for record, expected in zip(ours, theirs):
        assert record.keys() == expected.keys()
        left_out = TIMES + (() if per_process else ("train_samples_per_process",))
        differ = {k: (record[k], expected[k]) for k in record if k not in left_out
                  and not same_value(record[k], expected[k], rel)}
        assert not differ, (record["epoch"], differ)
    ours, theirs = ([line.split(",") for line in (r / "best" / "val_predictions.csv").read_text().splitlines()[1:]]
                    for r in (run, reference))
    assert [row[:3] for row in ours] == [row[:3] for row in theirs]  # index, label, prediction
    assert close([float(row[3]) for row in ours], [float(row[3]) for row in theirs], rel)  # printed to 6 digits


def assert_timed_runs(out, scripts, *, target):
    """benchmark_peers.py's JSON (`out`): a run of each of `scripts` per seed, each accuracy timed on the run's own
    clock, and the times to `target` and to each script's own final accuracy read from those."""
    assert list(out["runs"]) == scripts and len(out["seeds"]) == len(out["runs"][scripts[0]])
    for name in scripts:
        for run, times in zip(out["runs"][name], out["time_to_target"][name][f"{target:.0%}"]):
            (first, _), (last, final) = run["accuracies"][0], run["accuracies"][-1]
            assert 0 < first <= last <= run["wall_s"] and run["images_per_s"] > 0 and final == run["final_accuracy"]
            assert times == next((when for when, accuracy in run["accuracies"] if accuracy >= target), None)
        # a script reaches its own final accuracy at the evaluation that reported it, or earlier
        assert out["time_to_target"][name][f"{name} final"] == [run["accuracies"][-1][0] for run in out["runs"][name]]


def assert_two_processes_shared_the_data(metrics, *, train_size, batch_size):
    for record in metrics:
        per_process = record["train_samples_per_process"]
        assert len(per_process) == 2 and per_process[0] == per_process[1]
        # disjoint shares of one order: no image twice, and only the tail shorter than a global batch left out;
        # independent copies would each see everything
        assert record["train_unique_samples"] == record["train_samples"]
        assert train_size - 2 * batch_size < record["train_samples"] <= train_size


def assert_each_test_sample_counted_once(metrics, report, labels, class_names):
    counts = torch.bincount(labels, minlength=len(class_names)).tolist()
    assert [report[name]["support"] for name in class_names] == counts
    assert report["macro avg"]["support"] == len(labels)
    assert all(record["val_samples"] == len(labels) for record in metrics)

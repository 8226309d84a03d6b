"""Beyond one machine, and failing well: two "machines" on loopback, Slurm, notebooks, dead and hung processes,
a diverging loss, configuration mistakes."""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.mnist import build_digits
from conftest import (CPU_CONFIG, DIGITS_RUN, REPO, TIMES, all_gone, assert_each_test_sample_counted_once,
                      assert_two_processes_shared_the_data, descendants, kill_everything, launch_command, read_run,
                      run_command, spawn, wait_for, same_value, script, worker_pid)

pytestmark = pytest.mark.slow
MNIST = REPO / "scripts" / "train_mnist.py"
DIGITS = ["--dataset", "digits", "--epochs", 2]
DIGITS_TRAIN, DIGITS_TEST_SET = 1347, build_digits()[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_command(rank, port, *args, main_ip="127.0.0.1", script=MNIST, launcher_args=()):
    """`accelerate launch` for machine `rank` of 2, one CPU process each, meeting at main_ip:port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_CONFIG, "--num_machines", 2,
            "--num_processes", 2, "--machine_rank", rank, "--main_process_ip", main_ip,
            "--main_process_port", port, *launcher_args, script, *args]


def run_machines(tmp_path, *args_per_machine, main_ip="127.0.0.1", prefixes=([], []), script=MNIST, timeout=300,
                 launcher_args=(), during=None):
    """Start both machines' launches at once (each command after its prefix), call `during` with both
    launchers; (return code, output) of each."""
    port = free_port()
    processes = [spawn([*prefix, *machine_command(rank, port, *args, main_ip=main_ip, script=script,
                                                  launcher_args=launcher_args)], log=tmp_path / f"machine{rank}.log")
                 for rank, (prefix, args) in enumerate(zip(prefixes, args_per_machine))]
    try:
        if during:
            during(processes)
        codes = [process.wait(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                kill_everything(process)
    return [(code, (tmp_path / f"machine{rank}.log").read_text()) for rank, code in enumerate(codes)]


def epoch_lines(output):
    """The per-epoch summary lines without the timings (each machine's first process prints them)."""
    return [re.sub(r"\s+[\d,]+ img/s\s+[\d.]+s$", "", line) for line in output.splitlines()
            if re.match(r"epoch \d+/\d+ ", line)]


# ---- several machines ----

@pytest.fixture
def network():
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2: two hosts as far as the network
    goes, as run_machines' `main_ip` and `prefixes`. Needs root and `ip netns` (the CI machine has both); without
    them, {}: the two "machines" meet on loopback (as every other test of them does)."""
    names = [f"mach{os.getpid()}x{i}" for i in (0, 1)]
    veths = [f"vm{os.getpid() % 100000}x{i}" for i in (0, 1)]
    steps = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
             ["ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1]]]
    for i in (0, 1):
        steps += [["ip", "link", "set", veths[i], "netns", names[i]],
                  ["ip", "-n", names[i], "addr", "add", f"10.77.0.{i + 1}/24", "dev", veths[i]],
                  ["ip", "-n", names[i], "link", "set", veths[i], "up"],
                  ["ip", "-n", names[i], "link", "set", "lo", "up"]]
    try:
        if all(subprocess.run(step, capture_output=True).returncode == 0 for step in steps):
            # gloo binds to the interface named here, not to what the host name resolves to
            yield {"main_ip": "10.77.0.1", "prefixes": [["ip", "netns", "exec", names[i], "env",
                                                         f"GLOO_SOCKET_IFNAME={veths[i]}"] for i in (0, 1)]}
        else:
            yield {}
    finally:
        for name in names:  # deleting a namespace deletes its end of the veth pair, and the pair with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_process_killed_on_one_machine_is_restarted_on_both_and_the_run_ends_as_an_uninterrupted_one(
        tmp_path, digits_reference):
    """Two machines with --max_restarts 1: SIGKILL machine 1's process after the first checkpoint. Each
    machine's launcher starts its process again, they meet again through the same rendezvous, continue from
    the checkpoint and end as a 2-process run that was never interrupted."""
    args, reference = [*DIGITS_RUN, "--checkpoint_every", 10], digits_reference(2)
    output_dir = tmp_path / "run"

    def kill_after_the_first_checkpoint(launchers):
        wait_for(lambda: (output_dir / "checkpoints" / "latest").exists(), launchers[1])
        os.kill(worker_pid(launchers[1].pid, rank=1), signal.SIGKILL)

    # --dist_timeout: now and then (once in a CI run) the peer dies between a step's gradient all-reduce and its
    # BatchNorm merge's, and gloo's all-reduce begun after that waited for its timeout (py-spy's stacks;
    # docs/launching.md); watch_for_restarts now stops that process once its peer is restarted (the test after
    # this one), and 60 s bounds the wait should it not
    both = [*args, "--output_dir", output_dir, "--resume", "auto", "--dist_timeout", 60]
    (code0, out0), (code1, out1) = run_machines(tmp_path, both, both, launcher_args=["--max_restarts", 1],
                                                during=kill_after_the_first_checkpoint)
    assert code0 == 0 and code1 == 0, out0 + out1
    for output in (out0, out1):  # both launchers restarted their process, once
        assert output.count("restart 1 of at most 1 (--max_restarts) after a process ended") == 1, output
    ours, theirs = ([{k: v for k, v in record.items() if k not in TIMES} for record in read_run(run)[0]]
                    for run in (output_dir, reference))
    assert [record["epoch"] for record in ours] == [1, 2, 3, 4]
    assert all(a.keys() == b.keys() and all(same_value(a[k], b[k], 1e-6) for k in a)
               for a, b in zip(ours, theirs)), (ours, theirs)
    weights = [load_file(run / "checkpoints" / "epoch_004_end" / "model.safetensors")
               for run in (output_dir, reference)]
    assert all(torch.allclose(weights[0][k].float(), weights[1][k].float(), atol=1e-6) for k in weights[1])


BUSY_WHEN_ITS_PEER_RESTARTS = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from common.distributed import build_accelerator

restarted = Path(sys.argv[2])
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1" and os.environ["RANK"] == "1":
    restarted.touch()  # before it joins: joining waits for process 0
accelerator = build_accelerator(cpu=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if accelerator.process_index == 1:
        os._exit(9)  # dies between two collectives
    while True:  # process 0: a long stretch without a collective (an evaluation, a decode), which never ends here
        time.sleep(0.05)
total = accelerator.reduce(torch.ones(1), reduction="sum")
print(f"process {accelerator.process_index}: restart {os.environ['TORCHELASTIC_RESTART_COUNT']}, sum {total.item()}")
accelerator.end_training()
"""


def test_a_process_busy_when_its_peer_on_another_machine_restarts_is_restarted_at_once(tmp_path):
    """Machine 1's process dies and its launcher starts it again, to wait for machine 0's process to join; that one
    notices nothing until its next collective (gloo's, begun after the death, even waited for --dist_timeout once in
    CI: docs/launching.md). Here it never reaches one: it stops as soon as the restarted process says so in the
    launcher's store (watch_for_restarts), its launcher starts it again, and both go on together."""
    script = tmp_path / "busy_when_its_peer_restarts.py"
    script.write_text(BUSY_WHEN_ITS_PEER_RESTARTS)
    args = [REPO, tmp_path / "restarted"]
    (code0, out0), (code1, out1) = run_machines(tmp_path, args, args, script=script, timeout=120,
                                                launcher_args=["--max_restarts", 1])
    assert code0 == 0 and code1 == 0, out0 + out1
    assert ("process 0: a process of this run was restarted on another machine; this one stops so that its launcher "
            "starts it again") in out0, out0
    assert "process 0: restart 1, sum 2.0" in out0 and "process 1: restart 1, sum 2.0" in out1, out0 + out1


def test_the_restart_watch_runs_only_where_a_machine_can_restart_alone(monkeypatch):
    """One machine's launcher restarts all of its processes together, and a run without restarts left has none
    to wait for: no thread there."""
    from common.distributed import watch_for_restarts

    several = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0",
               "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for change in ({"LOCAL_WORLD_SIZE": "2"}, {"TORCHELASTIC_MAX_RESTARTS": "0"}, {"TORCHELASTIC_RESTART_COUNT": "1"},
                   {"TORCHELASTIC_USE_AGENT_STORE": "False"}):
        for name, value in {**several, **change}.items():
            monkeypatch.setenv(name, value)
        assert watch_for_restarts() is None, change


def test_two_machines_train_one_model_each_decoding_the_image_cache_once_into_one_shared_file(tmp_path, seedlings,
                                                                                               network):
    """Two launches of one process each, machine ranks 0 and 1, from two network namespaces (on loopback where they
    cannot be made: the other tests of two machines cover that path), the run folder and the data folder on one
    filesystem both see. --cache_images: each machine decodes the images once (its one process, here) under a
    temporary name of its own and renames it to the same file."""
    from common.folders import find_splits

    data, output_dir = shutil.copytree(seedlings, tmp_path / "data"), tmp_path / "run"
    args = ["--data_dir", data, "--model", "test_resnet", "--image_size", 48, "--epochs", 2, "--batch_size", 4,
            "--num_workers", 0, "--cache_images", "--output_dir", output_dir]
    (code0, out0), (code1, out1) = run_machines(tmp_path, args, args, script=REPO / "scripts" / "train_seedlings.py",
                                                **network)
    assert code0 == 0 and code1 == 0, out0 + out1
    # both machines joined one job of 2 processes and took the same optimizer steps
    for output in (out0, out1):
        assert re.search(r"14 optimizer steps, lr .*; 2 process\(es\), MULTI_CPU", output), output
    assert epoch_lines(out0) == epoch_lines(out1) and len(epoch_lines(out0)) == 2
    metrics, report = read_run(output_dir)
    assert [m["step"] for m in metrics] == [7, 14]  # one writer: one line per epoch
    # the data was split between the machines, and each validation image was counted once
    assert_two_processes_shared_the_data(metrics, train_size=59, batch_size=4)
    _, val, classes, _ = find_splits(seedlings, val_fraction=0.3, seed=42)
    assert_each_test_sample_counted_once(metrics, report, torch.tensor(val["labels"]), classes)
    # the checkpoint holds both processes' random states; everything else was written once, by process 0
    checkpoint = output_dir / "checkpoints" / "epoch_002_end"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"]
    assert not [p.name for p in output_dir.iterdir() if p.name.startswith(".")]  # no probe or temporary left
    for split, size in (("train", 55), ("val", 48)):  # training: the whole resized square; evaluation: its crop
        record = json.loads((data / f".checked-{split}.json").read_text())
        assert record["checked_per_process"] == [record["images"]] * 2  # once on each machine
        (name,) = record["decoded"]  # the one size this run decoded
        decoded = np.load(data / name, mmap_mode="r")
        assert decoded.shape == (record["images"], 3, size, size) and decoded.any(axis=(1, 2, 3)).all()
    assert not list(data.glob("*.tmp*"))


def test_an_output_dir_the_machines_do_not_share_is_refused(tmp_path):
    (code0, out0), (code1, out1) = run_machines(tmp_path, [*DIGITS, "--output_dir", tmp_path / "node0"],
                                                [*DIGITS, "--output_dir", tmp_path / "node1"])
    assert code0 != 0 and code1 != 0
    for output in (out0, out1):
        assert "is not shared between the machines: processes [1] do not see the file process 0 wrote" in output
    assert not (tmp_path / "node0" / "metrics.jsonl").exists()


def test_a_machine_that_fails_at_the_start_ends_the_other_one_too(tmp_path, cifar_jpegs):
    """Machine 1 has no data: it stops with its message, and machine 0, waiting for it, stops within seconds
    saying that it lost the other process, instead of a gloo traceback or a hang."""
    started = time.monotonic()
    (code0, out0), (code1, out1) = run_machines(
        tmp_path, *[["--data_dir", data_dir, "--max_steps", 2, "--output_dir", tmp_path / "run"]
                    for data_dir in (cifar_jpegs, tmp_path / "missing")],
        script=REPO / "scripts" / "train_cifar.py", timeout=120)
    took = time.monotonic() - started
    assert code0 != 0 and code1 != 0 and took < 90, (code0, code1, took)
    # each launcher's failure table ends with its own machine's one-line message; no worker traceback
    assert f"traceback : error: no CIFAR-10 found at {tmp_path / 'missing'}" in out1, out1
    assert "traceback : error: lost the other processes (" in out0, out0
    assert 'train_cifar.py", line' not in out0 + out1


def slurm_job(tmp_path, **environment):
    """The batch file's command and environment under a stand-in `srun` that runs its command once per node, on
    this machine, each node's output in tmp_path/nodeN.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "srun": '#!/bin/bash\n# srun --kill-on-bad-exit=1 CMD...: run CMD once per node, SLURM_NODEID 0..N-1\n'
                'shift\nfor ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node '
                '"$@" > "$SRUN_LOGS/node$node.log" 2>&1 & done\nstatus=0\nfor job in $(jobs -p); do '
                'wait $job || status=1; done\nexit $status\n',
        "scontrol": '#!/bin/bash\necho 127.0.0.1\necho 127.0.0.2\n',  # `scontrol show hostnames`: first node first
        "torchrun": f'#!/bin/bash\necho "torchrun $*"\nexec {sys.executable} -m torch.distributed.run "$@"\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_LOGS": str(tmp_path), "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
           "SCRIPT": "scripts/train_mnist.py", "CONFIG": "accelerate_configs/cpu.yaml", "GPUS_PER_NODE": "1",
           "MAIN_PORT": str(free_port()), "OUTPUT_DIR": str(tmp_path / "run"), "PYTHON": sys.executable,
           **environment}
    job = ["bash", REPO / "scripts" / "slurm" / "train_multinode.sbatch", "--dataset", "digits", "--epochs", 4,
           "--batch_size", 16]
    return job, env


def test_slurm_batch_file_runs_one_launch_per_node_and_a_requeued_job_resumes(tmp_path):
    """Slurm's SIGTERM before the time limit stops the job with a checkpoint; the requeued job continues from it."""
    job, env = slurm_job(tmp_path)
    output_dir = tmp_path / "run"

    first = spawn(job, log=tmp_path / "first.log", env=env)
    try:
        wait_for(lambda: (output_dir / "checkpoints" / "epoch_001_end").exists(), first)
        os.killpg(first.pid, signal.SIGTERM)  # what --signal=TERM@120 does: every process of the job gets it
        first.wait(timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the last process of the job has saved and exited
            try:
                os.killpg(first.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    finally:
        kill_everything(first)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert f"2 nodes x 1 processes, main 127.0.0.1:{env['MAIN_PORT']}, output {output_dir}" in (
        tmp_path / "first.log").read_text()
    for log in logs:
        assert re.search(r"168 optimizer steps, lr .*; 2 process\(es\), MULTI_CPU", log), log  # one job of 2 processes
    assert re.search(r"stopped by SIGTERM at epoch [2-4], step \d+: saved", logs[0]), logs[0]

    requeued = run_command(job, env=env)  # the same job started again, as `--requeue` does
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert requeued.returncode == 0, requeued.output + "".join(logs)
    assert f"output {output_dir}, up to 2 restarts, continuing its latest checkpoint" in requeued.output
    assert "resumed from" in logs[0]
    metrics, report = read_run(output_dir)
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    assert_two_processes_shared_the_data(metrics, train_size=DIGITS_TRAIN, batch_size=16)


@pytest.mark.parametrize("environment, message", [
    ({"SCRIPT": "scripts/train_cfar.py"}, f"error: SCRIPT=scripts/train_cfar.py: no such file in {REPO} (the folder "
     "the job was submitted from), e.g. scripts/train_cifar.py"),
    ({"CONFIG": "accelerate_configs/4gpus.yaml"}, f"error: CONFIG=accelerate_configs/4gpus.yaml: no such file in "
     f"{REPO}, e.g. accelerate_configs/multinode_2x8.yaml"),
    ({"GPUS_PER_NODE": "0"}, "error: GPUS_PER_NODE=0: a whole number of processes per node, at least 1 (default: the "
     "GPUs Slurm gave the node)"),  # torchrun's AssertionError on each node
    *(({"MAIN_PORT": port}, f"error: MAIN_PORT={port}: a TCP port from 1 to 65535, free on the first node")
      for port in ("abc", "70000")),
    ({"DIST_TIMEOUT": "10m"}, "error: DIST_TIMEOUT=10m: a whole number of seconds, at least 1 (the script's "
     "--dist_timeout), e.g. 600"),  # the script's refusal on each node, after each of its restarts
    ({"MAX_RESTARTS": "-1"}, "error: MAX_RESTARTS=-1: a whole number of restarts, 0 or more, e.g. 2"),
    ({"PYTHON": "python-of-another-environment"}, "error: PYTHON={python}: cannot import accelerate: activate the "
     "environment the scripts run in before sbatch, or set PYTHON=/path/to/venv/bin/python"),  # one failure a node
    ({"MIN_NODES": "1", "LAST_CALL_TIMEOUT": "2s"},
     "error: LAST_CALL_TIMEOUT=2s: a whole number of seconds (torchrun's last_call_timeout), e.g. 30"),
    ({"MIN_NODES": "1", "RDZV_CONF": "keep_alive_interval 2"},
     "error: RDZV_CONF=keep_alive_interval 2: torchrun's rendezvous settings as key=value,key=value, e.g. "
     "keep_alive_interval=2,keep_alive_max_attempt=3"),
    *(({"MIN_NODES": value}, f"error: MIN_NODES={value}: a whole number of nodes from 1 to the job's 2, the fewest "
       "the job goes on with when others are lost") for value in ("abc", "0", "3"))])  # torchrun's traceback per node
def test_a_setting_the_nodes_could_not_use_is_one_line_before_anything_starts(tmp_path, environment, message):
    python = tmp_path / "python3"  # a Python without this project's packages (no site-packages)
    python.write_text(f'#!/bin/bash\nexec {sys.executable} -S "$@"\n')
    python.chmod(stat.S_IRWXU)
    job, env = slurm_job(tmp_path, **environment)
    if env["PYTHON"] == "python-of-another-environment":
        env["PYTHON"] = str(python)
    result = run_command(job, env=env)
    assert result.returncode == 2 and result.output.strip() == message.format(python=python), result.output
    assert not (tmp_path / "node0.log").exists()  # no node was started


def test_an_output_dir_among_the_scripts_arguments_is_the_folder_the_job_says_and_continues(tmp_path):
    """The job's first line and its look for a checkpoint read the folder the script will write: it was the default
    outputs/<job>-<id> whatever --output_dir the user gave the script."""
    job, env = slurm_job(tmp_path)
    stub = tmp_path / "python"  # each node's launcher only says what it was asked to launch
    stub.write_text('#!/bin/bash\necho "launch $*"\n')
    stub.chmod(stat.S_IRWXU)
    env["PYTHON"] = str(stub)
    run = tmp_path / "mine"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("epoch_001_end")
    for given in (["--output_dir", run], [f"--output_dir={run}"]):
        result = run_command([*job, *given], env=env)
        assert result.returncode == 0, result.output
        assert f"output {run}, up to 2 restarts, continuing its latest checkpoint" in result.output
        for node in (0, 1):
            launched = (tmp_path / f"node{node}.log").read_text()
            assert re.findall(r"--output_dir[ =](\S+)", launched) == [str(run)] * 2, launched


def test_an_elastic_slurm_job_that_loses_a_node_goes_on_with_the_other(tmp_path):
    """MIN_NODES=1: the batch file launches torchrun with c10d and --nnodes 1:2; node 1's launcher and process are
    killed after the first checkpoint (a node failure under `sbatch --no-kill`); node 0's process fails on the lost
    peer, its launcher meets alone and starts it again, and it goes on from checkpoints/latest as 1 process x 2
    accumulation steps, with the global batch, the steps and the samples of the 2-process run, to the end. Node 0
    waits 10 s, not torchrun's 30, for the lost node to come back (LAST_CALL_TIMEOUT), once it counts it gone after
    4 s without its heartbeat, not torchrun's 15 (RDZV_CONF). The wait is the first meeting's too: at 2 s, node 1 of
    a CPU at 1/2.6 of this one's speed came too late to it, node 0 trained alone, and the meeting that let node 1 in
    hung in torchrun for its 60 s."""
    job, env = slurm_job(tmp_path, MIN_NODES="1", LAST_CALL_TIMEOUT="10",
                         RDZV_CONF="keep_alive_interval=1,keep_alive_max_attempt=4")
    output_dir = tmp_path / "run"
    process = spawn(job, log=tmp_path / "job.log", env=env)
    try:
        wait_for(lambda: (output_dir / "checkpoints" / "epoch_001_end").exists(), process)
        node1 = [pid for pid in descendants(process.pid) if b"torch.distributed.run" in Path(
            f"/proc/{pid}/cmdline").read_bytes() and b"SLURM_NODEID=1" in Path(f"/proc/{pid}/environ").read_bytes()]
        for pid in descendants(node1[0]):
            os.kill(pid, signal.SIGKILL)
        assert process.wait(timeout=300) == 1  # srun counts the lost node's task
    finally:
        kill_everything(process)
    assert "2 nodes (elastic: at least 1) x 1 processes" in (tmp_path / "job.log").read_text()
    output = (tmp_path / "node0.log").read_text()
    assert "--rdzv_conf is_host=1,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=4 " in output
    assert "this launch has 1 x 2: the same global batch and samples" in output, output
    metrics, report = read_run(output_dir)
    assert [record["epoch"] for record in metrics] == [1, 2, 3, 4]
    assert [record["step"] for record in metrics] == [42, 84, 126, 168]  # 1,347 // 32 a epoch
    # every training sample once per epoch, the restarted epoch included
    assert all(record["train_samples"] == record["train_unique_samples"] == 42 * 32 for record in metrics)
    assert len(metrics[0]["train_samples_per_process"]) == 2 and len(metrics[-1]["train_samples_per_process"]) == 1
    assert_each_test_sample_counted_once(metrics, report, DIGITS_TEST_SET.labels, DIGITS_TEST_SET.classes)


# ---- a process fails ----

def start_long_run(tmp_path, *extra, launcher_args=(), config=CPU_CONFIG):
    """2 processes on digits (or as many as `config` starts) for long enough to be interrupted; returns the launcher
    once epoch 1 is saved."""
    output_dir = tmp_path / "run"
    launcher = spawn(launch_command(*launcher_args, MNIST, "--dataset", "digits", "--epochs", 200, "--batch_size", 16,
                                    "--output_dir", output_dir, *extra, processes=2 if config == CPU_CONFIG else None,
                                    config=config), log=tmp_path / "log")
    wait_for(lambda: (output_dir / "checkpoints" / "epoch_001_end").exists(), launcher)
    return launcher


@pytest.mark.parametrize("config", ["cpu.yaml", "1gpu.yaml"])  # torchrun's 2 processes; Accelerate's own 1
def test_a_killed_launcher_stops_its_processes_as_a_sigterm_does(tmp_path, config):
    """kill -9 of the launcher (the PID a user sees first, or the OOM killer's choice) left its processes training on
    as orphans, holding the run folder; now each gets SIGTERM as the launcher dies: a checkpoint, the lock let go."""
    launcher = start_long_run(tmp_path, config=REPO / "accelerate_configs" / config)
    workers = descendants(launcher.pid)[1:]
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        ended = all_gone(workers, timeout=60)  # 200 epochs: minutes, were the processes to train on
    finally:
        kill_everything(launcher, *workers)
    output, run = (tmp_path / "log").read_text(), tmp_path / "run"
    assert workers and ended, output
    saved = re.search(r"stopped by SIGTERM at epoch \d+, step \d+: saved (\S+)\. Run the same command with --resume "
                      r"latest to continue\.", output)
    assert saved and (run / "checkpoints" / "latest").read_text().strip() == Path(saved[1]).name, output
    assert not (run / ".lock").exists()  # the next launch may take the folder


def test_a_second_death_past_max_restarts_ends_the_launch(tmp_path):
    """--max_restarts 1: the first SIGKILL is survived (both processes start again from the checkpoint), the
    second, with no restart left, ends the whole launch within a minute, torchrun naming the killed process as the
    root cause: what a death does at the default --max_restarts 0, where no restart is left from the start."""
    launcher = start_long_run(tmp_path, "--resume", "auto", launcher_args=["--max_restarts", 1])
    log = tmp_path / "log"
    try:
        first = worker_pid(launcher.pid, rank=1)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: "restart 1 of at most 1" in log.read_text(), launcher)
        os.kill(worker_pid(launcher.pid, rank=1), signal.SIGKILL)
        killed = time.monotonic()
        code = launcher.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        kill_everything(launcher)
    output = log.read_text()
    assert code != 0 and took < 60, (code, took, output)
    assert output.count("restart 1 of at most 1 (--max_restarts) after a process ended: the steps after step") == 1
    assert "restart 2" not in output
    assert re.search(r"Root Cause[^=]*rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", output), output


def test_a_hung_process_ends_the_launch_after_dist_timeout(tmp_path):
    """A process that stops answering (SIGSTOP: alive, but silent) makes the others fail after --dist_timeout, with
    one line; the launcher then sends the hung one SIGTERM. A stopped process takes no signal but SIGKILL, which
    torchrun sends 30 s later (a fixed grace for a worker's failure, not ours to shorten): the test sends it then."""
    launcher = start_long_run(tmp_path, "--dist_timeout", 5)
    log = tmp_path / "log"
    hung = worker_pid(launcher.pid, rank=1)
    try:
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: re.search(rf"Sending process {hung} closing signal SIGTERM", log.read_text()), launcher,
                 timeout=120)
        took = time.monotonic() - stopped
        os.kill(hung, signal.SIGKILL)
        code = launcher.wait(timeout=60)
    finally:
        kill_everything(launcher, hung)
    output = log.read_text()
    assert code != 0, output
    assert 5 <= took < 60, (took, output)  # 5 s of timeout, the other's report, the launcher's reaction
    assert re.search(r"error: lost the other processes \(.*([Tt]ime ?out|[Tt]imed out).*\): one of them failed, "
                     r"hung longer than --dist_timeout", output), output


def test_a_lost_peer_is_said_in_one_line_whichever_collective_noticed_it(tmp_path, warm_children):
    """gloo words a lost or silent peer differently in each collective; each is one line, not a traceback. A
    DataLoader's timeout is its own line (common.folders.LOADER_TIMEOUT_S), not a lost peer; a timeout of neither
    stays a traceback. Each in a process of its own, forked warm (the way the process ends is the point, not its
    start)."""
    program = tmp_path / "fails.py"
    program.write_text(f"import sys, torch; sys.path.insert(0, {str(REPO)!r}); from common.errors import run_main\n"
                       f"torch.distributed.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
                       "world_size=1)\n"
                       "def main(args): raise RuntimeError(sys.argv[1])\n"
                       "run_main(main, None)\n")
    lost = "error: lost the other processes"
    for message, line in [("Application timeout caused pair closure", lost),  # DDP's buffer broadcast
                          ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242", lost),
                          ("DataLoader timed out after 5 seconds", "error: a DataLoader worker handed over no batch in "
                                                                    "5 s: it is stuck, or the batch was lost"),
                          ("Timed out waiting for the model's files", None)]:
        (tmp_path / "store").unlink(missing_ok=True)
        result = run_command([sys.executable, program, message])
        assert result.returncode == 1, result.output
        assert (lost in result.output) == (line == lost), result.output
        assert ("Traceback" in result.output) == (line is None) and (line is None or line in result.output), \
            result.output


# a launcher of 2 processes as torchrun starts them (the same command line, LOCAL_RANK and LOCAL_WORLD_SIZE): local
# rank 1 ends at once (CAUSE=ends) or hangs; local rank 0 prints a_neighbour_ended(WAIT)
NEIGHBOURS = """
import os, subprocess, sys
child = (f"import os, sys, time; sys.path.insert(0, {sys.argv[1]!r})\\n"
         "if os.environ['LOCAL_RANK'] == '1':\\n"
         "    os._exit(3) if os.environ['CAUSE'] == 'ends' else time.sleep(600)\\n"
         "from common.errors import a_neighbour_ended\\n"
         "print(a_neighbour_ended(float(os.environ['WAIT'])))")
ranks = [subprocess.Popen([sys.executable, '-c', child], env={**os.environ, 'LOCAL_RANK': rank}) for rank in '10']
ranks[1].wait()
ranks[0].kill()
"""


def test_a_process_that_lost_its_peer_waits_for_the_launcher_only_where_a_process_of_its_own_machine_ended(
        tmp_path, monkeypatch):
    """A collective's "lost the other processes" waits REPORT_GRACE_S before it reports (the launcher stops it
    meanwhile) only where one of its launcher's processes on this machine ended, the cause, which the failure table
    then shows alone; a cause elsewhere (another machine's process: a node's only process, a hung one) is reported
    at once, so that the launcher restarts or ends the run without the 5 s wait."""
    import common.errors

    for cause, processes, wait, expected in (("ends", "2", 120, "True"), ("hangs", "2", 0.3, "False"),
                                             ("ends", "1", 120, "False")):
        result = run_command([sys.executable, "-c", NEIGHBOURS, str(REPO)],
                             env={"CAUSE": cause, "LOCAL_WORLD_SIZE": processes, "WAIT": str(wait)}, timeout=60)
        assert result.stdout.strip() == expected, (cause, processes, result.output)
    slept, error_file = [], tmp_path / "error.json"
    monkeypatch.setattr(common.errors.time, "sleep", slept.append)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    handler = signal.getsignal(signal.SIGTERM)
    try:
        for ended in (False, True):
            monkeypatch.setattr(common.errors, "a_neighbour_ended", lambda wait_s: ended)
            with pytest.raises(SystemExit):
                common.errors.exit_with_message("error: lost the other processes (...)", 1, consequence=True)
            assert slept == ([common.errors.REPORT_GRACE_S] if ended else [])
            assert json.loads(error_file.read_text())["message"]["message"] == "error: lost the other processes (...)"
    finally:
        signal.signal(signal.SIGTERM, handler)


# ---- the loss diverges ----

def test_a_nan_loss_stops_the_run_and_no_checkpoint_holds_it(tmp_path):
    output_dir = tmp_path / "run"
    result = script(MNIST.name, "--dataset", "digits", "--epochs", 3, "--lr", 1e6, "--checkpoint_every", 2,
                    "--keep_checkpoints", 100, "--output_dir", output_dir)
    assert result.returncode == 2, result.output
    found = re.search(r"error: the loss became nan or inf at optimizer step (\d+) \(epoch 1\); training stopped "
                      r"there and saved nothing after it", result.output)
    assert found, result.output
    # the values to lower are named, this run's with them
    assert ("The run diverged (peak LR 1e+06, weight decay 0.0001, gradients not clipped): start again with a lower "
            "--lr or --weight_decay, --max_grad_norm 1.0") in result.output
    bad_step = int(found.group(1))
    checkpoints = sorted((output_dir / "checkpoints").glob("epoch_*"))
    assert checkpoints, "the steps before the nan were checkpointed"
    for checkpoint in checkpoints:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["step"] < bad_step
        assert all(tensor.isfinite().all() for tensor in load_file(checkpoint / "model.safetensors").values())
    assert not (output_dir / "best").exists() and not (output_dir / "metrics.jsonl").exists()


# ---- configuration mistakes ----

def test_fp16_on_a_cpu_is_refused(tmp_path):
    result = script(MNIST.name, *DIGITS, "--mixed_precision", "fp16", "--output_dir", tmp_path)
    assert result.returncode == 2
    assert "error: mixed precision fp16 needs a GPU: on the CPU Accelerate trains in fp32 without saying so" in result.output
    assert "Traceback" not in result.output


def test_a_missing_accelerate_config_file_is_named(tmp_path):
    """Accelerate's own launcher answers this one, before our code runs; docs/checkpoints.md quotes it."""
    result = run_command([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          tmp_path / "4gpus.yaml", MNIST, *DIGITS])
    assert result.returncode != 0
    assert f"The passed configuration file `{tmp_path / '4gpus.yaml'}` does not exist" in result.output


def test_a_busy_port_on_the_main_machine_is_named(tmp_path):
    """One machine's launch finds a busy port and picks another; with several machines they must agree on one,
    so Accelerate's launcher stops and names it (docs/checkpoints.md says what to do)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_command(machine_command(0, port, *DIGITS, "--output_dir", tmp_path / "run"), timeout=120)
    assert result.returncode != 0
    assert (f"Tried to launch distributed communication on port `{port}`, but another process is utilizing it"
            in result.output), result.output


# ---- notebooks ----

def test_notebook_launcher_runs_a_scripts_main_on_two_processes(tmp_path):
    """What a notebook cell does: import a script, build its arguments, hand its main to notebook_launcher."""
    cell = f"""
import sys
sys.path.insert(0, {str(REPO / "scripts")!r})
from accelerate import notebook_launcher
import train_mnist

args = train_mnist.parse_args(["--dataset", "digits", "--epochs", "2", "--output_dir", {str(tmp_path / "run")!r}])
notebook_launcher(train_mnist.main, (args,), num_processes=2)
"""
    result = run_command([sys.executable, "-c", cell], cwd=tmp_path)
    assert result.returncode == 0, result.output
    # (Accelerate's own line says "Launching training on 2 CUDAs." whatever the device; ours tells the truth)
    assert re.search(r"20 optimizer steps, lr .*; 2 process\(es\), MULTI_CPU", result.output), result.output
    metrics, report = read_run(tmp_path / "run")
    assert len(metrics) == 2
    assert_two_processes_shared_the_data(metrics, train_size=DIGITS_TRAIN, batch_size=64)
    assert_each_test_sample_counted_once(metrics, report, DIGITS_TEST_SET.labels, DIGITS_TEST_SET.classes)

"""Checkpoints and resuming: exact resume (1 and 2 processes), SIGTERM, SIGKILL during a save, refusals."""

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.outputs import publish
from common.run import checkpoint_name
from common.errors import UserError
from common.checkpoint import restore_args, set_aside_later_checkpoints
from common.reporting import read_metrics
from conftest import (ACROSS_COUNTS, DIGITS_RUN, FP32, ONE_THREAD, REPO, TIMES, assert_same_outcome, fill,
                      kill_everything, launch_command, launch_warm, load_script, process_command, small_disk, spawn,
                      stop_inside_an_epoch, wait_for, worker_pid, worker_pids)
from conftest import refused, script as run_script

MNIST = REPO / "scripts" / "train_mnist.py"
CIFAR = REPO / "scripts" / "train_cifar.py"


def train(*args, processes=1, script=MNIST, threads=None):
    """A run to completion: 1 process in this one, several forked warm; `threads` per process (OMP_NUM_THREADS)."""
    if processes > 1:
        return launch_warm(script, *args, processes=processes, env=threads and {"OMP_NUM_THREADS": str(threads)})
    return run_script(script.name, *args, threads=threads)


def start(*args, processes, log, env=None):
    """A training run in the background (its own process group), output to `log`."""
    return spawn(process_command(MNIST, *args, processes=processes), log=log, env=env)


def metrics(output_dir):
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if k not in TIMES} for record in records]


def assert_same_run(run, reference, *, rel=1e-6, per_process=True):
    """Same weights, optimizer state, metrics and best-model predictions as the uninterrupted 4-epoch run."""
    assert len(metrics(run)) == 4
    assert_same_outcome(run, reference, checkpoint="checkpoints/epoch_004_end", rel=rel, per_process=per_process)


# ---- fast: the pieces ----

def test_checkpoint_names_sort_in_training_order():
    names = [checkpoint_name(1), checkpoint_name(2, 7), checkpoint_name(2, 43), checkpoint_name(2)]
    assert names == ["epoch_001_end", "epoch_002_batch_000007", "epoch_002_batch_000043", "epoch_002_end"]
    assert sorted(names) == names


def test_a_resumed_run_takes_the_checkpoints_arguments_but_not_its_location():
    parse_args = load_script("train_mnist.py").parse_args
    saved = {**vars(parse_args([])), "lr": 0.05, "epochs": 6, "output_dir": "/elsewhere", "data_dir": "/old"}
    given = parse_args(["--output_dir", "runs/a", "--resume", "latest", "--data_dir", "/new"])
    restored = restore_args(given, saved, parse_args=parse_args)
    assert vars(restored) == {**saved, "output_dir": "runs/a", "resume": "latest", "data_dir": "/new"}
    assert given.lr is None  # not changed in place (None: the recipe's LR, scaled to the global batch)
    with pytest.raises(UserError, match=r"--epochs is 9 on the command line but 6 in the checkpoint"):
        restore_args(parse_args(["--epochs", "9"]), saved, parse_args=parse_args)
    # a value edited by hand in trainer_state.json is checked as if it had been typed
    for name, value in (("lr", -1), ("epochs", "many"), ("schedule", "linear")):
        with pytest.raises(UserError, match=f"arguments saved in the checkpoint .* are not valid .*argument --{name}"):
            restore_args(given, {**saved, name: value}, parse_args=parse_args)
    # a flag the checkpoint left unset keeps no value even where the recipe has a default now (CIFAR-10 has clipped
    # to norm 1 since 2026-11-27): the run goes on as it started
    cifar = load_script("train_cifar.py").parse_args
    older = {**vars(cifar([])), "max_grad_norm": None}
    assert cifar([]).max_grad_norm == 1.0 and cifar(["--max_grad_norm", "0"]).max_grad_norm == 0  # 0: off
    assert restore_args(cifar(["--resume", "latest"]), older, parse_args=cifar).max_grad_norm is None
    # another script's checkpoint (a run folder resumed with the wrong script): said so, not "edited by hand"
    for name, other in (("train_seedlings.py", saved), ("train_mnist.py", older)):
        parse = load_script(name).parse_args
        with pytest.raises(UserError, match=r"^the checkpoint is another training script's \(or another version's\): "
                                            r"its arguments --"):
            restore_args(parse(["--resume", "latest"]), other, parse_args=parse)


def test_best_folder_is_replaced_as_a_whole_and_a_kill_between_renames_is_repaired(tmp_path):
    best, tmp, old = tmp_path / "best", tmp_path / ".best.tmp", tmp_path / ".best.old"
    best.mkdir()
    (best / "model.safetensors").write_text("epoch 1")
    (best / "stale.txt").write_text("only in the old folder")
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("epoch 2")
    publish(tmp, best)
    assert [p.name for p in best.iterdir()] == ["model.safetensors"] and not tmp.exists() and not old.exists()
    assert (best / "model.safetensors").read_text() == "epoch 2"

    best.rename(old)  # killed after the first rename: no best/, the previous one in .best.old
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("epoch 3")
    publish(tmp, best)
    assert (best / "model.safetensors").read_text() == "epoch 3" and not old.exists()


def test_a_sigterm_is_obeyed_within_seconds_when_steps_are_slow(tmp_path):
    """With slow steps the bookkeeping looks for a SIGTERM more often than every 20 steps, so the stop and its
    checkpoint come within about LOOK_SECONDS, well inside torchrun's 30 s before its SIGKILL."""
    import os
    import time

    import common.run
    from common.data import MicroBatches, build_dataloader, preprocess
    from common.mnist import build_digits
    from common.distributed import build_accelerator
    from common.errors import Interrupted
    from common.models import build_model, describe_model
    from common.optim import build_lr_scheduler

    accelerator = build_accelerator(report_to=("none", tmp_path))
    train_set, _ = build_digits()
    model = build_model("mnist_convnet", num_classes=10, in_chans=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = build_dataloader(train_set, batch_sampler=MicroBatches(len(train_set), batch_size=16, seed=0,
                                                                    accelerator=accelerator))
    lr_scheduler = build_lr_scheduler(optimizer, schedule="constant", total_steps=1000)
    info = describe_model("mnist_convnet", train_set.classes, image_size=(8, 8), normalize=((0.0,), (1.0,)),
                          dataset="digits", arguments={})
    run = common.run.TrainingRun(accelerator, tmp_path, model_info=info, total_steps=1000)
    run.start(None, model=model, lr_scheduler=lr_scheduler)
    step_s = common.run.LOOK_SECONDS / 5  # a look every 5 steps, not every CHECK_EVERY = 20
    try:
        with pytest.raises(Interrupted):
            for _ in run.epochs(10):
                for batch in run.batches(loader):
                    images = preprocess(batch["image"], normalize=((0.0,), (1.0,)))
                    loss = torch.nn.functional.cross_entropy(model(images), batch["label"])
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    time.sleep(step_s)
                    if run.step == 2:
                        os.kill(os.getpid(), signal.SIGTERM)
                    run.record(loss, batch)
                    if run.checkpoint_due():
                        run.save_checkpoint()
        assert 3 <= run.step <= 8, run.step  # the signal came at step 2; 20 steps would be 4 s of training
        assert (tmp_path / "checkpoints" / "latest").read_text().strip() == checkpoint_name(1, run.batch)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        common.run._signals_received.clear()


# ---- slow: real runs ----

def resume_as_it_was(command, output_dir, latest, reference, *, processes, threads=None):
    """`command` again with --resume latest on `processes`: it says where it resumed, and ends as `reference`."""
    resumed = train(*command, "--resume", "latest", processes=processes, threads=threads)
    assert resumed.returncode == 0, resumed.output
    assert f"resumed from {output_dir / 'checkpoints' / latest}" in resumed.output
    assert_same_run(output_dir, reference)


@pytest.mark.slow
def test_sigterm_saves_and_resume_latest_matches_an_uninterrupted_run(tmp_path, digits_reference):
    """One process; on 2, the test below stops the run, and continues a copy of it on 2 processes as this does."""
    output_dir = tmp_path / "run"
    command = [*DIGITS_RUN, "--output_dir", output_dir]
    latest = stop_inside_an_epoch([MNIST, *command], output_dir=output_dir, processes=1, log=tmp_path / "log")
    resume_as_it_was(command, output_dir, latest, digits_reference(1), processes=1)


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_run_stopped_inside_an_epoch_goes_on_with_another_process_count_as_the_uninterrupted_run(
        tmp_path, digits_reference, first, then):
    """A run is its seed and global batch: 2 x 1 (processes x accumulation steps) stopped by SIGTERM inside an epoch
    and continued as 1 x 2, or started as 1 x 2 and continued on 2 processes, ends as the uninterrupted 2 x 1 run.
    In fp32 on every CPU: under bf16 autocast the evaluation rounds the weights' last-digit differences across
    counts to bf16, and which of them cross a rounding step is luck (val_loss 1e-4 apart in epoch 2 on a CPU with
    bf16 instructions once the optimizer became the fused one; within 6e-7 in fp32)."""
    output_dir = tmp_path / "run"
    options = [*DIGITS_RUN, *FP32, *(["--grad_accum", 2] if first == 1 else [])]
    command = [*options, "--output_dir", output_dir]
    latest = stop_inside_an_epoch([MNIST, *command], output_dir=output_dir, processes=first, log=tmp_path / "log",
                                  env=ONE_THREAD)
    if first == 2:  # a copy continued on the same 2 processes: the same run, to the last digit
        same = shutil.copytree(output_dir, tmp_path / "same")
        resume_as_it_was([*options, "--output_dir", same], same, latest, digits_reference(2, *FP32), processes=2,
                         threads=1)

    resumed = train(*command, "--resume", "latest", processes=then, threads=1)  # the same command
    assert resumed.returncode == 0, resumed.output
    assert "thread(s) per process, this run with" not in resumed.output  # one thread each, as the checkpoint's
    assert (f"was written by {first} process(es) x {2 // first} accumulation step(s), this launch has {then} x "
            f"{2 // then}: the same global batch and samples") in resumed.output
    assert f"global batch 32 = 16 per process x {then} processes x {2 // then} accumulation steps" in resumed.output
    assert_same_run(output_dir, digits_reference(2, *FP32), rel=ACROSS_COUNTS, per_process=False)
    for record in metrics(output_dir):  # 1,347 images: 42 steps of 32, the 3 left over a different 3 each epoch
        assert record["train_samples"] == record["train_unique_samples"] == 42 * 32
        assert sum(record["train_samples_per_process"]) == 42 * 32


@pytest.mark.slow
def test_a_resume_with_another_thread_count_says_so_and_how_to_match(tmp_path, digits_reference):
    """A 2-process launch computes with 1 thread per process; continued as a plain python process on several cores,
    the run's sums split otherwise (docs/checkpoints.md: a bias before a BatchNorm moves most): the resume says so."""
    run = shutil.copytree(digits_reference(2), tmp_path / "run")
    checkpoint = sorted((run / "checkpoints").glob("epoch_004_batch_*"))[-1]  # a few steps from the end
    assert json.loads((checkpoint / "trainer_state.json").read_text())["threads_per_process"] == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        resumed = run_script("train_mnist.py", "--output_dir", run, "--resume", checkpoint)
    finally:
        torch.set_num_threads(threads)
    assert resumed.returncode == 0, resumed.output
    assert (f"{checkpoint} was computed with 1 thread(s) per process, this run with 2: its weights will differ from "
            "the uninterrupted run's beyond float rounding (the CPU kernels split their sums by thread). For the "
            "same weights, run it with OMP_NUM_THREADS=1 in its environment.") in resumed.output


def test_a_process_count_that_cannot_keep_the_global_batch_is_refused_naming_those_that_can(tmp_path):
    from common.checkpoint import keep_global_batch

    checkpoint = {"path": tmp_path / "epoch_002_batch_000012", "num_processes": 2,
                  "args": {"grad_accum": 3, "batch_size": 16}}
    assert [keep_global_batch(checkpoint, processes=n) for n in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(UserError) as refusal:
        keep_global_batch(checkpoint, processes=4)
    assert str(refusal.value) == (f"checkpoint {tmp_path / 'epoch_002_batch_000012'} trains 6 micro-batch(es) of "
                                  "--batch_size 16 per optimizer step (2 process(es) x 3 accumulation step(s)), which "
                                  "4 processes cannot share out evenly: launch 1 or 2 or 3 or 6 process(es) to "
                                  "continue it.")


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_with_no_other_flags_matches(tmp_path, digits_reference):
    output_dir = tmp_path / "run"
    shutil.copytree(digits_reference(1), output_dir)
    older = sorted((output_dir / "checkpoints").glob("epoch_002_batch_*"))[0]
    # no --dataset/--epochs/--batch_size: they come from the checkpoint
    result = train("--output_dir", output_dir, "--resume", older)
    assert result.returncode == 0, result.output
    assert f"resumed from {older}: epoch 2, batch {int(older.name[-6:])}" in result.output
    later = sorted(p.name for p in (digits_reference(1) / "checkpoints").glob("epoch_*") if p.name > older.name)
    assert (f"going back to {older.name}: the {len(later)} later checkpoint(s) ({later[0]} to {later[-1]}) and "
            f"metrics.jsonl as it was are in {output_dir / 'previous_run'} until this run's first checkpoint, which "
            "deletes them") in result.output
    assert not list((output_dir / "checkpoints").glob("epoch_003_batch_*"))  # the old future is gone
    assert not (output_dir / "previous_run").exists()  # deleted at the first checkpoint
    assert_same_run(output_dir, digits_reference(1))


@pytest.mark.slow
def test_going_back_to_an_older_checkpoint_sets_the_later_ones_aside_until_the_first_new_one(tmp_path, digits_reference,
                                                                                             monkeypatch):
    """Until the resumed run's first checkpoint a mistaken --resume has lost nothing: what it would drop is in
    previous_run/, whole (a stop before then leaves it there; the next checkpoint deletes it, test above). A kill
    among the moves leaves `latest` at the checkpoint gone back to, and going back again moves the rest."""
    import common.checkpoint

    output_dir = shutil.copytree(digits_reference(1), tmp_path / "run")
    names = sorted(p.name for p in (output_dir / "checkpoints").glob("epoch_*"))
    metrics = (output_dir / "metrics.jsonl").read_bytes()
    def contents(folder):
        return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}

    before = {name: contents(output_dir / "checkpoints" / name) for name in names}
    moves, replace = [], os.replace

    def killed_after_one(source, target):  # one checkpoint moved into previous_run/: the process ends there
        if Path(target).parent.parent.name == "previous_run" and moves:
            raise KeyboardInterrupt
        if Path(target).parent.parent.name == "previous_run":
            moves.append(target)
        return replace(source, target)

    monkeypatch.setattr(common.checkpoint.os, "replace", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        set_aside_later_checkpoints(output_dir, output_dir / "checkpoints" / names[0])
    monkeypatch.undo()
    assert (output_dir / "checkpoints" / "latest").read_text() == names[0] + "\n"  # there: resumable
    assert len(list((output_dir / "previous_run" / "checkpoints").iterdir())) == 1
    set_aside_later_checkpoints(output_dir, output_dir / "checkpoints" / names[0])
    assert sorted(p.name for p in (output_dir / "checkpoints").glob("epoch_*")) == names[:1]
    assert (output_dir / "checkpoints" / "latest").read_text() == names[0] + "\n"
    previous = output_dir / "previous_run"
    assert {name: contents(previous / "checkpoints" / name) for name in names[1:]} == {
        name: before[name] for name in names[1:]}
    assert (previous / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_checkpoint_write_then_resume_latest(tmp_path, digits_reference):
    """A checkpoint each step: the processes are held still (SIGSTOP) as soon as one is being written, until they
    are held in the middle of a write (not after its publication), then killed with no chance to clean up."""
    output_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    process = start(*DIGITS_RUN, "--output_dir", output_dir, "--checkpoint_every", 1, processes=2, log=tmp_path / "log")
    try:
        workers = worker_pids(process)
        while True:
            wait_for(lambda: (checkpoints / "latest").exists() and list(checkpoints.glob(".tmp-*")), process)
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            if list(checkpoints.glob(".tmp-*")):  # held before the save was published
                break
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
    finally:
        kill_everything(process)  # launcher and both workers
    assert list(checkpoints.glob(".tmp-*"))
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    assert json.loads((latest / "trainer_state.json").read_text())["step"] >= 1

    resumed = train(*DIGITS_RUN, "--output_dir", output_dir, "--resume", "latest", processes=2)
    assert resumed.returncode == 0, resumed.output
    assert not list(checkpoints.glob(".tmp-*"))
    assert_same_run(output_dir, digits_reference(2))


@pytest.mark.slow
def test_sigkill_during_the_first_checkpoint_then_resume_auto_starts_the_run_again(tmp_path, digits_reference):
    """metrics.jsonl and best/ come before the first checkpoint is published: a kill in between leaves a run's
    outputs and no checkpoint (best/ too, unless the kill came while its thread was writing it). The plain command
    and --resume latest say so; --resume auto (a restart, a requeued job) sets them aside and trains the run again,
    to the weights of the run that was never stopped."""
    output_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for _ in range(5):  # the one chance a run has: held still (SIGSTOP) once its first save is being written
        shutil.rmtree(output_dir, ignore_errors=True)
        process = start(*DIGITS_RUN, "--output_dir", output_dir, processes=2, log=tmp_path / "log")
        try:
            workers = worker_pids(process)
            wait_for(lambda: (checkpoints / ".tmp-epoch_001_end").exists() or (checkpoints / "latest").exists(),
                     process)
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
        finally:
            kill_everything(process)  # launcher and both workers, no chance to clean up
        if not (checkpoints / "latest").exists():  # held before the first save was published
            break
    else:
        pytest.fail("the kill never landed during the first checkpoint write")
    left = ", ".join(name for name in ("metrics.jsonl", "best") if (output_dir / name).exists())
    assert left.startswith("metrics.jsonl")
    assert "pid=" in (output_dir / ".lock").read_text()  # the killed run's lock, left behind

    plain = train(*DIGITS_RUN, "--output_dir", output_dir, processes=1)
    latest = train(*DIGITS_RUN, "--output_dir", output_dir, "--resume", "latest", processes=1)
    for refused_run in (plain, latest):
        assert refused_run.returncode == 2, refused_run.output
        assert f"{output_dir} holds the outputs of a run that never reached its first checkpoint ({left})" \
            in refused_run.output, refused_run.output
    assert "Pass --overwrite (or --resume auto) to start it again" in plain.output
    assert "Start it again with --resume auto or --overwrite." in latest.output

    resumed = train(*DIGITS_RUN, "--output_dir", output_dir, "--resume", "auto", processes=2)
    assert resumed.returncode == 0, resumed.output
    assert f"the earlier run's outputs ({left}) are in {output_dir / 'previous_run'}" in resumed.output
    assert not (output_dir / "previous_run").exists() and not list(output_dir.glob(".*tmp*"))
    assert not list(checkpoints.glob(".tmp-*"))
    assert_same_run(output_dir, digits_reference(2))


@pytest.mark.slow
def test_a_full_disk_is_one_message_naming_the_file_and_the_last_checkpoint_and_the_run_continues(
        tmp_path, digits_reference):
    """The disk fills up after the first checkpoint: whichever write fails (a checkpoint through PyTorch's own
    writer, best/ through safetensors, metrics.jsonl) is named with the reason and the last complete checkpoint,
    nothing half-written stays, and with space again --resume auto ends as the uninterrupted run."""
    with small_disk(tmp_path / "disk") as disk:
        output_dir, log = disk / "run", tmp_path / "log"
        process = start(*DIGITS_RUN, "--output_dir", output_dir, processes=1, log=log)
        wait_for(lambda: (output_dir / "checkpoints" / "latest").exists(), process)
        filler = fill(disk)
        assert process.wait(timeout=120) == 2, log.read_text()
        output = log.read_text()
        latest = output_dir / "checkpoints" / (output_dir / "checkpoints" / "latest").read_text().strip()
        found = re.search(r"error: cannot write (\S+): No space left on device \(([\d.]+ \w+) free there\)\. Nothing "
                          r"half-written was left\. The last complete checkpoint is (\S+): free some space, then run "
                          r"the same command with --resume latest \(or auto\) to continue from it\.", output)
        assert found and found.group(1).startswith(str(output_dir)) and found.group(3) == str(latest), output
        assert "Traceback" not in output
        leftovers = [p for p in output_dir.rglob(".*") if p.name != ".lock"]
        assert not leftovers and not (output_dir / ".lock").exists(), leftovers
        assert read_metrics(output_dir)  # every line whole

        filler.unlink()
        resumed = train(*DIGITS_RUN, "--output_dir", output_dir, "--resume", "auto")
        assert resumed.returncode == 0, resumed.output
        assert f"resumed from {latest}" in resumed.output
        assert_same_run(output_dir, digits_reference(1))


@pytest.mark.slow
def test_a_killed_process_is_restarted_by_the_launcher_and_the_run_ends_as_an_uninterrupted_one(
        tmp_path, digits_reference):
    """`accelerate launch --max_restarts 1` + `--resume auto`: a SIGKILLed process after the first checkpoint;
    the launcher starts both processes again, they continue from the last checkpoint, and the launch exits 0
    with the weights, optimizer state, metrics.jsonl and best/ of the run that was never interrupted."""
    output_dir = tmp_path / "run"
    launcher = spawn(launch_command("--max_restarts", 1, MNIST, *DIGITS_RUN, "--output_dir", output_dir,
                                    "--checkpoint_every", 10, "--keep_checkpoints", 100, "--resume", "auto"),
                     log=tmp_path / "log")
    try:
        wait_for(lambda: (output_dir / "checkpoints" / "latest").exists(), launcher)
        os.kill(worker_pid(launcher.pid, rank=1), signal.SIGKILL)
        code = launcher.wait(timeout=300)
    finally:
        kill_everything(launcher)
    output = (tmp_path / "log").read_text()
    assert code == 0, output
    found = re.search(r"resumed from \S+/(epoch_00[1-4]_batch_\d{6}): epoch \d, batch \d+, step (\d+) of 168\n"
                      r"restart 1 of at most 1 \(--max_restarts\) after a process ended: the steps after step "
                      r"(\d+) are trained again", output)
    assert found and found.group(2) == found.group(3), output
    assert_same_run(output_dir, digits_reference(2))
    # each epoch's line once, in order: the restart did not repeat the epochs before its checkpoint
    assert re.findall(r"^epoch (\d)/4 ", output, re.MULTILINE) == ["1", "2", "3", "4"], output


@pytest.mark.slow
def test_resume_refusals_name_the_problem(tmp_path, digits_reference):
    finished = tmp_path / "finished"
    shutil.copytree(digits_reference(1), finished)
    cases = [
        (["--output_dir", finished, "--resume", "latest"], "is the end of a finished run (epoch 4 of 4 done)"),
        (["--output_dir", finished, "--resume", "latest", "--lr", 0.5],
         "--lr is 0.5 on the command line but unset (its default) in the checkpoint"),
        # a typed value is refused even when it is the default (train_mnist.py's --epochs is 2)
        (["--output_dir", finished, "--resume", "latest", "--epochs", 2],
         "--epochs is 2 on the command line but 4 in the checkpoint"),
        (["--output_dir", tmp_path / "empty", "--resume", "latest"], "--resume latest: no checkpoint in"),
        (["--output_dir", finished, "--resume", "latest", "--overwrite"], "pass one of them"),
        # --resume auto continues only the run of this very command
        ([*DIGITS_RUN, "--output_dir", finished, "--resume", "auto", "--lr", 0.5, "--epochs", 5],
         f"--resume auto: {finished} holds another run (--epochs 4 there, 5 here; --lr unset there, 0.5 here). "
         "Continue that run with --resume latest"),
        (["--output_dir", finished, "--resume", "auto"], "holds another run (--dataset digits there, mnist here;"),
        (["--output_dir", finished, "--resume", tmp_path], "is not a checkpoint (no trainer_state.json in it). Pass "
                                                           "`latest`, `auto` or a folder from OUTPUT_DIR/checkpoints/"),
        # the run's folder, its best/ or checkpoints/ where a checkpoint goes: how to continue that run
        (["--output_dir", finished, "--resume", finished / "best"],
         f"--resume {finished / 'best'}: {finished / 'best'} is not a checkpoint (no trainer_state.json in it). To "
         f"continue the run in {finished} from its last checkpoint, pass --resume latest."),
        (["--output_dir", tmp_path / "new", "--resume", finished / "checkpoints"],
         f"pass --resume latest --output_dir {finished}."),
        (["--output_dir", finished / "checkpoints", "--resume", "latest"], f"--output_dir {finished / 'checkpoints'} "
         f"is the run's checkpoints/ folder: pass the run's own folder, --output_dir {finished}"),
    ]
    corrupt = finished / "checkpoints" / "epoch_002_end" / "model.safetensors"
    corrupt.write_bytes(corrupt.read_bytes()[:1000])
    # a file of a checkpoint stands for its folder; a checkpoint's name, or a path in the run, is found in the run
    for output_dir, given in ((tmp_path / "new", corrupt.parent), (tmp_path / "new", corrupt),
                              (finished, "epoch_002_end"), (finished, "checkpoints/epoch_002_end")):
        cases.append((["--output_dir", output_dir, "--resume", given],
                      f"checkpoint {corrupt.parent} is damaged: {corrupt} holds 1000 bytes"))
    cases += [(["--output_dir", finished, "--resume", "lastest"],
               "--resume lastest: no such checkpoint folder; did you mean --resume latest?"),
              (["--output_dir", finished, "--resume", tmp_path / "nowhere"],
               f"--resume {tmp_path / 'nowhere'}: {tmp_path / 'nowhere'} not found. Pass `latest`, `auto` or a folder "
               "from OUTPUT_DIR/checkpoints/.")]
    for args, message in cases:
        assert message in refused(MNIST.name, *args)
    assert metrics(finished) == metrics(digits_reference(1))  # nothing of the run was touched


@pytest.mark.slow
def test_a_finished_run_is_finished_on_any_process_count_and_auto_ends_with_nothing_to_do(tmp_path, digits_reference,
                                                                                         monkeypatch):
    """A requeued job or a restart that finds the run finished ends with exit 0 (`auto`); `latest` refuses. The
    2-process run's 168 steps are not the 336 of one (--grad_accum 1 on both): finished is counted in epochs."""
    finished = tmp_path / "finished"
    shutil.copytree(digits_reference(2), finished)
    done = run_script("train_mnist.py", *DIGITS_RUN, "--output_dir", finished, "--resume", "auto")
    assert done.returncode == 0
    assert done.stdout == (f"--resume auto: the run in {finished} is finished (epoch 4 of 4 done): nothing to do. Its "
                           f"best model is in {finished / 'best'}\n")
    assert "is the end of a finished run (epoch 4 of 4 done): nothing to resume" in refused(
        MNIST.name, "--output_dir", finished, "--resume", "latest")
    # a count that could not go on with its global batch of 2 x 1 micro-batches: finished all the same
    monkeypatch.setenv("WORLD_SIZE", "3")
    done = run_script("train_mnist.py", *DIGITS_RUN, "--output_dir", finished, "--resume", "auto")
    assert done.returncode == 0 and "is finished (epoch 4 of 4 done): nothing to do" in done.stdout
    assert metrics(finished) == metrics(digits_reference(2))


@pytest.mark.slow
def test_a_damaged_checkpoint_file_is_named_and_never_used(tmp_path, digits_reference):
    """Accelerate loads a random_states_0.pkl cut in half without a word (the resumed run then differs); the
    sizes and checksums in trainer_state.json name it, and no other checkpoint is taken in its place."""
    run = tmp_path / "run"
    shutil.copytree(digits_reference(1), run)
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    states = latest / "random_states_0.pkl"
    size = states.stat().st_size
    states.write_bytes(states.read_bytes()[:size // 2])
    for resume in ("latest", "auto"):
        message = refused(MNIST.name, *DIGITS_RUN, "--output_dir", run, "--resume", resume)
        assert (f"checkpoint {latest} is damaged: {states} holds {size // 2} bytes, {size} when it was saved. It was "
                "not used. Resume from another checkpoint (--resume ") in message, message
    weights = run / "checkpoints" / "epoch_002_end" / "model.safetensors"
    flipped = bytearray(weights.read_bytes())
    flipped[-1] ^= 1  # same size, one bit
    weights.write_bytes(bytes(flipped))
    message = refused(MNIST.name, "--output_dir", run, "--resume", weights.parent)
    assert f"{weights} does not hold what was saved (its checksum differs)" in message


@pytest.mark.slow
def test_checkpoint_of_another_class_count_or_architecture_is_refused(tmp_path, cifar_jpegs):
    cifar_run = tmp_path / "cifar"
    result = train("--data_dir", cifar_jpegs, "--output_dir", cifar_run, "--epochs", 1, "--batch_size", 32,
                   "--max_steps", 2, "--checkpoint_every", 1, "--keep_checkpoints", 3, script=CIFAR)
    assert result.returncode == 0, result.output
    checkpoint = cifar_run / "checkpoints" / "epoch_001_batch_000001"  # the run goes on from there
    three_classes = tmp_path / "three_classes"
    for split in ("train", "test"):
        for name in sorted(p.name for p in (cifar_jpegs / split).iterdir() if p.is_dir())[:3]:
            shutil.copytree(cifar_jpegs / split / name, three_classes / split / name)

    message = refused(CIFAR.name, "--data_dir", three_classes, "--output_dir", tmp_path / "a", "--resume", checkpoint)
    assert (f"checkpoint {checkpoint} holds resnet18_cifar with {{'num_classes': 10, 'in_chans': 3}}, but this run "
            "builds resnet18_cifar with {'num_classes': 3, 'in_chans': 3}") in message

    message = refused(MNIST.name, "--dataset", "digits", "--output_dir", tmp_path / "b", "--resume", checkpoint)
    assert message.startswith("error: the checkpoint is another training script's (or another version's): its "
                              "arguments --model, "), message
    # a checkpoint whose arguments this script takes but whose model it does not build: a copy of the script with
    # another --model default, say
    foreign = load_script(MNIST.name).parse_args
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    mnist_args = {name: value for name, value in saved["args"].items() if name in vars(foreign([]))}
    (checkpoint / "trainer_state.json").write_text(json.dumps({**saved, "args": {**mnist_args, "dataset": "digits"}}))
    message = refused(MNIST.name, "--dataset", "digits", "--output_dir", tmp_path / "c", "--resume", checkpoint)
    assert "holds resnet18_cifar with {'num_classes': 10, 'in_chans': 3}, but this run builds mnist_convnet" in message


@pytest.mark.slow
def test_compiled_channels_last_bf16_run_saves_plain_weights_and_resumes_compiled_or_not(tmp_path):
    """--compile goes through Accelerate's dynamo plugin: best/ and checkpoints hold the plain model's names (the
    EMA's too: --ema_decay's average is prepared, so compiled, and once ended the run with a traceback at its first
    `if ema:`, a compiled module having no truth value), predict.py's loader reads them, and a resumed run may turn
    --compile on or off (a runtime flag).
    bf16 autocast (Accelerate's) runs on the CPU too, where it has bf16 instructions; on one without them, fp32
    (bf16 forced there converts every operation, its note in test_builders.py; under ATEN_CPU_CAPABILITY=avx2 on a
    CPU with them, Inductor's compiled bf16 kernels fail)."""
    from common.distributed import cpu_computes_bf16
    from common.models import load_best_model

    output_dir, precision = tmp_path / "run", "bf16" if cpu_computes_bf16() else "no"
    flags = ["--dataset", "digits", "--epochs", 2, "--batch_size", 32, "--compile", "--channels_last",
             "--mixed_precision", precision, "--ema_decay", 0.9]  # the EMA prepared, so compiled too
    result = train(*flags, "--output_dir", output_dir, processes=2)
    assert result.returncode == 0, result.output
    assert re.search(r"epoch 2/2 .* ema_val_accuracy [\d.]+%", result.output), result.output
    for name in ("best/model.safetensors", "checkpoints/epoch_002_end/model.safetensors",
                 "checkpoints/epoch_002_end/model_1.safetensors"):  # model_1: the EMA
        names = load_file(output_dir / name).keys()
        assert names and not [n for n in names if n.startswith("_orig_mod.")], name
    model, meta = load_best_model(output_dir / "best")
    assert meta["args"]["compile"] and meta["args"]["channels_last"]
    assert f"mixed precision {precision}" in result.output
    # what the compile cost, from the epochs' own times (the first holds the compiles)
    said = re.search(r"--compile: epoch 1 took ([\d.]+) s, epoch 2 ([\d.]+) s: about (-?[\d.]+) s of compiling the "
                     r"model for training and evaluation", result.output)
    times = [json.loads(line)["epoch_time_s"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert said and [float(x) for x in said.groups()[:2]] == [round(t, 1) for t in times], result.output

    for again in (["--compile"], []):  # from the end of epoch 1, compiled again, then eagerly
        resumed_dir = tmp_path / f"resumed{len(again)}"
        shutil.copytree(output_dir, resumed_dir)
        resumed = train("--output_dir", resumed_dir, "--resume", resumed_dir / "checkpoints" / "epoch_001_end",
                        *again, processes=2)
        assert resumed.returncode == 0, resumed.output
        assert "--compile:" not in resumed.output  # one epoch: nothing to compare it with
        expected, got = metrics(output_dir)[1], metrics(resumed_dir)[1]
        assert got["epoch"] == 2 and got["train_unique_samples"] == expected["train_unique_samples"]
        # compiled kernels and eager ones round differently; the run is the same one
        assert got["val_accuracy"] == pytest.approx(expected["val_accuracy"], abs=0.02)

"""Recipes in the step-in-the-script design: a user's own edit of a copied script, and the recipe options
(EMA of the weights, class balance, augmentation, early stopping), each trained on 2 processes and, where a
run can be resumed, resumed from the middle of an epoch exactly."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TIMES, assert_two_processes_shared_the_data, launch_warm, same_value, script

pytestmark = pytest.mark.slow

EDITS = {  # what a user changes, in the copied script only: an auxiliary loss term and another optimizer
    "                loss = loss_fn(model(images), labels)\n":
        "                logits = model(images)\n"
        "                loss = loss_fn(logits, labels) + 1e-3 * logits.float().pow(2).mean()  # logit penalty\n",
    "    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=True,\n"
    "                                weight_decay=args.weight_decay, **fused_on_cpu(accelerator.device))\n":
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=lr / 50, weight_decay=args.weight_decay)\n",
}


def metrics(output_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMES}
            for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def train_then_resume_mid_epoch(tmp_path, script, *args, epoch, weights=("model.safetensors",), cwd=None):
    """Train uninterrupted on 2 processes (a checkpoint every 3 steps), then resume a copy of the run from the
    first checkpoint inside `epoch` with only the location flags, and check that both end the same: the
    `weights` files of the last checkpoint, the optimizer state and metrics.jsonl. Returns the reference run."""
    reference = tmp_path / "reference"
    result = launch_warm(script, *args, "--output_dir", reference, "--checkpoint_every", 3, "--keep_checkpoints", 100,
                         cwd=cwd)
    assert result.returncode == 0, result.output
    resumed = shutil.copytree(reference, tmp_path / "resumed")
    middle = sorted((resumed / "checkpoints").glob(f"epoch_{epoch:03d}_batch_*"))[0]
    location = [value for flag, value in zip(args, args[1:]) if flag == "--data_dir"][:1]
    result = launch_warm(script, *(["--data_dir", *location] if location else []), "--output_dir", resumed,
                         "--resume", middle, cwd=cwd)
    assert result.returncode == 0, result.output
    assert f"resumed from {middle}: epoch {epoch}, batch {int(middle.name[-6:])}" in result.output
    last = sorted((reference / "checkpoints").glob("epoch_*_end"))[-1].name
    for name in weights:
        ours, theirs = (load_file(run / "checkpoints" / last / name) for run in (resumed, reference))
        assert ours.keys() == theirs.keys()
        assert all(torch.allclose(ours[k].float(), theirs[k].float(), atol=1e-6) for k in ours), name
    ours, theirs = (torch.load(run / "checkpoints" / last / "optimizer.bin", weights_only=True)["state"]
                    for run in (resumed, reference))
    assert ours.keys() == theirs.keys() and all(ours[i].keys() == theirs[i].keys() for i in theirs)
    assert all(torch.allclose(ours[i][k].float(), theirs[i][k].float(), atol=1e-7) for i in theirs for k in theirs[i])
    for record, expected in zip(metrics(resumed), metrics(reference), strict=True):
        assert all(same_value(record[k], expected[k], 1e-6) for k in expected), (record, expected)
    return reference


def test_a_copied_script_with_its_own_loss_and_optimizer_and_device_cutout_and_erasing_resumes_mid_epoch_exactly(
        tmp_path, cifar_jpegs):
    """A user's copy of train_cifar.py with its own loss term and optimizer, trained with reflect-padded crops,
    Cutout and random erasing on the device: on 2 processes, resumed inside epoch 2, it ends as the uninterrupted
    run."""
    project = tmp_path / "my_project"
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "scripts").mkdir()
    script = (REPO / "scripts" / "train_cifar.py").read_text()
    for old, new in EDITS.items():
        assert script.count(old) == 1, f"the step in train_cifar.py no longer reads as the test expects: {old}"
        script = script.replace(old, new)
    (project / "scripts" / "train_cifar.py").write_text(script)

    reference = train_then_resume_mid_epoch(tmp_path, project / "scripts" / "train_cifar.py", "--data_dir",
                                            cifar_jpegs, "--model", "test_resnet", "--epochs", 2, "--batch_size", 8,
                                            "--cutout", 16, "--random_erasing", 0.5, "--padding_mode", "reflect",
                                            "--no-identity_start", epoch=2, cwd=project)
    assert_two_processes_shared_the_data(metrics(reference), train_size=151, batch_size=8)
    # the edited recipe ran: AdamW's moments in the optimizer state, not SGD's momentum buffers
    state = torch.load(reference / "checkpoints" / "epoch_002_end" / "optimizer.bin", weights_only=True)["state"]
    assert {"exp_avg", "exp_avg_sq"} <= state[0].keys() and "momentum_buffer" not in state[0]
    args = json.loads((reference / "best" / "meta.json").read_text())["args"]
    assert (args["cutout"], args["random_erasing"], args["padding_mode"], args["identity_start"]) == (
        16, 0.5, "reflect", False)


def test_seedlings_with_class_weights_and_a_balanced_sampler_resume_mid_epoch_exactly(tmp_path, seedlings):
    """The folder path too: Mixup on every batch, a class-balanced sampler, weighted loss, augmentation in a
    DataLoader worker (seeded by seed, epoch and index), 2 processes, resumed inside epoch 2."""
    reference = train_then_resume_mid_epoch(
        tmp_path, REPO / "scripts" / "train_seedlings.py", "--data_dir", seedlings, "--model", "test_resnet",
        "--image_size", 48, "--epochs", 2, "--batch_size", 4, "--num_workers", 1, "--mixup_prob", 1.0,
        "--class_weights", "balanced", "--sampler", "balanced", "--no-cache_images", epoch=2)
    for record in metrics(reference):  # drawn with replacement: some images twice, others not at all
        assert record["train_samples_per_process"] == [28, 28] and record["train_unique_samples"] < 56
    optimizer = torch.load(reference / "checkpoints" / "epoch_002_end" / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["fused"] is True and "exp_avg" in optimizer["state"][0]  # fused Adam


def test_seedlings_trivialaugment_random_erasing_and_patience_end_early_with_best_and_a_report(tmp_path, seedlings):
    output_dir = tmp_path / "run"
    command = [REPO / "scripts" / "train_seedlings.py", "--data_dir", seedlings, "--model", "test_resnet",
               "--image_size", 48, "--epochs", 8, "--batch_size", 4, "--num_workers", 1, "--auto_augment",
               "trivialaugment", "--random_erasing", 0.5, "--patience", 2, "--rotation", 0, "--output_dir", output_dir,
               "--no-find_label_issues"]
    result = launch_warm(*command)
    assert result.returncode == 0, result.output
    assert "suspected wrong labels" not in result.output and not (output_dir / "label_issues.csv").exists()
    assert "not computed (<code>--no-find_label_issues</code>)" in (output_dir / "report.html").read_text()
    records = metrics(output_dir)
    accuracies = [record["val_accuracy"] for record in records]
    best_epoch = accuracies.index(max(accuracies)) + 1  # the first epoch with the best accuracy
    assert len(records) == best_epoch + 2 < 8, accuracies  # two epochs without a better one, then the end
    assert (f"early stop after epoch {len(records)}: val accuracy has not improved for 2 epoch(s) (--patience); "
            f"best/ holds epoch {best_epoch}") in result.output
    meta = json.loads((output_dir / "best" / "meta.json").read_text())
    assert meta["epoch"] == best_epoch and meta["value"] == pytest.approx(max(accuracies))
    assert meta["args"]["rotation"] == 0
    report = json.loads((output_dir / "classification_report.json").read_text())
    assert report["accuracy"] == pytest.approx(accuracies[-1])  # the last epoch's evaluation
    # the run is over: resuming it is refused (one process, so that no launcher prints around it), nothing is lost
    again = script(command[0].name, *command[1:], "--resume", "latest")
    assert again.returncode == 2 and "Traceback" not in again.output, again.output
    assert (f"is the end of a finished run (stopped early after epoch {len(records)}: val accuracy did not improve "
            f"for 2 epoch(s) after epoch {best_epoch}, --patience 2)") in again.output, again.output
    assert metrics(output_dir) == records and (output_dir / "best" / "model.safetensors").exists()


def test_seedlings_cached_images_augmented_on_the_device_resume_mid_epoch_exactly(tmp_path, seedlings):
    """--cache_images: every process maps the one decoded .npy file, the workers only copy bytes, and crop,
    flips and rotation run on the device from the checkpointed RNG. With an EMA, whose weights (model_1) resume
    exactly too."""
    data = shutil.copytree(seedlings, tmp_path / "data")
    reference = train_then_resume_mid_epoch(
        tmp_path, REPO / "scripts" / "train_seedlings.py", "--data_dir", data, "--model", "test_resnet", "--image_size",
        48, "--epochs", 2, "--batch_size", 4, "--num_workers", 1, "--cache_images", "--random_erasing", 0.5,
        "--ema_decay", 0.99, epoch=2, weights=("model.safetensors", "model_1.safetensors"))
    assert (data / ".checked-train-55px.npy").exists()
    for record in metrics(reference):  # drop_last: 14 full batches of 4 out of 59 images, half on each process
        assert record["train_samples_per_process"] == [28, 28] and record["train_unique_samples"] == 56

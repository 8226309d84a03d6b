"""The promise of keeping the training step in the script: a user copies train_cifar.py and common/ into their
project, changes the recipe in the copied script alone, and the run still shares its work across 2 processes
and resumes from the middle of an epoch exactly."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_two_processes_shared_the_data, launch

pytestmark = pytest.mark.slow

TIMES = ("images_per_s", "train_time_s", "epoch_time_s")
EDITS = {  # what a user changes, in the copied script only: an auxiliary loss term and another optimizer
    "                loss = loss_fn(model(images), labels)\n":
        "                logits = model(images)\n"
        "                loss = loss_fn(logits, labels) + 1e-3 * logits.float().pow(2).mean()  # logit penalty\n",
    "    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, nesterov=True,\n"
    "                                weight_decay=args.weight_decay)\n":
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr / 50, weight_decay=args.weight_decay)\n",
}


def copy_and_edit(project):
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "scripts").mkdir()
    script = (REPO / "scripts" / "train_cifar.py").read_text()
    for old, new in EDITS.items():
        assert script.count(old) == 1, f"the step in train_cifar.py no longer reads as the test expects: {old}"
        script = script.replace(old, new)
    (project / "scripts" / "train_cifar.py").write_text(script)
    return project / "scripts" / "train_cifar.py"


def metrics(output_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMES}
            for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_copied_script_with_its_own_loss_and_optimizer_resumes_mid_epoch_exactly(tmp_path, cifar_jpegs):
    script = copy_and_edit(tmp_path / "my_project")
    common = ["--data_dir", cifar_jpegs, "--epochs", 2, "--batch_size", 8, "--checkpoint_every", 3,
              "--keep_checkpoints", 100]
    reference = tmp_path / "reference"
    result = launch(script, *common, "--output_dir", reference, cwd=tmp_path / "my_project")
    assert result.returncode == 0, result.output
    assert_two_processes_shared_the_data(metrics(reference), train_size=151, batch_size=8)
    # the edited recipe ran: AdamW's moments in the optimizer state, not SGD's momentum buffers
    state = torch.load(reference / "checkpoints" / "epoch_002_end" / "optimizer.bin", weights_only=True)["state"]
    assert {"exp_avg", "exp_avg_sq"} <= state[0].keys() and "momentum_buffer" not in state[0]

    # resume a copy from the first checkpoint inside epoch 2, with no other training flags
    resumed = shutil.copytree(reference, tmp_path / "resumed")
    middle = sorted((resumed / "checkpoints").glob("epoch_002_batch_*"))[0]
    result = launch(script, "--data_dir", cifar_jpegs, "--output_dir", resumed, "--resume", middle,
                    cwd=tmp_path / "my_project")
    assert result.returncode == 0, result.output
    assert f"resumed from {middle}: epoch 2, batch {int(middle.name[-6:])}" in result.output
    ours, theirs = (load_file(run / "checkpoints" / "epoch_002_end" / "model.safetensors") for run in (resumed, reference))
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[k].float(), theirs[k].float(), atol=1e-6) for k in ours)
    ours, theirs = (torch.load(run / "checkpoints" / "epoch_002_end" / "optimizer.bin", weights_only=True)["state"]
                    for run in (resumed, reference))
    assert all(torch.allclose(ours[i]["exp_avg"], theirs[i]["exp_avg"], atol=1e-7) for i in theirs)
    for record, expected in zip(metrics(resumed), metrics(reference), strict=True):
        assert all(record[k] == pytest.approx(expected[k], rel=1e-6) for k in expected), (record, expected)

"""The best model round trip: a training run's best/ folder -> predict.py -> the same predictions."""

import csv
import json
import sys

import numpy as np
import pytest
from PIL import Image
from sklearn.metrics import classification_report

from conftest import REPO, run_command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """One epoch on the digits, so the best model is the final evaluation's model."""
    output_dir = tmp_path_factory.mktemp("digits") / "run"
    result = run_command([sys.executable, REPO / "scripts" / "train_mnist.py", "--dataset", "digits", "--epochs", 1,
                          "--output_dir", output_dir])
    assert result.returncode == 0, result.output
    return output_dir


def write_test_pngs(folder):
    from common.data import build_digits

    _, test = build_digits()
    for i, (image, label) in enumerate(zip(test.images, test.labels)):
        Image.fromarray(image[0].numpy()).save(folder / f"{i:04d}_label{int(label)}.png")
    return test


def predict(*args):
    return run_command([sys.executable, REPO / "scripts" / "predict.py", *args])


def test_predict_matches_the_training_runs_evaluation(digits_run, tmp_path):
    meta = json.loads((digits_run / "best" / "meta.json").read_text())
    assert meta["architecture"] == "mnist_convnet" and meta["epoch"] == 1 and meta["image_size"] == [8, 8]
    assert meta["class_names"] == [str(d) for d in range(10)] and meta["args"]["dataset"] == "digits"
    (tmp_path / "images").mkdir()
    test = write_test_pngs(tmp_path / "images")
    (tmp_path / "images" / "notes.png").write_text("not an image")

    result = predict("--model_dir", digits_run / "best", "--output", tmp_path / "out.csv", "--top_k", 3,
                     tmp_path / "images")
    assert result.returncode == 0, result.output
    assert "skipped" in result.output and "notes.png" in result.output
    rows = list(csv.DictReader(open(tmp_path / "out.csv")))
    assert len(rows) == len(test) == 450
    assert all(float(r["probability_1"]) >= float(r["probability_2"]) >= float(r["probability_3"]) for r in rows)
    predicted = np.array([int(r["class_1"]) for r in rows])
    # the run's report came from its final (= best) evaluation: predict.py must reproduce it exactly
    expected = json.loads((digits_run / "classification_report.json").read_text())
    ours = classification_report(test.labels.numpy(), predicted, labels=list(range(10)),
                                 target_names=meta["class_names"], digits=4, zero_division=0, output_dict=True)
    assert ours == expected


def test_corrupt_or_foreign_weights_get_a_clear_message(digits_run, tmp_path):
    best = tmp_path / "best"
    best.mkdir()
    meta = json.loads((digits_run / "best" / "meta.json").read_text())
    weights = (digits_run / "best" / "model.safetensors").read_bytes()
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(image)

    (best / "meta.json").write_text(json.dumps({**meta, "model_kwargs": {"num_classes": 12, "in_chans": 1}}))
    (best / "model.safetensors").write_bytes(weights)
    result = predict("--model_dir", best, "--output", tmp_path / "out.csv", image)
    assert result.returncode == 2 and "do not fit mnist_convnet" in result.output and "num_classes': 12" in result.output
    assert "Traceback" not in result.output

    (best / "meta.json").write_text(json.dumps(meta))
    (best / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    result = predict("--model_dir", best, "--output", tmp_path / "out.csv", image)
    assert result.returncode == 2 and "is corrupt or not a safetensors file" in result.output
    assert not (tmp_path / "out.csv").exists()

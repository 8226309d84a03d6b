"""The best model round trip: a training run's best/ folder -> predict.py (or export.py -> an ONNX file ->
predict.py) -> the same predictions."""

import csv
import json
import re
import shutil
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, launch_warm, refused, run_command, script

pytestmark = pytest.mark.slow


def write_test_pngs(folder):
    from common.mnist import build_digits

    _, test = build_digits()
    for i, (image, label) in enumerate(zip(test.images, test.labels)):
        Image.fromarray(image[0].numpy()).save(folder / f"{i:04d}_label{int(label)}.png")
    return test


def predict(*args):
    return script("predict.py", *args)


def test_predict_matches_the_best_epochs_evaluation_image_by_image(digits_run, tmp_path):
    meta = json.loads((digits_run / "best" / "meta.json").read_text())
    accuracies = [json.loads(line)["val_accuracy"] for line in (digits_run / "metrics.jsonl").read_text().splitlines()]
    assert meta["epoch"] == 1 + accuracies.index(max(accuracies)) and meta["value"] == max(accuracies)
    assert meta["architecture"] == "mnist_convnet" and meta["image_size"] == [8, 8] and meta["mean"] == [0.0]
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
    # best/val_predictions.csv is the training run's evaluation of the best epoch, image by image
    expected = list(csv.DictReader(open(digits_run / "best" / "val_predictions.csv")))
    assert [r["label"] for r in expected] == [str(int(label)) for label in test.labels]
    assert [r["class_1"] for r in rows] == [r["prediction"] for r in expected]
    assert np.allclose([float(r["probability_1"]) for r in rows], [float(r["probability"]) for r in expected], atol=2e-6)
    assert np.mean([r["prediction"] == r["label"] for r in expected]) == pytest.approx(meta["value"])
    # more than the model's classes: every class, said
    result = predict("--model_dir", digits_run / "best", "--output", tmp_path / "all.csv", "--top_k", 50,
                     tmp_path / "images" / f"0000_label{int(test.labels[0])}.png")
    assert result.returncode == 0, result.output
    assert "warning: --top_k 50 is more than the model's 10 classes: each row lists all 10" in result.output
    assert f"predicted 1 image -> {tmp_path / 'all.csv'}" in result.output
    header = next(csv.reader(open(tmp_path / "all.csv")))
    assert header[-2:] == ["class_10", "probability_10"] and len(header) == 21


def test_corrupt_or_foreign_weights_get_a_clear_message(digits_run, tmp_path):
    best = tmp_path / "best"
    best.mkdir()
    meta = json.loads((digits_run / "best" / "meta.json").read_text())
    weights = (digits_run / "best" / "model.safetensors").read_bytes()
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(image)

    (best / "meta.json").write_text(json.dumps({**meta, "model_kwargs": {"num_classes": 12, "in_chans": 1},
                                                "class_names": [str(i) for i in range(12)]}))
    (best / "model.safetensors").write_bytes(weights)
    result = predict("--model_dir", best, "--output", tmp_path / "out.csv", image)
    assert result.returncode == 2 and "do not fit mnist_convnet" in result.output and "num_classes': 12" in result.output
    assert "Traceback" not in result.output

    (best / "meta.json").write_text(json.dumps(meta))
    (best / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    result = predict("--model_dir", best, "--output", tmp_path / "out.csv", image)
    assert result.returncode == 2 and "is corrupt or not a safetensors file" in result.output
    assert not (tmp_path / "out.csv").exists()

    flipped = bytearray(weights)  # whole in size, but a byte of its tensors changed: meta.json's checksum tells
    flipped[-100] ^= 0x40
    (best / "model.safetensors").write_bytes(flipped)
    for tool, args in (("predict.py", ["--output", tmp_path / "out.csv", image]), ("evaluate.py", [])):
        result = script(tool, "--model_dir", best, *args)
        assert result.returncode == 2 and "Traceback" not in result.output, result.output
        assert (f"error: {best / 'model.safetensors'} does not hold what was saved (its checksum differs): it was not "
                "used") in result.output, result.output
    assert not (tmp_path / "out.csv").exists()
    assert meta["files"]["model.safetensors"][0] == len(weights)  # what the run recorded when it wrote best/


def test_a_run_folder_named_where_images_are_expected_is_refused_not_read_as_its_plots(digits_run, tmp_path):
    """A run's folder holds PNGs (its plots): each tool that reads images says what the folder is instead of
    predicting, measuring or training on curves.png and confusion_matrix.png; nothing is written. Found inside a
    folder that is named (`predict.py .` in a project with outputs/), it is left out with a line."""
    assert (digits_run / "curves.png").is_file() and (digits_run / "confusion_matrix.png").is_file()
    for name, args, expected in (
            ("predict.py", ["--model_dir", digits_run / "best", "--output", tmp_path / "p.csv", digits_run],
             "image files"),
            ("compute_mean_std.py", [digits_run, "--output", tmp_path / "s.json"], "image files"),
            ("export.py", ["--model_dir", digits_run / "best", "--output", tmp_path / "m.onnx", "--check_images",
                           digits_run], "image files"),
            ("train_seedlings.py", ["--data_dir", digits_run, "--output_dir", tmp_path / "run"],
             "a folder of class folders")):
        message = refused(name, *args)
        assert (f"error: {digits_run} is the output folder of a training run (it holds metrics.jsonl and "
                f"best/meta.json), not images: expected {expected}") in message, (name, message)
        assert not list(tmp_path.iterdir()), name
    (tmp_path / "images").mkdir()  # where only its plots were copied: images like any others
    shutil.copy(digits_run / "curves.png", tmp_path / "images")
    assert script("compute_mean_std.py", tmp_path / "images", "--output", tmp_path / "s.json").returncode == 0
    project = tmp_path / "project"
    shutil.copytree(digits_run, project / "outputs" / "digits", ignore=shutil.ignore_patterns("checkpoints"))
    (project / "photos").mkdir()
    shutil.copy(tmp_path / "images" / "curves.png", project / "photos" / "mine.png")
    for name, args in (("predict.py", ["--model_dir", digits_run / "best", "--output", tmp_path / "p.csv"]),
                       ("compute_mean_std.py", ["--output", tmp_path / "s.json"])):
        result = script(name, *args, project)
        plots = len(list((project / "outputs").rglob("*.png")))
        assert result.returncode == 0 and plots >= 2, result.output
        assert (f"left out {plots} image(s) in {project / 'outputs' / 'digits'}: the output folder of a training run "
                "(its plots), not images to read") in result.output, result.output
    assert [row["file"] for row in csv.DictReader(open(tmp_path / "p.csv"))] == [str(project / "photos" / "mine.png")]


def test_two_processes_predict_row_for_row_what_one_process_does(digits_run, tmp_path):
    """451 files, one of them unreadable, in batches of 16: each process decodes its share in a worker, and
    one CSV comes out in input order."""
    (tmp_path / "images").mkdir()
    write_test_pngs(tmp_path / "images")
    (tmp_path / "images" / "0100_broken.png").write_bytes(b"\x89PNG not really")
    one = predict("--model_dir", digits_run, "--output", tmp_path / "one.csv", "--batch_size", 16, tmp_path / "images")
    assert one.returncode == 0, one.output
    two = launch_warm(REPO / "scripts" / "predict.py", "--model_dir", digits_run, "--output", tmp_path / "two.csv",
                      "--batch_size", 16, tmp_path / "images")
    assert two.returncode == 0, two.output
    assert "predicted 450 images" in two.output and "skipped 1 unreadable" in two.output
    assert f"skipped {tmp_path / 'images' / '0100_broken.png'}: not a readable image" in two.output
    ours, theirs = (list(csv.DictReader(open(tmp_path / name))) for name in ("two.csv", "one.csv"))
    assert [r["file"] for r in ours] == sorted(str(p) for p in (tmp_path / "images").glob("*_label*.png"))
    assert [r["class_1"] for r in ours] == [r["class_1"] for r in theirs]
    assert np.allclose([float(r["probability_1"]) for r in ours], [float(r["probability_1"]) for r in theirs],
                       atol=1e-6)
    # --output -: the same CSV on standard output, for a pipe; the run's own lines on standard error
    piped = launch_warm(REPO / "scripts" / "predict.py", "--model_dir", digits_run, "--output", "-", "--batch_size", 16,
                        tmp_path / "images", cwd=tmp_path)
    assert piped.returncode == 0, piped.output
    assert piped.stdout == (tmp_path / "two.csv").read_text(), piped.output
    assert "predicted 450 images -> standard output; skipped 1 unreadable\n" in piped.stderr, piped.stderr
    assert not (tmp_path / "-").exists()
    closed = run_command(["bash", "-c", f'"$0" "$@" >&-', sys.executable, REPO / "scripts" / "predict.py", "--model_dir",
                          digits_run, "--output", "-", tmp_path / "images"], cwd=tmp_path)
    assert closed.returncode == 2 and "Traceback" not in closed.stderr, closed.stderr
    assert "error: --output -: standard output is closed here; give a file name" in closed.stderr, closed.stderr
    assert not (tmp_path / "-").exists()


def export(*args):
    return script("export.py", *args)


def test_an_onnx_export_predicts_the_same_top_1_as_pytorch_on_the_digits_test_images(digits_run, tmp_path):
    (tmp_path / "images").mkdir()
    write_test_pngs(tmp_path / "images")
    onnx = tmp_path / "deploy" / "digits.onnx"
    onnx.parent.mkdir()
    result = export("--model_dir", digits_run / "best", "--output", onnx, "--check_images", tmp_path / "images")
    assert result.returncode == 0, result.output
    assert "checked on 450 images" in result.output and "top-1 the same on all" in result.output
    description = json.loads(onnx.with_suffix(".json").read_text())
    assert description["class_names"] == [str(d) for d in range(10)] and description["input"] == "images"
    assert "resize to [8, 8]" in description["preprocessing"]

    for model, csv_file in ((digits_run / "best", "torch.csv"), (onnx, "onnx.csv")):  # both in fp32, as exported
        result = predict("--model_dir", model, "--output", tmp_path / csv_file, tmp_path / "images",
                         "--mixed_precision", "no")
        assert result.returncode == 0, result.output
    ours, theirs = (list(csv.DictReader(open(tmp_path / name))) for name in ("onnx.csv", "torch.csv"))
    assert [r["file"] for r in ours] == [r["file"] for r in theirs] and len(ours) == 450
    assert [r["class_1"] for r in ours] == [r["class_1"] for r in theirs]
    assert np.allclose([float(r["probability_1"]) for r in ours], [float(r["probability_1"]) for r in theirs],
                       atol=1e-5)
    # evaluate.py scores the export as a deployment runs it, its reports beside it: the same answers as best/'s
    scored = [script("evaluate.py", "--model_dir", model, "--mixed_precision", "no", *where) for model, where in (
        (digits_run / "best", ["--output_dir", tmp_path / "torch-evaluation"]), (onnx, []))]
    assert all(result.returncode == 0 for result in scored), [result.output for result in scored]
    score = re.search(r"^digits \(digits, test\): 450 images, accuracy .*; reports in", scored[0].output, re.M)[0]
    assert f"{score} {onnx.parent / 'digits-evaluation'} (open report.html)\n" in scored[1].output, scored[1].output
    ours, theirs = (list(csv.DictReader(open(folder / "predictions.csv"))) for folder in (
        onnx.parent / "digits-evaluation", tmp_path / "torch-evaluation"))
    assert [(r["index"], r["prediction"]) for r in ours] == [(r["index"], r["prediction"]) for r in theirs]
    # an existing export is kept unless --overwrite; a model without its description is refused by name
    again = export("--model_dir", digits_run / "best", "--output", onnx, "--check_images", tmp_path / "images")
    assert again.returncode == 2 and "Traceback" not in again.output, again.output
    assert (f"error: --output {onnx} exists: choose another file, or pass --overwrite to replace it\n"
            in again.output), again.output  # not "and is not an ONNX model": it is one, and still kept
    # an export that fails its check replaces nothing: the earlier one stays, the same file
    inode = onnx.stat().st_ino
    failed = export("--model_dir", digits_run / "best", "--output", onnx, "--check_images", tmp_path / "images",
                    "--overwrite", "--tolerance", "1e-12")
    assert failed.returncode == 2, failed.output
    assert ("error: the export does not match the PyTorch model: on 450 images the largest logit difference is"
            in failed.output and "nothing was written" in failed.output)
    assert onnx.stat().st_ino == inode and onnx.with_suffix(".json").is_file()
    assert not [p for p in onnx.parent.iterdir() if p.name.startswith(".")]  # nor a temporary file beside it
    (tmp_path / "empty.png").touch()  # no image that opens: nothing to check against, not "does not match"
    failed = export("--model_dir", digits_run / "best", "--output", onnx, "--check_images", tmp_path / "empty.png",
                    "--overwrite")
    assert failed.returncode == 2 and ("error: none of the 1 --check_images could be read as an image, so the export "
                                       "could not be checked against the PyTorch model; nothing was written. Pass "
                                       "images that open") in failed.output, failed.output
    assert onnx.stat().st_ino == inode
    onnx.with_suffix(".json").unlink()
    result = predict("--model_dir", onnx, "--output", tmp_path / "x.csv", tmp_path / "images")
    assert result.returncode == 2 and f"{onnx.with_suffix('.json')} is missing" in result.output


def test_an_onnx_export_of_a_seedlings_resnet_agrees_with_pytorch_on_every_image(tmp_path, seedlings):
    import torch
    from safetensors.torch import save_file

    from common.models import build_model, describe_model

    torch.manual_seed(0)
    meta = describe_model("resnet18", sorted(p.name for p in seedlings.iterdir() if p.is_dir()), image_size=(48, 48),
                          normalize=((0.33, 0.29, 0.21), (0.14, 0.14, 0.16)), dataset="folder", arguments={})
    model = build_model("resnet18", **meta["model_kwargs"])
    for module in model.modules():  # BatchNorm statistics of a trained model, not the fresh 0 and 1
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    (tmp_path / "best").mkdir()
    save_file(model.state_dict(), tmp_path / "best" / "model.safetensors")
    (tmp_path / "best" / "meta.json").write_text(json.dumps(meta))
    onnx = tmp_path / "seedlings.onnx"
    result = export("--model_dir", tmp_path / "best", "--output", onnx, "--check_images", seedlings)
    assert result.returncode == 0, result.output
    assert "checked on 85 images" in result.output and "top-1 the same on all" in result.output
    for model_dir, csv_file in ((tmp_path / "best", "torch.csv"), (onnx, "onnx.csv")):
        result = predict("--model_dir", model_dir, "--output", tmp_path / csv_file, seedlings)
        assert result.returncode == 0, result.output
    ours, theirs = (list(csv.DictReader(open(tmp_path / name))) for name in ("onnx.csv", "torch.csv"))
    assert len(ours) == 85 and [r["class_1"] for r in ours] == [r["class_1"] for r in theirs]


def test_the_tools_start_without_what_training_needs(digits_run, tmp_path):
    """predict.py and evaluate.py, each a process of its own: Accelerate's look for DTensor parameters when it places
    a model imported torch.distributed.tensor (0.4 s of their 1.8 s start; common.distributed.prepare_to_evaluate)."""
    (tmp_path / "images").mkdir()
    write_test_pngs(tmp_path / "images")
    best = digits_run / "best"
    for argv in (["predict.py", "--model_dir", best, "--output", tmp_path / "out.csv", tmp_path / "images"],
                 ["evaluate.py", "--model_dir", best, "--output_dir", tmp_path / "evaluation"]):
        code = ("import atexit, runpy, sys\n"  # the scripts end through common.errors.end_process, which runs atexit's
                "atexit.register(lambda: print('loaded', sorted(m for m in ('torch.distributed.tensor', "
                "'torch._dynamo') if m in sys.modules), flush=True))\n"
                f"sys.argv = {[str(REPO / 'scripts' / argv[0]), *map(str, argv[1:])]!r}\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        result = run_command([sys.executable, "-c", code])
        assert result.returncode == 0, result.output
        assert result.stdout.strip().splitlines()[-1] == "loaded []", result.output

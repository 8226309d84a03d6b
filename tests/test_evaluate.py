"""scripts/evaluate.py: a trained model scored on a labelled dataset, on 1 and 2 processes."""

import csv
import json
import re
import shutil
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from common.data import preprocess
from common.mnist import build_digits
from common.models import build_model, describe_model
from conftest import REPO, assert_report_shows, launch_warm, load_script, refused, script

pytestmark = pytest.mark.slow
SEEDLING_MEAN, SEEDLING_STD = (0.33, 0.29, 0.21), (0.14, 0.14, 0.16)


def rows(path):
    return list(csv.DictReader(open(path)))


def write_model(folder, architecture, classes, *, dataset, **description):
    """A best/ folder as a training run writes it, with the weights of a fresh (seeded) model."""
    torch.manual_seed(0)
    meta = describe_model(architecture, classes, dataset=dataset, arguments={}, **description)
    model = build_model(architecture, **meta["model_kwargs"])
    folder.mkdir(parents=True)
    save_file(model.state_dict(), folder / "model.safetensors")
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_two_processes_count_every_image_once_as_one_process_does(tmp_path, cifar_jpegs):
    """101 test images, batches of 8: the last batch of each process is short, and Accelerate pads one."""
    classes = sorted(p.name for p in (cifar_jpegs / "train").iterdir())
    best = write_model(tmp_path / "run" / "best", "resnet18_cifar", classes, dataset="cifar10", image_size=(32, 32),
                       normalize=((0.49, 0.48, 0.45), (0.25, 0.24, 0.26)))
    one = script("evaluate.py", "--model_dir", best, "--data_dir", cifar_jpegs, "--batch_size", 8,
                 "--output_dir", tmp_path / "one")
    assert one.returncode == 0, one.output
    two = launch_warm(REPO / "scripts" / "evaluate.py", "--model_dir", tmp_path / "run", "--data_dir", cifar_jpegs,
                      "--batch_size", 8)
    assert two.returncode == 0, two.output
    ours, theirs = rows(tmp_path / "run" / "evaluation" / "predictions.csv"), rows(tmp_path / "one" / "predictions.csv")
    assert [int(row["index"]) for row in ours] == list(range(101))  # each image once, in dataset order
    assert [(r["label"], r["prediction"]) for r in ours] == [(r["label"], r["prediction"]) for r in theirs]
    assert np.allclose([float(r["probability"]) for r in ours], [float(r["probability"]) for r in theirs], atol=1e-5)
    report = json.loads((tmp_path / "run" / "evaluation" / "classification_report.json").read_text())
    assert report["macro avg"]["support"] == 101
    assert report == json.loads((tmp_path / "one" / "classification_report.json").read_text())
    assert (tmp_path / "run" / "evaluation" / "confusion_matrix.png").stat().st_size > 0
    accuracy = np.mean([r["label"] == r["prediction"] for r in ours])
    assert f"101 images, accuracy {100 * accuracy:.2f}%" in two.output
    # the mistakes report: every image once, by its file; the suspected labels out-of-sample (the model never
    # trained on these images), with the model's training arguments
    losses = rows(tmp_path / "run" / "evaluation" / "losses.csv")
    assert sorted((int(r["index"]), r["file"], r["label"]) for r in losses) == sorted(
        (int(r["index"]), r["file"], r["label"]) for r in ours)
    suspects = rows(tmp_path / "run" / "evaluation" / "label_issues.csv")
    assert_report_shows(tmp_path / "run" / "evaluation" / "report.html", classes=len(classes), top_losses=24,
                        label_issues=min(24, len(suspects)), arguments=False)  # this model was written by the test
    assert "out-of-sample" in (tmp_path / "run" / "evaluation" / "report.html").read_text()
    # a second evaluation into the same folder asks for --overwrite, and changes nothing
    again = script("evaluate.py", "--model_dir", best, "--data_dir", cifar_jpegs, "--output_dir", tmp_path / "one")
    assert again.returncode == 2 and "already holds an evaluation" in again.output and "Traceback" not in again.output
    assert rows(tmp_path / "one" / "predictions.csv") == theirs


def test_best_scores_as_the_training_run_did_and_flip_tta_averages_the_mirror(digits_run, tmp_path):
    plain = script("evaluate.py", "--model_dir", digits_run / "best", "--output_dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.output
    meta = json.loads((digits_run / "best" / "meta.json").read_text())
    ours = rows(tmp_path / "plain" / "predictions.csv")
    expected = rows(digits_run / "best" / "val_predictions.csv")  # the training run's evaluation of that epoch
    assert [(r["label"], r["prediction"]) for r in ours] == [(r["label"], r["prediction"]) for r in expected]
    assert f"accuracy {100 * meta['value']:.2f}%" in plain.output

    flipped = script("evaluate.py", "--model_dir", digits_run / "best", "--output_dir", tmp_path / "tta",
                     "--tta", "flip", "--mixed_precision", "no")  # fp32, as the expected numbers below
    assert flipped.returncode == 0, flipped.output
    from common.models import load_best_model

    model, _ = load_best_model(digits_run / "best")
    images = preprocess(build_digits()[1].images, normalize=(meta["mean"], meta["std"]))
    with torch.no_grad():
        probabilities = (model(images).softmax(1) + model(images.flip(3)).softmax(1)) / 2
    tta = rows(tmp_path / "tta" / "predictions.csv")
    assert [int(r["prediction"]) for r in tta] == probabilities.argmax(1).tolist()
    assert np.allclose([float(r["probability"]) for r in tta], probabilities.max(1).values.numpy(), atol=1e-5)
    assert [r["prediction"] for r in tta] != [r["prediction"] for r in ours]  # the mirror changed some

    # flip + translate: the mirror-averaged image, averaged with the mirror-averaged views shifted by one pixel up-left
    # and down-right, reflect-padded (the fast CIFAR-10 recipe's evaluation)
    shifted = script("evaluate.py", "--model_dir", digits_run / "best", "--output_dir", tmp_path / "tta2",
                     "--tta", "flip_translate", "--mixed_precision", "no")
    assert shifted.returncode == 0, shifted.output
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1), mode="reflect")
    with torch.no_grad():
        views = [padded[:, :, :8, :8], padded[:, :, 2:, 2:]]
        translated = sum((model(v).softmax(1) + model(v.flip(3)).softmax(1)) / 2 for v in views) / 2
    expected = (probabilities + translated) / 2
    both = rows(tmp_path / "tta2" / "predictions.csv")
    assert [int(r["prediction"]) for r in both] == expected.argmax(1).tolist()
    assert np.allclose([float(r["probability"]) for r in both], expected.max(1).values.numpy(), atol=1e-5)
    title = json.loads((tmp_path / "tta2" / "mistakes.json").read_text())["title"]
    assert "(digits, test, flip + translate TTA)" in title
    # a folder given to a digits model: the digits were scored under the folder's name
    (tmp_path / "photos").mkdir()
    message = refused("evaluate.py", "--model_dir", digits_run / "best", "--data_dir", tmp_path / "photos",
                      "--output_dir", tmp_path / "folder")
    assert message.strip() == (f"error: --data_dir {tmp_path / 'photos'}: the digits are scikit-learn's and take no "
                               "--data_dir; to score the images there, add --dataset folder")


def test_a_run_trains_channels_last_by_default_and_its_best_is_loaded_in_the_layout_it_trained_in(digits_run, tmp_path):
    """The NHWC layout is the default (faster convolutions on CPUs and under bf16/fp16 on GPUs); the tools load a
    best/ in its run's layout, so that they score as it did to the last digit: a run of before the default, or of
    --no-channels_last, in NCHW."""
    from common.models import load_best_model

    parse_args = load_script("train_mnist.py").parse_args
    assert parse_args([]).channels_last and not parse_args(["--no-channels_last"]).channels_last

    def layouts(model_dir):
        convs = [m.weight for m in load_best_model(model_dir)[0].modules()  # a layout shows with 2+ input channels
                 if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1]
        return {w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs}

    assert json.loads((digits_run / "best" / "meta.json").read_text())["args"]["channels_last"] is True
    assert layouts(digits_run / "best") == {True}
    for args in ({"channels_last": False}, {}):  # --no-channels_last, and a run of before the flag's default
        best = shutil.copytree(digits_run / "best", tmp_path / f"best{len(args)}")
        meta = json.loads((best / "meta.json").read_text())
        (best / "meta.json").write_text(json.dumps(meta | {"args": args}))
        assert layouts(best) == {False}


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_a_compiled_model_is_compiled_once_for_an_evaluation_whose_last_batch_is_smaller(layout):
    """--compile: the last batch (2 of 10 images at a batch of 4) reaches the model filled up to 4 in the batches'
    layout, its fillers' scores dropped, so that Dynamo compiles the model once for evaluation instead of again for
    that size (a 2-epoch digits run, its Inductor cache cold: 3-4 s of 27-35 s on a 2-core CPU), nor for the strides
    of flip + translate TTA's shifted views; the scores are the uncompiled model's."""
    from common.evaluation import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    model = model.to(memory_format=layout).eval()
    images, labels = torch.rand(10, 3, 12, 12).contiguous(memory_format=layout), torch.randint(0, 5, (10,))
    batches = [{"image": images[i:i + 4], "label": labels[i:i + 4], "index": torch.arange(10)[i:i + 4]}
               for i in range(0, 10, 4)]
    one_process, normalize = SimpleNamespace(num_processes=1), lambda images: (images - 0.5) / 0.25  # in the layout

    def compiles(batches, tta):
        """The scores of the model compiled, with the input batch sizes of each compile, against the plain model's."""
        sizes = []

        def backend(graph, inputs):  # Dynamo's graph, run as it was traced: each call is a compile
            sizes.append([len(t) for t in inputs if isinstance(t, torch.Tensor) and t.shape[1:] == (3, 12, 12)])
            return graph.forward

        torch._dynamo.reset()
        ours = evaluate(torch.compile(model, backend=backend), batches, one_process, transform=normalize, tta=tta)
        plain = evaluate(model, batches, one_process, transform=normalize, tta=tta)
        assert ours["samples"] == plain["samples"] and ours["indices"].tolist() == plain["indices"].tolist()
        assert np.allclose(ours["probabilities"], plain["probabilities"], atol=1e-6)
        assert ours["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        return sizes

    for tta in ("none", "flip_translate"):  # one compile, for 4 images: the shifted views are copied into the layout
        assert compiles(batches, tta) == [[4]]


def test_a_model_dir_given_as_a_file_of_it_is_its_folder_and_a_folder_of_runs_names_them(digits_run, tmp_path):
    from common.models import load_best_model

    model, meta = load_best_model(digits_run / "best" / "model.safetensors")  # the file a user points at
    same, same_meta = load_best_model(digits_run / "best")
    pairs = zip(model.state_dict().values(), same.state_dict().values())
    assert meta == same_meta and all(torch.equal(a, b) for a, b in pairs)
    runs = tmp_path / "runs"
    shutil.copytree(digits_run / "best", runs / "digits" / "best")
    result = script("evaluate.py", "--model_dir", runs / "digits" / "best" / "model.safetensors")
    assert result.returncode == 0, result.output  # its reports where best/'s go: the run's evaluation/, not in best/
    assert (runs / "digits" / "evaluation" / "report.html").is_file()
    assert not (runs / "digits" / "best" / "evaluation").exists()
    early = tmp_path / "early"  # a run stopped before its first epoch's end: checkpoints, no best/
    shutil.copytree(digits_run / "checkpoints", early / "checkpoints")
    last = sorted((early / "checkpoints").glob("epoch_*"))[-1]
    named = sorted((early / "checkpoints").glob("epoch_*"))[0]  # latest pointed back at an earlier one
    (early / "checkpoints" / "latest").write_text(named.name + "\n")
    for pointer in (early / "checkpoints" / "latest", early / "checkpoints"):  # the checkpoint --resume latest takes
        model, meta = load_best_model(pointer)
        assert meta == load_best_model(named)[1] and named != last and meta["epoch"] < load_best_model(last)[1]["epoch"]
    result = script("evaluate.py", "--model_dir", early / "checkpoints" / "latest")
    assert result.returncode == 0 and (early / "evaluation" / "report.html").is_file(), result.output
    for given, message in ((runs, f"error: {runs} holds no model but the runs {runs / 'digits'}: pass one of them"),
                           (early, f"error: {early} has no best/ (a run writes it at the end of its first epoch) but "
                                   f"has checkpoints: pass one, e.g. --model_dir {last}"),
                           (tmp_path / "typo", f"error: --model_dir {tmp_path / 'typo'} not found: pass the best/ "
                                               "folder a training run wrote (or the run's folder, or one of its"),
                           (digits_run / "metrics.jsonl", f"error: --model_dir {digits_run / 'metrics.jsonl'} is a "
                                                          "file: pass the best/ folder")):
        assert message in refused("evaluate.py", "--model_dir", given, "--output_dir", tmp_path / "out")
    (early / "checkpoints" / "latest").write_text("epoch_009_end\n")  # a checkpoint removed since latest named it
    for pointer in (early / "checkpoints" / "latest", early / "checkpoints"):
        assert (f"error: --model_dir {pointer}: {early / 'checkpoints' / 'latest'} names epoch_009_end, which is not "
                "there (removed since?): pass the run's best/ folder or one of its checkpoints (in "
                f"{early / 'checkpoints'}: ") in refused("predict.py", "--model_dir", pointer,
                                                         digits_run / "curves.png")
    assert not (tmp_path / "out").exists()
    (tmp_path / "notes.txt").write_text("mine")  # --output_dir a file: refused, kept
    message = refused("evaluate.py", "--model_dir", digits_run / "best", "--output_dir", tmp_path / "notes.txt")
    assert f"error: --output_dir {tmp_path / 'notes.txt'} is a file: choose a folder" in message
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_run_with_tta_evaluates_every_epoch_with_it_and_best_says_so(tmp_path):
    """--tta in training: each epoch's evaluation averages the views (said in its line, metrics.jsonl and best/), and
    evaluate.py and predict.py with the same --tta score best/ as the run did."""
    run = tmp_path / "run"
    result = script("train_mnist.py", "--dataset", "digits", "--epochs", 2, "--tta", "flip_translate",
                    "--mixed_precision", "no", "--output_dir", run)
    assert result.returncode == 0, result.output
    said = re.search(r"epoch 2/2 .* val_accuracy ([\d.]+)% \(450 images, flip \+ translate TTA; without it "
                     r"([\d.]+)%, flip alone ([\d.]+)%\)", result.output)
    assert said, result.output
    # mirrored digits are other digits: the TTA lowers the accuracy, and the run says so once, at its end
    assert result.output.count("warning: --tta flip_translate lowered this model's accuracy to") == 1, result.output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["val_tta"] for m in metrics] == ["flip_translate"] * 2
    meta = json.loads((run / "best" / "meta.json").read_text())
    assert meta["tta"] == "flip_translate" and meta["args"]["tta"] == "flip_translate"
    # each step's accuracy, from the same passes: what the same model scores with that TTA alone
    from common.evaluation import evaluate
    from common.models import load_best_model

    model, _ = load_best_model(run / "best")
    test_set = build_digits()[1]
    batches = [{"image": test_set.images[i:i + 64], "label": test_set.labels[i:i + 64],
                "index": torch.arange(len(test_set))[i:i + 64]} for i in range(0, len(test_set), 64)]
    scored = {tta: evaluate(model, batches, SimpleNamespace(num_processes=1), tta=tta, transform=partial(
        preprocess, normalize=(meta["mean"], meta["std"]))) for tta in ("none", "flip", "flip_translate")}
    alone = {tta: scored[tta]["accuracy"] for tta in scored}
    changed = scored["flip_translate"]["tta_vs_plain"]  # the images it turned, each way
    assert changed["gained"] - changed["lost"] == round(450 * (alone["flip_translate"] - alone["none"]))
    assert changed["lost"] > 0 and scored["none"]["tta_vs_plain"] == {"gained": 0, "lost": 0}
    best = metrics[meta["epoch"] - 1]
    by_tta = best["val_accuracy_by_tta"]
    assert list(by_tta) == ["none", "flip", "flip_translate"] and by_tta == pytest.approx(alone, abs=1e-6)
    assert by_tta["flip_translate"] == best["val_accuracy"] == meta["value"] and meta["value_by_tta"] == by_tta
    assert [float(value) for value in said.groups()] == pytest.approx(
        [100 * metrics[-1]["val_accuracy_by_tta"][step] for step in ("flip_translate", "none", "flip")],
        abs=0.006), result.output
    again = script("evaluate.py", "--model_dir", run / "best", "--tta", "flip_translate", "--mixed_precision", "no",
                   "--output_dir", tmp_path / "evaluation")
    assert again.returncode == 0, again.output
    assert (f"accuracy {100 * meta['value']:.2f}% (without TTA {100 * by_tta['none']:.2f}%, flip alone "
            f"{100 * by_tta['flip']:.2f}%)") in again.output, again.output
    expected = rows(run / "best" / "val_predictions.csv")
    assert [r["prediction"] for r in rows(tmp_path / "evaluation" / "predictions.csv")] == [
        r["prediction"] for r in expected]

    from test_predict import write_test_pngs

    (tmp_path / "images").mkdir()
    write_test_pngs(tmp_path / "images")
    predicted = script("predict.py", "--model_dir", run / "best", "--tta", "flip_translate", "--mixed_precision",
                       "no", "--output", tmp_path / "out.csv", tmp_path / "images")
    assert predicted.returncode == 0 and "predicted 450 images (flip + translate TTA)" in predicted.output
    assert [r["class_1"] for r in rows(tmp_path / "out.csv")] == [r["prediction"] for r in expected]
    assert np.allclose([float(r["probability_1"]) for r in rows(tmp_path / "out.csv")],
                       [float(r["probability"]) for r in expected], atol=2e-6)


def test_a_folder_with_fewer_classes_is_matched_by_name_and_an_unknown_class_is_refused(tmp_path, seedlings):
    classes = sorted(p.name for p in seedlings.iterdir() if p.is_dir())  # not the image check records
    best = write_model(tmp_path / "best", "resnet18", classes, dataset="folder", image_size=(48, 48),
                       normalize=(SEEDLING_MEAN, SEEDLING_STD))
    subset = tmp_path / "test"
    for name in (classes[3], classes[7]):  # labels 0 and 1 of the subset, 3 and 7 of the model
        shutil.copytree(seedlings / name, subset / name)
    result = script("evaluate.py", "--model_dir", best, "--data_dir", subset, "--output_dir", tmp_path / "out",
                    "--num_workers", 0)
    assert result.returncode == 0, result.output
    written = rows(tmp_path / "out" / "predictions.csv")
    assert [(r["file"].split("/")[-2], r["label"]) for r in written] == [(r["label"], r["label"]) for r in written]
    assert {r["label"] for r in written} == {classes[3], classes[7]} and len(written) == 14
    report = json.loads((tmp_path / "out" / "classification_report.json").read_text())
    assert report[classes[3]]["support"] == 7 and report[classes[0]]["support"] == 0

    shutil.copytree(seedlings / classes[0], subset / "Dandelion")
    unknown = script("evaluate.py", "--model_dir", best, "--data_dir", subset, "--output_dir", tmp_path / "out2")
    assert unknown.returncode == 2 and "Traceback" not in unknown.output, unknown.output
    assert f"{subset} has classes the model does not know: Dandelion" in unknown.output
    assert not (tmp_path / "out2" / "predictions.csv").exists()

    tree = tmp_path / "tree"  # DIR/<split>/<class>/<image>, asked for a split it does not have
    for split in ("train", "val"):
        shutil.copytree(subset / classes[3], tree / split / classes[3])
    message = refused("evaluate.py", "--model_dir", best, "--data_dir", tree, "--split", "validation")
    assert message.strip() == (f"error: no split 'validation' in {tree} (there are: train, val): pass --split train or "
                               "--split val")
    assert script("evaluate.py", "--model_dir", best, "--data_dir", tree, "--split", "val", "--output_dir",
                  tmp_path / "out3", "--num_workers", 0).returncode == 0
    assert len(rows(tmp_path / "out3" / "predictions.csv")) == 7


def test_val_fraction_chooses_best_on_validation_and_scores_the_test_set_once_as_evaluate_does(tmp_path):
    output_dir = tmp_path / "run"
    result = launch_warm(REPO / "scripts" / "train_mnist.py", "--dataset", "digits", "--epochs", 3,
                         "--val_fraction", 0.2, "--output_dir", output_dir)
    assert result.returncode == 0, result.output
    assert "digits: 1077 train / 270 validation images / 450 test," in result.output
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["val_samples"] for record in records] == [270] * 3  # best/ is chosen on validation ...
    # 1077 // 128: 8 steps of 2 processes x 64 an epoch
    assert all(record["train_unique_samples"] == record["train_samples"] == 8 * 128 for record in records)
    # each line's time after the launch: later than the line before by at least the epoch (its training and evaluation)
    clock = [record["since_launch_s"] for record in records]
    assert 0 < records[0]["epoch_time_s"] < clock[0]
    assert all(later - earlier >= record["epoch_time_s"] > record["train_time_s"] > 0
               for earlier, later, record in zip(clock, clock[1:], records[1:]))
    tested = rows(output_dir / "test" / "predictions.csv")  # ... and the test set scored once, with best/
    assert [int(row["index"]) for row in tested] == list(range(450))
    accuracy = np.mean([row["label"] == row["prediction"] for row in tested])
    assert f"test: 450 images, accuracy {100 * accuracy:.2f}%" in result.output
    again = script("evaluate.py", "--model_dir", output_dir)  # the same code, later, on the same best/
    assert again.returncode == 0, again.output
    assert rows(output_dir / "evaluation" / "predictions.csv") == tested

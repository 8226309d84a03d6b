"""Hugging Face datasets in (`--data_dir hf:...`): built here, offline, from the real images of the folder tests,
as `save_to_disk` folders and parquet files; trained on as their folders are, with the same outcome."""

import csv
import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.errors import UserError
from common.folders import find_splits
from common.hf import hf_options
from common.images import list_image_folder
from conftest import (REPO, assert_report_shows, assert_same_outcome, launch_warm, read_run, script,
                      stop_inside_an_epoch)

SCRIPTS = REPO / "scripts"


def hf_dataset(splits, *, image="img", label="species", classes=None, label_names=None):
    """A datasets.DatasetDict of {split: (files, labels)}: the files' bytes in an Image column, the labels in a
    ClassLabel column of `classes` (or, with `label_names`, strings: label_names[label])."""
    import datasets

    features = datasets.Features({image: datasets.Image(), label: datasets.Value("string") if label_names else
                                  datasets.ClassLabel(names=classes)})
    return datasets.DatasetDict({name: datasets.Dataset.from_dict(
        {image: [{"bytes": Path(f).read_bytes(), "path": Path(f).name} for f in files],
         label: [label_names[i] for i in labels] if label_names else list(labels)}, features=features)
        for name, (files, labels) in splits.items()})


def folder_splits(root, names):
    """{name: (files, labels)} of root/<name>/<class>/<image> and the classes."""
    listed = {name: list_image_folder(root / folder) for name, folder in names.items()}
    classes = next(iter(listed.values()))[2]
    return {name: (files, labels) for name, (files, labels, _, _) in listed.items()}, classes


@pytest.mark.slow
def test_seedlings_as_a_saved_hf_dataset_train_on_two_processes_as_their_folders_and_evaluate(tmp_path, seedlings):
    """The same images in the same order: the same batches, weights, accuracy, each validation image once."""
    split = tmp_path / "split"
    assert script("split_dataset.py", seedlings, split).returncode == 0
    splits, classes = folder_splits(split, {"train": "train", "validation": "val"})
    hf_dataset(splits, classes=classes).save_to_disk(tmp_path / "hf")
    common = ["--model", "test_resnet", "--image_size", 32, "--epochs", 2, "--batch_size", 4]
    folder = launch_warm(SCRIPTS / "train_seedlings.py", "--data_dir", split, "--output_dir", tmp_path / "folder",
                         *common)
    assert folder.returncode == 0, folder.output
    hf = launch_warm(SCRIPTS / "train_seedlings.py", "--data_dir", f"hf:{tmp_path / 'hf'}", "--output_dir",
                     tmp_path / "run", *common)
    assert hf.returncode == 0, hf.output
    assert (f"hf:{tmp_path / 'hf'}: split 'train' trains; 'validation' validates (the first of validation, valid, "
            "val, test it has; --val_split chooses another); images from column 'img', labels from 'species': 12 "
            "classes, 59 train / 26 val images") in hf.output
    assert "2 process(es)" in hf.output and "decode cache on" in hf.output
    assert_same_outcome(tmp_path / "run", tmp_path / "folder", checkpoint="checkpoints/epoch_002_end", rel=1e-6)
    metrics, report = read_run(tmp_path / "run")
    assert [report[name]["support"] for name in classes] == np.bincount(splits["validation"][1]).tolist()
    assert all(record["val_samples"] == 26 for record in metrics)
    assert json.loads((tmp_path / "run" / "best" / "meta.json").read_text())["class_names"] == classes
    # the report names each validation row once, with the file name the dataset kept, and shows its images
    losses = list(csv.DictReader(open(tmp_path / "run" / "losses.csv")))
    rows = sorted(int(re.fullmatch(rf"hf:{re.escape(str(tmp_path / 'hf'))}\[validation\]\[(\d+)\] \(.+\.png\)",
                                   row["file"])[1]) for row in losses)
    assert rows == list(range(26))
    assert_report_shows(tmp_path / "run" / "report.html", classes=12, top_losses=24,
                        label_issues=min(24, len(list(csv.DictReader(open(tmp_path / "run" / "label_issues.csv"))))))

    # evaluate.py on the validation split, on 2 processes: best/'s own validation accuracy, every image once
    evaluated = launch_warm(SCRIPTS / "evaluate.py", "--model_dir", tmp_path / "run", "--data_dir",
                            f"hf:{tmp_path / 'hf'}", "--split", "validation", "--output_dir", tmp_path / "eval")
    assert evaluated.returncode == 0, evaluated.output
    scores = json.loads((tmp_path / "eval" / "classification_report.json").read_text())
    assert scores["macro avg"]["support"] == 26
    assert scores["accuracy"] == pytest.approx(max(record["val_accuracy"] for record in metrics), abs=1e-6)

    # evaluate.py --split val on the class folders the split came from (no val/ there): the folder run's validation
    # images (split_dataset.py splits as a run splits here), not all 85 under the name "val"
    flat = script("evaluate.py", "--model_dir", tmp_path / "folder", "--data_dir", seedlings, "--split", "val",
                  "--output_dir", tmp_path / "eval-val", "--num_workers", 0)
    assert flat.returncode == 0, flat.output
    assert (f"{seedlings} has no val/ folder: scoring its val share as the training run's --val_fraction 0.3 and "
            "--seed 42 split a folder (stratified), 26 images") in flat.output
    scored = sorted(Path(row["file"]).name for row in csv.DictReader(open(tmp_path / "eval-val" / "predictions.csv")))
    assert scored == sorted(path.name for path in (split / "val").rglob("*.png"))
    folder_metrics, _ = read_run(tmp_path / "folder")
    assert json.loads((tmp_path / "eval-val" / "classification_report.json").read_text())["accuracy"] == (
        pytest.approx(max(record["val_accuracy"] for record in folder_metrics), abs=1e-6))
    assert script("evaluate.py", "--model_dir", tmp_path / "folder", "--data_dir", seedlings, "--split", "train",
                  "--output_dir", tmp_path / "eval-train", "--num_workers", 0).returncode == 0  # 59, its record kept
    whole = script("evaluate.py", "--model_dir", tmp_path / "folder", "--data_dir", seedlings, "--output_dir",
                   tmp_path / "eval-all", "--num_workers", 0)
    assert whole.returncode == 0, whole.output
    assert f"{seedlings} has no test/ folder: scoring all its 85 images" in whole.output
    assert "its training images are among those scored; --split val scores only the ones it held out" in whole.output


@pytest.mark.slow
def test_a_streamed_split_on_two_processes_stopped_by_sigterm_goes_on_where_each_stream_stopped(tmp_path, seedlings):
    """--streaming: 64 training images in 4 parquet shards (2 whole shards a process), shuffled through a buffer of 8.
    Stopped by SIGTERM inside epoch 2 and resumed, the run ends as the uninterrupted one, and every epoch read each
    training image once; a resume on another process count is refused, losing nothing."""
    files, labels, classes, _ = list_image_folder(seedlings)
    splits = hf_dataset({"train": (files[:64], labels[:64]), "validation": (files[64:], labels[64:])}, classes=classes)
    (tmp_path / "hf" / "data").mkdir(parents=True)
    for shard in range(4):
        splits["train"].shard(4, shard, contiguous=True).to_parquet(
            tmp_path / "hf" / "data" / f"train-{shard:05d}-of-00004.parquet")
    splits["validation"].to_parquet(tmp_path / "hf" / "data" / "validation-00000-of-00001.parquet")
    command = [SCRIPTS / "train_seedlings.py", "--data_dir", f"hf:{tmp_path / 'hf'}", "--streaming", "--shuffle_buffer",
               8, "--model", "test_resnet", "--image_size", 32, "--epochs", 3, "--batch_size", 4, "--mixup_prob", 1.0]
    reference = launch_warm(*command, "--output_dir", tmp_path / "reference")
    assert reference.returncode == 0, reference.output
    assert (f"hf:{tmp_path / 'hf'}: split 'train' streamed (64 examples), 'validation' validates; images from column "
            "'img', labels from 'species': 12 classes, 64 train / 21 val images, 24 optimizer steps") in reference.output
    assert "each process shuffles its share among 8 examples (--shuffle_buffer)" in reference.output

    output_dir = tmp_path / "run"
    command += ["--output_dir", output_dir, "--checkpoint_every", 1]  # a SIGTERM is obeyed at the next step
    latest = stop_inside_an_epoch(command, output_dir=output_dir, log=tmp_path / "log")
    state = json.loads((output_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert len(state["stream"]["read"]) == 2 and all(read > 0 for read in state["stream"]["read"])

    one = script(command[0].name, *command[1:], "--resume", "latest")
    assert one.returncode == 2, one.output
    assert (f"this checkpoint stopped inside epoch {state['epoch']} of a stream read by 2 process(es), and each one's "
            "share of a stream depends on their number: resume it on 2 process(es)") in one.output
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == latest

    resumed = launch_warm(*command, "--resume", "latest")
    assert resumed.returncode == 0, resumed.output
    assert_same_outcome(output_dir, tmp_path / "reference", checkpoint="checkpoints/epoch_003_end", rel=1e-6)
    for run in (output_dir, tmp_path / "reference"):
        metrics, report = read_run(run)
        assert [(record["train_samples"], record["train_unique_samples"]) for record in metrics] == [(64, 64)] * 3
        assert all(record["train_samples_per_process"] == [32, 32] and record["val_samples"] == 21
                   for record in metrics)
        assert report["macro avg"]["support"] == 21


@pytest.mark.slow
def test_fashion_mnist_as_parquet_files_through_train_mnist_as_its_idx_files(tmp_path, fashion_subset):
    """Parquet files named as on the Hub (data/train-00000-of-00001.parquet): splits found by their names, the
    28x28 grayscale PNGs decoded back to the IDX files' very pixels."""
    from PIL import Image

    from common.mnist import FASHION_MNIST_CLASSES, build_mnist

    train, test = build_mnist(fashion_subset, name="fashion_mnist")
    (tmp_path / "pngs").mkdir()
    splits = {}
    for name, dataset in (("train", train), ("test", test)):
        files = []
        for i, image in enumerate(dataset.images[:, 0].numpy()):
            files.append(tmp_path / "pngs" / f"{name}{i:05d}.png")
            Image.fromarray(image).save(files[-1])
        splits[name] = (files, dataset.labels.tolist())
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for name, dataset in hf_dataset(splits, image="image", label="label", classes=FASHION_MNIST_CLASSES).items():
        dataset.to_parquet(tmp_path / "hub" / "data" / f"{name}-00000-of-00001.parquet")
    common = ["--dataset", "fashion_mnist", "--epochs", 1, "--batch_size", 64]
    idx = launch_warm(SCRIPTS / "train_mnist.py", "--data_dir", fashion_subset, "--output_dir", tmp_path / "idx",
                      *common)
    assert idx.returncode == 0, idx.output
    hf = launch_warm(SCRIPTS / "train_mnist.py", "--data_dir", f"hf:{tmp_path / 'hub'}", "--output_dir",
                     tmp_path / "run", *common)
    assert hf.returncode == 0, hf.output
    assert (f"hf:{tmp_path / 'hub'}: split 'train' trains; 'test' validates (the first of validation, valid, val, test "
            "it has; --val_split chooses another); images from column 'image', labels from 'label': 2001 train / "
            "1001 test images") in hf.output
    assert "checked 2001 images on 2 process(es) (1001 + 1000)" in hf.output  # decoded by both, each its share
    assert_same_outcome(tmp_path / "run", tmp_path / "idx", checkpoint="checkpoints/epoch_001_end", rel=1e-6)
    # evaluate.py decodes the split it is named as training decoded it: best/'s own accuracy
    evaluated = script("evaluate.py", "--model_dir", tmp_path / "run", "--data_dir", f"hf:{tmp_path / 'hub'}", "--split",
                       "test", "--output_dir", tmp_path / "eval")
    assert evaluated.returncode == 0, evaluated.output
    scores = json.loads((tmp_path / "eval" / "classification_report.json").read_text())
    assert scores["macro avg"]["support"] == 1001
    assert scores["accuracy"] == pytest.approx(read_run(tmp_path / "run")[0][-1]["val_accuracy"], abs=1e-6)


@pytest.mark.slow
def test_one_split_of_parquet_with_string_labels_and_named_columns_is_split_as_a_folder(tmp_path, seedlings):
    """hf:parquet:GLOB, a training split alone, labels as strings in a column the flags name, next to a second
    Image column: split here as the folder would be (--val_fraction, stratified, seeded), classes sorted."""
    import datasets

    files, labels, classes, _ = list_image_folder(seedlings)
    names = [name.upper() for name in classes]  # other strings, in the same sorted order
    dataset = hf_dataset({"train": (files, labels)}, image="photo", label="plant", label_names=names)["train"]
    dataset = dataset.add_column("mask", [{"bytes": Path(files[0]).read_bytes(), "path": None}] * len(files),
                                 feature=datasets.Image())
    (tmp_path / "parquet").mkdir()
    dataset.shard(2, 0, contiguous=True).to_parquet(tmp_path / "parquet" / "part-0.parquet")
    dataset.shard(2, 1, contiguous=True).to_parquet(tmp_path / "parquet" / "part-1.parquet")
    data_dir = f"hf:parquet:{tmp_path / 'parquet' / '*.parquet'}"
    command = [SCRIPTS / "train_seedlings.py", "--data_dir", data_dir, "--output_dir", tmp_path / "run", "--model",
               "test_resnet", "--image_size", 32, "--epochs", 1, "--batch_size", 4, "--no-find_label_issues"]
    refused = script(command[0].name, *command[1:])
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output
    assert (f"error: {data_dir} split 'train' has more than one Image column (photo (Image), plant (Value), mask "
            "(Image)): name the images with --image_column") in refused.output
    result = script(command[0].name, *command[1:], "--image_column", "photo", "--label_column", "plant")
    assert result.returncode == 0, result.output
    assert (f"{data_dir}: split 'train' trains; no validation / valid / val / test split: 26 of its images validate "
            "(--val_fraction 0.3, stratified, --seed); images from column 'photo', labels from 'plant' (12 classes: "
            "its values, sorted): 12 classes, 59 train / 26 val images") in result.output
    assert json.loads((tmp_path / "run" / "best" / "meta.json").read_text())["class_names"] == names
    folder_train, folder_val, _, _ = find_splits(seedlings, val_fraction=0.3, seed=42)
    hf_train, hf_val, _, _ = find_splits(data_dir, val_fraction=0.3, seed=42,
                                         hf_options={"image_column": "photo", "label_column": "plant"})
    assert hf_val["labels"] == folder_val["labels"] and hf_train["labels"] == folder_train["labels"]
    assert [str(image).rsplit(" (", 1)[1][:-1] for image in hf_val["files"]] == [f.name for f in folder_val["files"]]


# ---- mistakes: one message naming the thing and the fix ----

def test_each_mistake_in_a_hf_dataset_is_one_message_naming_what_there_is(tmp_path, seedlings):
    import datasets

    files, labels, classes, _ = list_image_folder(seedlings)
    saved = tmp_path / "saved"
    hf_dataset({"train": (files, labels), "test": (files[:10], labels[:10])}, classes=classes).save_to_disk(saved)

    def refused(data_dir, match, **options):
        with pytest.raises(UserError, match=match):
            find_splits(data_dir, val_fraction=0.3, seed=42, hf_options=options)

    refused(f"hf:{saved}", r"has no split 'training'; its splits: 'train', 'test'\. Choose one with --train_split",
            train_split="training")
    refused(f"hf:{saved}", r"has no split 'dev'; its splits: 'train', 'test'\. Choose one with --val_split",
            val_split="dev")
    # a typed --val_fraction where a split validates would be ignored: refused, as for train/ and val/ folders
    with pytest.raises(UserError, match=r"^--val_fraction 0\.2 splits the training split of a dataset without "
                                        r"a held-out one, and hf:.*saved has 'test', which validates: drop "
                                        r"--val_fraction$"):
        find_splits(f"hf:{saved}", val_fraction=0.2, seed=42, fraction_typed=True)
    streamed = script("train_seedlings.py", "--data_dir", f"hf:{saved}", "--streaming", "--val_fraction", 0.2,
                      "--output_dir", tmp_path / "run")
    assert streamed.returncode == 2 and not (tmp_path / "run").exists(), streamed.output
    assert ("error: --val_fraction 0.2 cannot be used with --streaming: a stream is not split here, its held-out "
            "split validates (--val_split names it); drop --val_fraction") in streamed.output
    refused(f"hf:{saved}", r"split 'train' has no column 'image' \(--image_column\); its columns: img \(Image\), "
                           r"species \(ClassLabel\)", image_column="image")
    refused(f"hf:{saved}", r"--image_column and --label_column are both 'img'", label_column="img")
    noted = hf_dataset({"train": (files[:12], labels[:12])}, classes=classes)
    noted["train"] = noted["train"].add_column("note", ["a photo"] * 12)
    noted.save_to_disk(tmp_path / "noted")  # a text column named as the images: said once, not a missing file each
    refused(f"hf:{tmp_path / 'noted'}", r"split 'train' column 'note' \(--image_column\) holds text that names no "
                                        r"file \('a photo' in its first row\), not images", image_column="note")
    for options in ({"val_split": "train"}, {"train_split": "test", "val_split": "test"}):
        refused(f"hf:{saved}", rf"--val_split '{options['val_split']}' is the split that trains \(--train_split\): "
                               r"the run would score, and choose best/ on, the images it learns from", **options)
    refused(f"hf:{saved}", r"split 'train' column 'species' \(--image_column\) holds ClassLabel\(.*\), not images "
                           r"\(an Image feature, encoded bytes or file paths\)", image_column="species", label_column="img")
    refused("hf:nobody/no-such-dataset", r"cannot load hf:nobody/no-such-dataset, read as a dataset name on the Hub "
                                         r"\(offline: HF_HUB_OFFLINE=1, from the local cache only\) \(data files of "
                                         r"one format are hf:parquet:GLOB, .*\): \S")
    # not offline, but the Hub out of reach (a compute node without internet): the cache only, at once, not after
    # datasets' 5 retries (23 s, a line each)
    import huggingface_hub

    with pytest.MonkeyPatch.context() as patch:
        for module in (datasets.config, huggingface_hub.constants):
            patch.setattr(module, "HF_HUB_OFFLINE", False)
        for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                     "all_proxy"):  # a proxy between: datasets is left to find out
            patch.delenv(name, raising=False)
        patch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
        started = time.monotonic()
        refused("hf:nobody/no-such-dataset", r"read as a dataset name on the Hub \(the Hub is out of reach here, "
                                             r"127\.0\.0\.1:9 Connection refused: from the local cache only\. Without "
                                             r"internet, save the dataset with datasets' save_to_disk on a machine "
                                             r"that has it and pass hf:FOLDER\)")
        assert time.monotonic() - started < 5 and os.environ["HF_HUB_OFFLINE"] == "1"
        assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
        for module in (datasets.config, huggingface_hub.constants):  # online again
            patch.setattr(module, "HF_HUB_OFFLINE", False)
        patch.setattr(huggingface_hub.constants, "ENDPOINT", "huggingface.co")  # HF_ENDPOINT without its https://
        refused("hf:nobody/no-such-dataset", r"\(the Hub is out of reach here, HF_ENDPOINT='huggingface\.co' is not a "
                                             r"URL such as https://huggingface\.co: from the local cache only\.")
    refused(f"hf:parquet:{tmp_path / 'none' / '*.parquet'}", r"cannot load hf:parquet:.*, read as parquet files "
                                                              r"matching '.*none/\*\.parquet': \S")
    # every script's flags are read through hf_options, which refuses them for a folder
    with pytest.raises(UserError, match=r"--label_column chooses what to read of a Hugging Face dataset, "
                                        r"and --data_dir .* is a folder"):
        hf_options(SimpleNamespace(data_dir=seedlings, label_column="species", image_column=None))
    with pytest.raises(UserError, match=r"--label_column chooses .*, and no --data_dir names one: drop "
                                        r"--label_column, or pass --data_dir hf:NAME_OR_PATH"):
        hf_options(SimpleNamespace(data_dir=None, label_column="species"))  # evaluate.py on the digits
    with pytest.raises(UserError, match=r"^--label_column and --streaming choose what to read of a Hugging Face "
                                        r"dataset, and --data_dir .* is a folder: drop --label_column and "
                                        r"--streaming, or pass --data_dir hf:NAME_OR_PATH$"):
        hf_options(SimpleNamespace(data_dir=seedlings, label_column="species", streaming=True))

    def saved_with(name, columns, features):
        path = tmp_path / name
        datasets.Dataset.from_dict(columns, features=datasets.Features(features)).save_to_disk(path)
        return f"hf:{path}"

    image = {"bytes": Path(files[0]).read_bytes(), "path": None}
    floats = saved_with("floats", {"img": [image] * 4, "score": [0.5, 1.5, 0.5, 1.5]},
                        {"img": datasets.Image(), "score": datasets.Value("float32")})
    refused(floats, r"split 'train' has no ClassLabel column \(img \(Image\), score \(Value\)\): name the labels "
                    r"with --label_column")
    refused(floats, r"column 'score' row 0 is 0\.5 \(float\): labels must be class names \(strings\) or integers",
            label_column="score")
    missing = saved_with("missing", {"img": [image] * 4, "name": ["a", None, "b", "a"]},
                         {"img": datasets.Image(), "name": datasets.Value("string")})
    refused(missing, r"column 'name' row 1 is empty", label_column="name")
    unlabelled = saved_with("unlabelled", {"img": [image] * 4, "lab": [0, -1, 1, 0]},
                            {"img": datasets.Image(), "lab": datasets.ClassLabel(names=["a", "b"])})
    refused(unlabelled, r"column 'lab' row 1 has no label \(-1\): remove the unlabelled rows")
    one = saved_with("one", {"img": [image] * 4, "name": ["a"] * 4},
                     {"img": datasets.Image(), "name": datasets.Value("string")})
    refused(one, r"column 'name' has one class: a classifier needs at least 2 classes", label_column="name")
    (tmp_path / "empty" / "data").mkdir(parents=True)  # save_to_disk writes an empty split that it cannot read
    for name, split in hf_dataset({"train": (files, labels), "validation": ([], [])}, classes=classes).items():
        split.to_parquet(tmp_path / "empty" / "data" / f"{name}-00000-of-00001.parquet")
    refused(f"hf:{tmp_path / 'empty'}", r"cannot load hf:.*empty, read as the folder of data files .*empty: "
                                        r"Instruction \"validation\" corresponds to no data")
    hf_dataset({"train": (files[:8], [0, 1] * 4), "validation": (files[:2], [0, 2])}, label="name",
               label_names=["a", "b", "c"]).save_to_disk(tmp_path / "unseen")
    refused(f"hf:{tmp_path / 'unseen'}", r"split 'validation' row 1 has label 'c', which the training split does not "
                                         r"have \(its classes: a, b\)", label_column="name")

    # a folder of data files with two configurations (README.md's `configs:`, as on the Hub): --dataset_config
    configs = tmp_path / "configs"
    for config, parts in {"small": {"train": 8, "validation": 4}, "big": {"train": 20, "test": 6}}.items():
        (configs / config).mkdir(parents=True)
        for name, count in parts.items():
            hf_dataset({name: (files[:count], labels[:count])}, classes=classes)[name].to_parquet(
                configs / config / f"{name}.parquet")
    (configs / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {config}\n  data_files:\n" + "".join(f"  - split: {name}\n    path: {config}/{name}.parquet\n"
                                                             for name in parts)
        for config, parts in {"small": ("train", "validation"), "big": ("train", "test")}.items()) + "---\n")
    refused(f"hf:{configs}", r"hf:.*configs has the configurations 'small', 'big': choose one with --dataset_config NAME")
    refused(f"hf:{configs}", r"has the configurations 'small', 'big', not 'tiny': choose one with --dataset_config",
            dataset_config="tiny")
    refused(f"hf:{saved}", r"--dataset_config chooses one of the configurations of a dataset on the Hub or of a folder "
                           r"of data files; hf:.*saved is a folder written by save_to_disk, which has none: drop "
                           r"--dataset_config small", dataset_config="small")
    for config, sizes in {"small": (8, 4), "big": (20, 6)}.items():
        train, val, _, _ = find_splits(f"hf:{configs}", val_fraction=0.3, seed=42,
                                       hf_options={"dataset_config": config})
        assert (len(train["files"]), len(val["files"])) == sizes
        assert f"(configuration {config!r})" in train["source"]
    result = script("compute_mean_std.py", f"hf:{configs}", "--dataset_config", "big", "--split", "test", "--output",
                    tmp_path / "mean_std.json")
    assert result.returncode == 0, result.output
    assert len(json.loads((tmp_path / "mean_std.json").read_text())["mean"]) == 3

    from common.cifar import build_cifar10

    only_train = tmp_path / "only_train"
    hf_dataset({"train": (files, labels)}, classes=classes).save_to_disk(only_train)
    train, val, _, _ = find_splits(f"hf:{only_train}", val_fraction=0.2, seed=42, fraction_typed=True)  # split here
    assert len(train["files"]) + len(val["files"]) == len(files) and len(val["files"]) == round(0.2 * len(files))
    with pytest.raises(UserError, match=r"has no held-out split \(validation, valid, val, test\); its splits: "
                                        r"'train'\. Name the one to score with --val_split"):
        build_cifar10(f"hf:{only_train}")


def test_a_corrupt_image_in_a_hf_dataset_is_named_by_its_row_and_file(tmp_path, seedlings):
    """The bad-image rules of files: stopped with its name, or left out with --skip_bad_images."""
    from common.folders import build_folder_dataset

    files, labels, classes, _ = list_image_folder(seedlings)
    broken = tmp_path / "broken.png"
    broken.write_bytes(Path(files[5]).read_bytes()[:300])
    files = [*files[:5], broken, *files[6:]]
    hf_dataset({"train": (files, labels)}, classes=classes).save_to_disk(tmp_path / "hf")
    train, val, _, _ = find_splits(f"hf:{tmp_path / 'hf'}", val_fraction=0.3, seed=42)
    split = train if any("broken.png" in str(image) for image in train["files"]) else val
    with pytest.raises(UserError, match=rf"cannot read image hf:{re.escape(str(tmp_path / 'hf'))}\[train\]\[5\] "
                                        r"\(broken\.png\): .*--skip_bad_images"):
        build_folder_dataset(split, transform=torch.nn.Identity(), skip_bad_images=False)
    kept = build_folder_dataset(split, transform=torch.nn.Identity(), skip_bad_images=True)
    assert len(kept) == len(split["files"]) - 1 and "broken.png" in str(kept.left_out[0])

    # streamed (--streaming): met while training, so named by its file and place in the stream
    from common.hf import find_hf_stream
    from common.streaming import StreamedBatches

    hf_dataset({"train": (files, labels), "validation": (files[:4], labels[:4])},
               classes=classes).save_to_disk(tmp_path / "streamed")
    train, _, _ = find_hf_stream(f"hf:{tmp_path / 'streamed'}")
    one = SimpleNamespace(process_index=0, num_processes=1, gradient_accumulation_steps=1, device="cpu",
                          gather=lambda tensor: tensor, print=print)

    def stream(skip_bad_images):
        return StreamedBatches(train, batch_size=4, seed=42, accelerator=one, reading={
            "size": {"resize": 32, "center_crop": 32}, "shuffle_buffer": 8, "skip_bad_images": skip_bad_images})

    with pytest.raises(UserError, match=rf"cannot read image hf:{re.escape(str(tmp_path / 'streamed'))}\[train\] "
                                        r"broken\.png \(example \d+ as read\): .*--skip_bad_images"):
        list(stream(False))
    skipping = stream(True)
    batches = list(skipping)
    assert len(batches) == 21 and all(batch["image"].shape == (4, 3, 32, 32) for batch in batches)  # 84 good of 85
    assert len({index for batch in batches for index in batch["index"].tolist()}) == 84
    assert len(skipping.left_out) == 1 and "broken.png" in skipping.left_out[0]

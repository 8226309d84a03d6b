"""Plant Seedlings: the folder datasets, the split and mean/std tools, bad input, and a real 2-process run."""

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from common.errors import UserError
from common.decode_cache import check_images
from common.folders import (build_file_dataloader, build_folder_dataset, build_train_transform, choose_cache,
                            find_splits, training_cache)
from common.images import build_eval_transform, list_image_folder, read_image, split_dataset
from common.models import build_model, load_pretrained
from conftest import (ACROSS_COUNTS, FIXTURES, REPO, assert_report_shows, assert_same_outcome,
                      launch_command, launch_warm, read_run, script, spawn, stop_inside_an_epoch, wait_for)

SCRIPTS = REPO / "scripts"


def test_split_is_stratified_deterministic_and_loses_nothing(seedlings):
    _, labels, classes, _ = list_image_folder(seedlings)
    train, val = split_dataset(labels, val_fraction=0.3, seed=42)
    assert (train, val) == split_dataset(labels, val_fraction=0.3, seed=42)
    assert (train, val) != split_dataset(labels, val_fraction=0.3, seed=1)
    assert sorted(train + val) == list(range(len(labels))) and not set(train) & set(val)
    per_class, val_per_class = Counter(labels), Counter(labels[i] for i in val)
    assert all(abs(val_per_class[c] - 0.3 * per_class[c]) <= 1 for c in range(len(classes)))


def test_split_dataset_tool_writes_the_same_split_without_loss_or_duplicates(seedlings, tmp_path):
    target = tmp_path / "split"
    result = script("split_dataset.py", seedlings, target, "--link")
    assert result.returncode == 0, result.output
    assert "total" in result.output and "Black-grass" in result.output
    written = {split: sorted(p.relative_to(target / split) for p in (target / split).rglob("*.png"))
               for split in ("train", "val")}
    source = sorted(p.relative_to(seedlings) for p in seedlings.rglob("*.png"))
    assert sorted(written["train"] + written["val"]) == source  # every image once, in one split
    assert not set(written["train"]) & set(written["val"])
    # the training script's in-memory split of the root picks the same validation images
    _, val, _, _ = find_splits(seedlings, val_fraction=0.3, seed=42)
    assert sorted(p.relative_to(seedlings) for p in val["files"]) == written["val"]

    again = script("split_dataset.py", seedlings, target)
    assert again.returncode == 2 and "exists and is not empty" in again.output
    (tmp_path / "notes.txt").write_text("mine")
    onto_a_file = script("split_dataset.py", seedlings, tmp_path / "notes.txt")
    assert onto_a_file.returncode == 2 and (f"error: {tmp_path / 'notes.txt'} is a file: choose a new folder to write "
                                            "the split into") in onto_a_file.output, onto_a_file.output
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_compute_mean_std_is_exact(seedlings, tmp_path):
    result = script("compute_mean_std.py", seedlings, "--output", tmp_path / "stats.json")
    assert result.returncode == 0, result.output
    stats = json.loads((tmp_path / "stats.json").read_text())
    pixels = np.concatenate([np.asarray(Image.open(p).convert("RGB"), dtype=np.float64).reshape(-1, 3) / 255
                             for p in sorted(seedlings.rglob("*.png"))])
    assert stats["images"] == 85 and stats["pixels"] == len(pixels)
    assert np.allclose(stats["mean"], pixels.mean(0), atol=1e-6) and np.allclose(stats["std"], pixels.std(0), atol=1e-6)
    # a std of 0 (one colour everywhere), which training refuses, is not written; --split is for hf: datasets
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(tmp_path / "flat" / "a.png")
    flat = script("compute_mean_std.py", tmp_path / "flat", "--output", tmp_path / "flat.json")
    assert flat.returncode == 2 and ("error: channels R, G, B have one value in all 16 pixels of these 1 images (std "
                                     "0)") in flat.output and not (tmp_path / "flat.json").exists(), flat.output
    split = script("compute_mean_std.py", seedlings, "--split", "val", "--output", tmp_path / "val.json")
    assert split.returncode == 2 and (f"--split chooses a split of a Hugging Face dataset (hf:...), and {seedlings} is "
                                      f"a folder: pass the split's own folder instead, e.g. {seedlings / 'val'}"
                                      ) in split.output, split.output


def test_bad_folders_are_named(tmp_path, seedlings):
    with pytest.raises(UserError, match="has no class folders: expected .*png$"):
        list_image_folder(tmp_path)
    (tmp_path / "batches").mkdir()  # another script's data: named
    (tmp_path / "batches" / "data_batch_1").write_bytes(b"")
    with pytest.raises(UserError, match=r"\(it holds CIFAR-10's python batches, which scripts/train_cifar.py reads\)"):
        list_image_folder(tmp_path / "batches")
    shutil.rmtree(tmp_path / "batches")
    with pytest.raises(UserError, match="not found"):
        list_image_folder(tmp_path / "missing")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes((seedlings / "Maize").iterdir().__next__().read_bytes())
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "b").mkdir()
    with pytest.raises(UserError, match=r"class folder .*b has no images"):
        list_image_folder(tmp_path)
    (tmp_path / "b" / "y.png").write_bytes((tmp_path / "a" / "x.png").read_bytes())
    _, _, classes, skipped = list_image_folder(tmp_path)
    assert classes == ["a", "b"] and [p.name for p in skipped] == ["notes.txt"]

    split = tmp_path / "split"
    for part, names in (("train", ["a", "b"]), ("val", ["a", "c"])):
        for name in names:
            (split / part / name).mkdir(parents=True)
            (split / part / name / "x.png").write_bytes((tmp_path / "a" / "x.png").read_bytes())
    with pytest.raises(UserError, match=r"different class folders \(only in train: \['b'\]; only in val: \['c'\]\)"):
        find_splits(split, val_fraction=0.3, seed=42)
    shutil.rmtree(split / "val" / "c")
    shutil.copytree(split / "train" / "b", split / "val" / "b")
    assert find_splits(split, val_fraction=0.3, seed=42)[0]["source"] == str(split)
    shutil.copytree(split / "val", split / "test")  # read by no run: the first line says so, and what scores it
    assert find_splits(split, val_fraction=0.3, seed=42)[0]["source"] == (
        f"{split} (its test/ is not read in training: python scripts/evaluate.py --model_dir OUTPUT_DIR --data_dir "
        f"{split / 'test'} scores the trained model on it)")


def test_corrupt_and_truncated_images_are_named_or_skipped(tmp_path, seedlings):
    good = sorted((seedlings / "Maize").iterdir())[:2]
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good[0].read_bytes()[:2000])
    garbage = tmp_path / "garbage.png"
    garbage.write_text("not a png")
    with pytest.raises(UserError, match=r"cannot read image .*truncated.png: .*\(and 1 more\)\. .*--skip_bad_images"):
        check_images([*good, truncated, garbage], skip_bad_images=False)
    kept, bad, cache = check_images([*good, truncated, garbage], skip_bad_images=True,
                                   cache={"resize": 40, "center_crop": 40})
    assert kept == [0, 1] and [path for path, _ in bad] == [truncated, garbage]
    assert cache.shape == (4, 3, 40, 40) and cache.dtype == torch.uint8  # a row for each file, read with kept
    assert cache[kept].float().mean() > 10 and not cache[2:].any()
    # a class whose every image is unreadable is not left out, which would hide it from the run and its scores
    from common.folders import build_folder_dataset

    split = {"files": [*good, truncated, garbage], "labels": [0, 0, 1, 1], "classes": ["Maize", "Weed"],
             "name": "train", "root": tmp_path}
    with pytest.raises(UserError, match=rf"class Weed: none of its 2 train images can be read \(e\.g\. "
                                        rf"{re.escape(str(truncated))}: .*\), so --skip_bad_images would leave the class "
                                        "out of the run, which could neither learn nor score it"):
        build_folder_dataset(split, transform=None, skip_bad_images=True)
    split["labels"] = [0, 1, 0, 1]
    assert len(build_folder_dataset(split, transform=None, skip_bad_images=True)) == 2


def test_a_cache_half_written_by_a_killed_run_of_this_machine_is_removed_and_a_running_ones_is_kept(tmp_path,
                                                                                                      seedlings):
    files = sorted((seedlings / "Maize").iterdir())[:3]
    finished = subprocess.Popen(["true"])
    finished.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        left = {pid: tmp_path / f".checked-train-40px.npy.{socket.gethostname()}.{pid}.tmp.npy"
                for pid in (finished.pid, running.pid)}
        other_host = tmp_path / f".checked-train-40px.npy.another-host.{finished.pid}.tmp.npy"
        for path in (*left.values(), other_host):
            path.write_bytes(b"half")
        check_images(files, skip_bad_images=False, cache={"resize": 40, "center_crop": 40},
                     record=tmp_path / ".checked-train.json")
        assert (tmp_path / ".checked-train-40px.npy").exists()
        assert not left[finished.pid].exists()  # its process is gone
        assert left[running.pid].exists() and other_host.exists()  # may still be written
    finally:
        running.kill()
        running.wait()


def test_the_image_check_is_kept_with_a_fingerprint_and_redone_when_a_file_changes(tmp_path, seedlings):
    files = sorted((seedlings / "Maize").iterdir())[:3]
    garbage = tmp_path / "garbage.png"
    garbage.write_text("not a png")
    record = tmp_path / ".checked-train.json"
    first = check_images([*files, garbage], skip_bad_images=True, record=record)
    assert json.loads(record.read_text())["bad"] == [[str(garbage), first[1][0][1]]]
    garbage.write_bytes(files[0].read_bytes())  # repaired: another size and time, so checked again
    assert check_images([*files, garbage], skip_bad_images=True, record=record)[1] == []
    garbage.write_text("broken again")
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "bad": [["somewhere", "a record from another list"]]}))
    assert [path for path, _ in check_images([*files, garbage], skip_bad_images=True, record=record)[1]] == [garbage]
    record.write_text(json.dumps({**json.loads(record.read_text()), "bad": [[str(files[0]), "kept"]]}))
    assert check_images([*files, garbage], skip_bad_images=True, record=record)[0] == [1, 2, 3]  # read, not redone


def test_the_cache_without_per_image_work_is_read_in_whole_batches_of_the_good_rows(tmp_path, seedlings):
    """--cache_images without --auto_augment: batches are gathered from the mapped cache in the training process
    (no workers), each sample its own file's row, the unreadable file's row never served."""
    data = tmp_path / "data"
    for label in ("Maize", "Cleavers"):
        shutil.copytree(seedlings / label, data / label)
    shutil.copy(FIXTURES / "odd_images" / "truncated.png", data / "Maize" / "0_truncated.png")
    split = {"files": [*sorted((data / "Maize").iterdir()), *sorted((data / "Cleavers").iterdir())],
             "classes": ["Maize", "Cleavers"], "name": "train", "root": data}
    split["labels"] = [0 if path.parent.name == "Maize" else 1 for path in split["files"]]
    assert build_train_transform(32, geometry=False) is None  # nothing left to do per image
    dataset = build_folder_dataset(split, transform=None, skip_bad_images=True, cache=training_cache({"resize": 37}))
    assert [path.name for path in dataset.left_out] == ["0_truncated.png"] and len(dataset) == len(split["files"]) - 1
    loader = build_file_dataloader(dataset, batch_size=4, shuffle=True, num_workers=2)
    assert loader.num_workers == 0 and loader.collate_fn(["kept as it is"]) == ["kept as it is"]
    shrink = build_eval_transform({"resize": 37, "center_crop": 37})
    good = [path for path in split["files"] if path.name != "0_truncated.png"]
    seen = []
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 37, 37) and batch["image"].dtype == torch.uint8
        for index, image, label in zip(batch["index"].tolist(), batch["image"], batch["label"].tolist()):
            assert torch.equal(image, shrink(read_image(good[index]))) and label == (good[index].parent.name == "Cleavers")
            seen.append(index)
    assert sorted(seen) == list(range(len(good)))
    # the evaluation cache holds each image as evaluation sees it: resized and center-cropped once, at decode time
    spec = {"resize": 37, "center_crop": [32, 32]}
    evaluation = build_folder_dataset(split, transform=None, skip_bad_images=True, cache=spec)
    assert (data / ".checked-train-37to32px.npy").exists() and (data / ".checked-train-37px.npy").exists()
    batch = evaluation.__getitems__(list(range(len(good))))
    assert all(torch.equal(image, build_eval_transform(spec)(read_image(path)))
               for image, path in zip(batch["image"], good))


def test_the_decode_cache_is_the_default_where_the_decoded_images_fit_in_4_gb():
    """A function of the data alone (never of this machine's memory): a resumed run chooses as the first did."""
    assert choose_cache(None, images=3319, size=73) == (True, "53.1 MB decoded, within the default's 4 GB")
    assert choose_cache(None, images=1_281_167, size=256) == (False, "251.9 GB decoded, over the default's 4 GB")
    assert choose_cache(True, images=1_281_167, size=256) == (True, "--cache_images")
    assert choose_cache(False, images=10, size=32) == (False, "--no-cache_images")


@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True], ids=["files", "cache_images"])
def test_two_processes_check_their_own_shares_agree_on_the_bad_ones_and_a_second_run_reads_the_check(tmp_path,
                                                                                                      seedlings, cache):
    """Each process checks half of the images; with --cache_images it decodes its half into the one .npy file
    of the machine, which both processes then map, and a second run maps it without decoding."""
    data = shutil.copytree(seedlings, tmp_path / "data")
    for name in ("truncated.png", "not_an_image.png"):
        shutil.copy(FIXTURES / "odd_images" / name, data / "Maize" / f"zz_{name}")
    command = [SCRIPTS / "train_seedlings.py", "--data_dir", data, "--model", "test_resnet", "--image_size", 48,
               "--epochs", 1, "--batch_size", 4, "--num_workers", 0, "--skip_bad_images",
               "--cache_images" if cache else "--no-cache_images"]
    first = launch_warm(*command, "--output_dir", tmp_path / "first")
    assert first.returncode == 0, first.output
    records = [json.loads((data / f".checked-{split}.json").read_text()) for split in ("train", "val")]
    assert sum(record["images"] for record in records) == 87
    for record in records:  # every image checked once, half by each process
        assert sum(record["checked_per_process"]) == record["images"]
        assert len(record["checked_per_process"]) == 2
        assert max(record["checked_per_process"]) - min(record["checked_per_process"]) <= 1
        assert f"checked {record['images']} images on 2 process(es)" in first.output
        if cache:  # both halves in one file: training's the whole resized square, evaluation's its center crop
            size = 55 if record is records[0] else 48
            (name,) = record["decoded"]  # the one size this run decoded
            decoded = np.load(data / name, mmap_mode="r")
            assert decoded.shape == (record["images"], 3, size, size) and decoded.dtype == np.uint8
            assert f"decoded once for this machine into {name}" in first.output
            files = find_splits(data, val_fraction=0.3, seed=42)[0 if record is records[0] else 1]["files"]
            shrink = build_eval_transform({"resize": 55, "center_crop": [size, size]})
            bad = {Path(path) for path, _ in record["bad"]}
            for row in (0, 1, len(files) - 1):
                expected = (np.zeros((3, size, size), np.uint8) if files[row] in bad
                            else shrink(read_image(files[row])).numpy())
                assert np.array_equal(decoded[row], expected), files[row]
            assert not list(data.glob("*.tmp.npy"))
    assert sorted(Path(path).name for record in records for path, _ in record["bad"]) == [
        "zz_not_an_image.png", "zz_truncated.png"]
    # both processes left out the same two files: else their datasets would differ and training would fail
    left_out = re.findall(r"left out (\d+) unreadable (?:train|val) images", first.output)
    assert sum(map(int, left_out)) == 2
    assert ("no loader workers: both sets are gathered from the cache" in first.output) == cache
    assert ("0 loader workers per process for training and evaluation" in first.output) != cache

    second = launch_warm(*command, "--output_dir", tmp_path / "second")
    assert second.returncode == 0, second.output
    assert not re.search(r"checked \d+ images on", second.output)
    for record in records:
        assert f"image check of {record['images']} images read from" in second.output
    same = [[json.loads(line)[key] for key in ("train_loss", "val_accuracy", "train_unique_samples")]
            for run in ("first", "second") for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert same[0] == same[1]  # the same data, checked or read


def test_pretrained_weights_from_a_file_leave_out_the_classifier(tmp_path):
    imagenet = build_model("resnet18", num_classes=1000)
    save_file(imagenet.state_dict(), tmp_path / "resnet18.safetensors")
    model = build_model("resnet18", num_classes=12)
    message = load_pretrained(model, "resnet18", tmp_path / "resnet18.safetensors")
    assert message.endswith("left out (new for this task): fc.bias, fc.weight")  # every other tensor loaded
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    deeper = load_pretrained(build_model("resnet34", num_classes=12), "resnet34", tmp_path / "resnet18.safetensors")
    assert re.search(r"120 of 218 tensors loaded; left out \(new for this task\): fc\.bias, fc\.weight; not in the file, "
                     r"so as initialised: 96 tensors, e\.g\. layer1\.2\.\S+, .* \(weights of another model than "
                     r"resnet34\?\)$", deeper), deeper
    with pytest.raises(UserError, match="no such file"):
        load_pretrained(model, "resnet18", tmp_path / "missing.pth")
    with pytest.raises(UserError, match="none of its tensors fit"):
        load_pretrained(build_model("mnist_convnet", num_classes=12), "mnist_convnet", tmp_path / "resnet18.safetensors")


@pytest.mark.slow
def test_two_processes_with_mixup_cutmix_on_an_odd_dataset_then_predict(tmp_path, seedlings):
    split = tmp_path / "split"
    assert script("split_dataset.py", seedlings, split).returncode == 0
    # one truncated image and one text file among the training images: left out with a count
    (split / "train" / "Maize" / "broken.png").write_bytes(next((split / "train" / "Maize").iterdir()).read_bytes()[:999])
    (split / "train" / "Maize" / "README.txt").write_text("notes")
    val_counts = {p.name: len(list(p.iterdir())) for p in sorted((split / "val").iterdir())}
    assert sum(val_counts.values()) == 26  # 85 images, 59 train (+ the broken one), 26 val

    output_dir = tmp_path / "run"
    assert script("compute_mean_std.py", split / "train" / "Charlock", "--output", tmp_path / "stats.json").returncode == 0
    result = launch_warm(SCRIPTS / "train_seedlings.py", "--data_dir", split, "--output_dir", output_dir, "--model",
                         "test_resnet", "--image_size", 48, "--epochs", 2, "--batch_size", 4, "--num_workers", 1,
                         "--mixup_prob", 1.0, "--cache_images", "--skip_bad_images", "--mean_std",
                         tmp_path / "stats.json")
    assert result.returncode == 0, result.output
    meta = json.loads((output_dir / "best" / "meta.json").read_text())
    assert meta["mean"] == json.loads((tmp_path / "stats.json").read_text())["mean"]
    assert meta["eval_transform"] == {"resize": 55, "center_crop": [48, 48]}
    assert "warning: left out 1 files that are not images, folders inside a class folder or images" in result.output
    assert "warning: left out 1 unreadable train images" in result.output and "broken.png" in result.output
    assert "SyncBatchNorm off" in result.output and "2 process(es)" in result.output
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    for record in metrics:
        assert record["val_samples"] == 26 and 0 <= record["val_macro_f1"] <= 1
        # drop_last: 59 images in full batches of 2 x 4, the two processes' halves disjoint
        assert record["train_samples_per_process"] == [28, 28] and record["train_unique_samples"] == 56
    report = json.loads((output_dir / "classification_report.json").read_text())
    assert {name: report[name]["support"] for name in val_counts} == val_counts  # every val image once
    # the mistakes report names each image by its file, the left-out ones skipped: every val image once, and the
    # suspects among the 59 training images with the label of their folder
    losses = list(csv.DictReader(open(output_dir / "losses.csv")))
    assert sorted(Path(row["file"]).relative_to(split / "val").as_posix() for row in losses) == sorted(
        path.relative_to(split / "val").as_posix() for path in (split / "val").rglob("*.png"))
    assert all(Path(row["file"]).parent.name == row["label"] for row in losses)
    suspects = list(csv.DictReader(open(output_dir / "label_issues.csv")))
    assert f"{len(suspects)} suspected wrong labels among the 59 training images" in result.output
    assert all(Path(row["file"]).parent.name == row["label"] and "broken" not in row["file"] for row in suspects)
    weak = len(suspects) > 59 / 3  # a model of 2 short epochs may flag most: the line and the page say what it means
    caveat = f"{len(suspects) / 59:.0%} of the labels suspected: they are that noisy, or the model (right on "
    assert (caveat in result.output) == weak and (caveat in (output_dir / "report.html").read_text()) == weak
    assert_report_shows(output_dir / "report.html", classes=12, top_losses=24, label_issues=min(24, len(suspects)))

    predicted = script("predict.py", "--model_dir", output_dir / "best", "--output", tmp_path / "out.csv", split / "val")
    assert predicted.returncode == 0, predicted.output
    rows = list(csv.DictReader(open(tmp_path / "out.csv")))
    expected = list(csv.DictReader(open(output_dir / "best" / "val_predictions.csv")))
    assert [Path(r["file"]).parent.name for r in rows] == [r["label"] for r in expected]
    assert [r["class_1"] for r in rows] == [r["prediction"] for r in expected]
    assert np.allclose([float(r["probability_1"]) for r in rows], [float(r["probability"]) for r in expected],
                       atol=1e-5)


@pytest.mark.slow
def test_odd_batch_with_mixup_and_offline_hub_weights_are_refused(tmp_path, seedlings):
    odd = script("train_seedlings.py", "--data_dir", seedlings, "--output_dir", tmp_path / "a", "--batch_size", 5)
    assert odd.returncode == 2 and "need an even --batch_size, got 5" in odd.output and "Traceback" not in odd.output
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the session's (conftest)
    offline = script("train_seedlings.py", "--data_dir", seedlings, "--output_dir", tmp_path / "b", "--model",
                     "resnet18", "--pretrained", "hub")
    assert offline.returncode == 2 and "Traceback" not in offline.output, offline.output
    assert "--pretrained hub: could not fetch ImageNet weights for resnet18" in offline.output
    assert "pass --pretrained FILE" in offline.output


def test_hub_weights_out_of_reach_are_refused_at_once():
    """Not offline, but the Hub out of reach (a compute node without internet): the local cache only, at once, where
    huggingface_hub retried for 49 s, 20 lines of it, before the same message."""
    from huggingface_hub import constants

    from common.errors import UserError
    from common.models import read_pretrained

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                     "all_proxy"):
            patch.delenv(name, raising=False)
        patch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
        started = time.monotonic()
        with pytest.raises(UserError, match=r"could not fetch ImageNet weights for resnet18 \(the Hub is out of reach "
                                            r"here \(127\.0\.0\.1:9 Connection refused\) and they are not in the "
                                            r"local cache\)\. Offline, download them elsewhere"):
            read_pretrained("resnet18", "hub")
        assert time.monotonic() - started < 10 and constants.HF_HUB_OFFLINE


@pytest.mark.slow
def test_sigterm_with_dataloader_workers_saves_and_resumes(tmp_path, seedlings, socket_tmpdir):
    """torchrun sends SIGTERM to each process group, DataLoader workers included: the run must still save."""
    output_dir = tmp_path / "run"
    args = ["--data_dir", seedlings, "--output_dir", output_dir, "--model", "test_resnet", "--image_size", 32,
            "--epochs", 3, "--batch_size", 2, "--num_workers", 2, "--no-cache_images"]
    log = tmp_path / "log"
    process = spawn(launch_command(SCRIPTS / "train_seedlings.py", *args), log=log, env={"TMPDIR": str(socket_tmpdir)})
    wait_for(lambda: (output_dir / "checkpoints" / "epoch_001_end").exists(), process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) != 0
    output = log.read_text()
    assert "stopped by SIGTERM at epoch" in output and "--resume latest" in output, output
    assert "DataLoader worker" not in output
    assert not list(socket_tmpdir.glob("pymp-*"))  # the workers, killed at the end, left no folder of theirs

    resumed = launch_warm(SCRIPTS / "train_seedlings.py", "--output_dir", output_dir, "--resume", "latest",
                          "--data_dir", seedlings)
    assert resumed.returncode == 0, resumed.output
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_a_cached_run_with_mixup_and_ema_stopped_inside_an_epoch_goes_on_with_one_process_as_the_uninterrupted_run(
        tmp_path, seedlings):
    """The decode cache's path with Mixup/CutMix on every batch and an EMA: augmentation and mixing are drawn per
    micro-batch from (seed, epoch, micro-batch), so 2 x 1 stopped by SIGTERM inside an epoch and continued as 1 x 2
    ends as the uninterrupted 2 x 1 run: weights, EMA weights, optimizer, metrics and predictions. The EMA is
    evaluated beside the model each epoch, and best/ holds the better of the two. In fp32 on every CPU: under bf16
    autocast the evaluation rounds the weights' last-digit differences across counts to bf16 (val_loss 4e-5 apart)."""
    command = [SCRIPTS / "train_seedlings.py", "--data_dir", seedlings, "--model", "test_resnet", "--image_size", 32,
               "--epochs", 3, "--batch_size", 4, "--cache_images", "--mixup_prob", 1.0, "--ema_decay", 0.9,
               "--mixed_precision", "no"]
    reference = launch_warm(*command, "--output_dir", tmp_path / "reference")
    assert reference.returncode == 0, reference.output
    output_dir = tmp_path / "run"
    command += ["--output_dir", output_dir, "--checkpoint_every", 1]  # a SIGTERM is obeyed at the next step
    stop_inside_an_epoch(command, output_dir=output_dir, log=tmp_path / "log")

    resumed = script(command[0].name, *command[1:], "--resume", "latest", threads=1)
    assert resumed.returncode == 0, resumed.output
    assert "this launch has 1 x 2: the same global batch and samples" in resumed.output
    assert_same_outcome(output_dir, tmp_path / "reference", checkpoint="checkpoints/epoch_003_end", rel=ACROSS_COUNTS,
                        per_process=False)
    assert (output_dir / "checkpoints" / "epoch_003_end" / "model_1.safetensors").exists()  # the EMA was compared

    records, _ = read_run(tmp_path / "reference")
    assert all({"ema_val_accuracy", "ema_val_loss", "ema_val_macro_f1"} <= record.keys() for record in records)
    ema = load_file(tmp_path / "reference" / "checkpoints" / "epoch_003_end" / "model_1.safetensors")
    model = load_file(tmp_path / "reference" / "checkpoints" / "epoch_003_end" / "model.safetensors")
    assert set(ema) == {f"module.{name}" for name in model}  # timm's ModelEmaV3 around a copy of the model
    assert any(not torch.equal(ema[f"module.{name}"], model[name]) for name in model)  # an average, not a copy
    meta = json.loads((tmp_path / "reference" / "best" / "meta.json").read_text())
    best = (-1.0, None)
    for record in records:  # the order save_best sees them in: each epoch the model, then its EMA
        for accuracy, weights in ((record["val_accuracy"], "model"), (record["ema_val_accuracy"], "ema")):
            best = (accuracy, weights) if accuracy > best[0] else best
    assert meta["weights"] == best[1] and meta["value"] == pytest.approx(best[0])


def test_class_balanced_draw_and_weights():
    from common.data import MicroBatches
    from common.folders import balanced_class_weights, balanced_sampling_weights

    labels = [0] * 90 + [1] * 10
    one = SimpleNamespace(process_index=0, num_processes=1, gradient_accumulation_steps=1)
    sampler = MicroBatches(100, batch_size=10, seed=42, accelerator=one, weights=balanced_sampling_weights(labels))
    first = list(sampler)
    assert first == list(sampler) and sum(map(len, first)) == 100  # a function of (seed, epoch): every process agrees
    sampler.set_epoch(2)
    assert list(sampler) != first
    drawn = [labels[i] for epoch in range(20) for batch in (sampler.set_epoch(epoch) or sampler) for i in batch]
    assert 0.45 < sum(drawn) / len(drawn) < 0.55  # the 10% class is drawn half of the time
    assert balanced_class_weights(labels, 2).tolist() == pytest.approx([100 / 180, 100 / 20])


def test_folder_augmentation_is_a_function_of_seed_epoch_and_index(seedlings):
    from common.folders import ImageFileDataset, build_train_transform
    from common.images import list_image_folder

    files, labels, classes, _ = list_image_folder(seedlings)
    dataset = ImageFileDataset(files[:4], labels[:4], classes, transform=build_train_transform(32), seed=42)
    state = torch.get_rng_state()
    dataset.set_epoch(3)
    first = [dataset[i]["image"] for i in (0, 1, 2, 3)]
    again = [dataset[i]["image"] for i in (3, 2, 1, 0)][::-1]  # another order, as other workers would ask
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert torch.equal(torch.get_rng_state(), state)  # the training process's random stream did not move
    dataset.set_epoch(4)
    assert not all(torch.equal(a, dataset[i]["image"]) for i, a in enumerate(first))
    for policy in ("trivialaugment", "randaugment"):  # the same crops and flips, then the policy's operations
        dataset.transform, _ = build_train_transform(32, policy), dataset.set_epoch(3)
        augmented = [dataset[i]["image"] for i in (0, 1, 2, 3)]
        assert all(image.shape == (3, 32, 32) and image.dtype == torch.uint8 for image in augmented)
        assert not all(torch.equal(a, b) for a, b in zip(first, augmented)), policy

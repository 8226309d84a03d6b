"""Bad input never costs a run: every mistake gets one message naming the thing and the fix, a non-zero exit,
and loses nothing. Real scripts on real files; the slow ones train the digits for an epoch or two."""

import argparse
import errno
import gzip
import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from common.checkpoint import find_checkpoint
from common.decode_cache import user_cache_folder
from common.models import load_best_model
from common.cifar import build_cifar10
from common.mnist import build_mnist
from common.errors import UserError
from common.flags import ArgumentParser
from common.folders import find_splits
from common.images import read_image
from common.tools import find_images
from conftest import FASHION_MNIST, REPO, load_script, refused, require, run_command, script, write_idx

SCRIPTS = REPO / "scripts"
ODD_IMAGES = REPO / "tests" / "fixtures" / "odd_images"
TOOLS = {"train_mnist.py": [], "train_cifar.py": [], "train_seedlings.py": [], "benchmark.py": [],
         "predict.py": ["--model_dir", "m", "x.png"], "compute_mean_std.py": ["folder"],
         "split_dataset.py": ["source", "target"], "evaluate.py": ["--model_dir", "m"],
         "export.py": ["--model_dir", "m", "--output", "m.onnx", "--check_images", "x.png"], "benchmark_folders.py": [],
         "benchmark_hf.py": [], "benchmark_peers.py": ["seedlings", "--data_dir", "d"], "bench_gpu.py": ["run"]}


def assert_refused(result, *phrases):
    """Exit code 2, our message with each of `phrases`, no traceback."""
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output, result.output
    for phrase in phrases:
        assert phrase in result.output, result.output


def snapshot(folder):
    """Every file under `folder` with its content hash."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# ---- flags: every value is checked when it is parsed ----

@pytest.mark.parametrize("name", TOOLS)
def test_every_numeric_flag_of_every_script_is_checked_when_parsed(name, monkeypatch):
    parsers = []
    monkeypatch.setattr(ArgumentParser, "parse_args", lambda self, argv=None: parsers.append(self))
    load_script(name).parse_args(TOOLS[name])
    assert parsers, f"{name} does not build its parser with common.flags.ArgumentParser"
    numeric = 0
    for action in parsers[0]._actions:
        if not action.option_strings or isinstance(action.default, bool) or action.nargs == 0:
            continue
        assert action.type not in (int, float), f"{name} {action.option_strings[0]}: a bare {action.type.__name__}"
        if isinstance(action.default, (int, float)) or getattr(action.type, "__name__", "") in ("int", "float"):
            numeric += 1
            assert action.type is not None, f"{name} {action.option_strings[0]} is numeric but parsed as a string"
            for text in ("nan", "inf", "-inf", "not-a-number"):
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type(text)
    assert numeric or name == "compute_mean_std.py"  # the one tool without a numeric flag


def test_an_hf_endpoint_that_huggingface_hub_cannot_read_is_one_line_from_every_script(monkeypatch, tmp_path):
    """huggingface_hub reads HF_ENDPOINT when imported (timm and datasets import it): one urllib cannot split was its
    traceback, at the start of train_seedlings.py (timm imported first) and wherever another script first used
    timm or datasets. Every script, in this process; and train_seedlings.py as a process, where the import was."""
    monkeypatch.setenv("HF_ENDPOINT", "http://[bad")
    message = "error: HF_ENDPOINT='http://[bad' is not a URL (Invalid IPv6 URL), and huggingface_hub"
    monkeypatch.chdir(tmp_path)
    for name, args in TOOLS.items():
        assert_refused(script(name, *args), message)
    assert not list(tmp_path.iterdir())
    assert_refused(run_command([sys.executable, SCRIPTS / "train_seedlings.py", "--output_dir", tmp_path / "run"],
                               env={"HF_ENDPOINT": "http://[bad"}), message)
    assert not list(tmp_path.iterdir())


BAD_FLAGS = [
    ("train_mnist.py", "--lr", "nan"), ("train_mnist.py", "--lr", "0"), ("train_mnist.py", "--label_smoothing", "2"),
    ("train_mnist.py", "--weight_decay", "-1"), ("train_mnist.py", "--seed", "-1"),
    ("train_mnist.py", "--dist_timeout", "nan"), ("train_mnist.py", "--epochs", "0"),
    ("train_mnist.py", "--batch_size", "0"), ("train_mnist.py", "--grad_accum", "0"),
    ("train_mnist.py", "--max_grad_norm", "-1"), ("train_mnist.py", "--max_grad_norm", "nan"),
    ("train_mnist.py", "--warmup_fraction", "1"),
    ("train_mnist.py", "--keep_checkpoints", "0"), ("train_mnist.py", "--checkpoint_every", "0"),
    ("train_mnist.py", "--max_steps", "-5"), ("train_mnist.py", "--mixed_precision", "fp8"),
    ("train_cifar.py", "--momentum", "0"), ("train_cifar.py", "--momentum", "1.5"),
    ("train_seedlings.py", "--num_workers", "-1"), ("train_seedlings.py", "--image_size", "0"),
    ("train_seedlings.py", "--val_fraction", "1"), ("train_seedlings.py", "--mixup_prob", "1.5"),
    ("train_seedlings.py", "--mixup_alpha", "-1"), ("train_seedlings.py", "--rotation", "181"),
    ("train_seedlings.py", "--rotation", "-30"),
    ("predict.py", "--batch_size", "0"), ("predict.py", "--top_k", "-1"), ("predict.py", "--top_k", "0"),
    ("predict.py", "--device", "gpu0"), ("evaluate.py", "--batch_size", "0"), ("export.py", "--tolerance", "nan"),
    ("benchmark_folders.py", "--sizes", "1000,x"), ("benchmark_folders.py", "--processes", "0"),
    ("benchmark.py", "--images", "0"), ("benchmark.py", "--repeats", "0"),
    ("split_dataset.py", "--val_fraction", "1"), ("split_dataset.py", "--seed", "-1"),
    ("benchmark_peers.py", "--seeds", "-1"), ("benchmark_peers.py", "--target", "1.5"),
    ("benchmark_peers.py", "--target", "0"), ("benchmark_peers.py", "--epochs", "0"),
    ("bench_gpu.py", "--max_mib", "0"), ("bench_gpu.py", "--budget_s", "nan"),
    ("train_mnist.py", "--output_dir", ""), ("train_seedlings.py", "--data_dir", " "), ("train_cifar.py", "--resume", ""),
]


@pytest.mark.parametrize("name,flag,value", BAD_FLAGS)
def test_a_bad_flag_value_stops_at_parse_time_naming_the_flag(name, flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        load_script(name).parse_args([*TOOLS[name], flag, value])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}" in error and value in error and len(error.strip().splitlines()) == 1, error


def test_a_tilde_the_shell_left_in_a_path_is_the_home_folder(tmp_path, monkeypatch):
    """`--output_dir=~/runs` and a quoted "~/runs" reach a script as they are: the run went into a folder named ~ in
    the current one (which `rm -rf ~` would then clean up)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    result = script("train_mnist.py", "--dataset", "digits", "--epochs", 1, "--output_dir=~/run")
    assert result.returncode == 0, result.output
    assert (tmp_path / "run" / "metrics.jsonl").exists() and not (REPO / "~").exists()
    for name, argv, key, expected in (
            ("predict.py", ["--model_dir", "~/run", "~/photos"], "inputs", [str(tmp_path / "photos")]),
            ("evaluate.py", ["--model_dir", "~/run/best", "--data_dir", "~/data"], "data_dir", str(tmp_path / "data")),
            ("split_dataset.py", ["~/photos", "~/split"], "target", str(tmp_path / "split")),
            ("train_seedlings.py", ["--mean_std", "~/stats.json"], "mean_std", str(tmp_path / "stats.json"))):
        assert getattr(load_script(name).parse_args(argv), key) == expected, name


def test_a_device_the_scripts_cannot_use_is_refused_at_parse_time(capsys):
    """cuda without a GPU; torch's other device types (mps, xpu, meta), on which predict.py ran on the CPU."""
    for device, message in [*([] if torch.cuda.is_available() else [
                                ("cuda", "cuda: this machine has 0 CUDA devices; use --device cpu")]),
                            *((name, f"{name}: these scripts run on cpu, cuda or cuda:N only")
                              for name in ("mps", "xpu", "meta"))]:
        with pytest.raises(SystemExit):
            load_script("predict.py").parse_args([*TOOLS["predict.py"], "--device", device])
        assert f"argument --device: {message}" in capsys.readouterr().err


def test_gpus_named_that_torch_cannot_use_are_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A Slurm job given GPUs (CUDA_VISIBLE_DEVICES set) on a torch without CUDA, or with a driver it cannot use,
    trained on the CPU, tens of times slower, said in its first line only."""
    from common.distributed import check_gpus_usable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for cuda, why in (("12.8", f"torch {torch.__version__} (CUDA 12.8) finds no GPU it can use: check that nvidia-smi"),
                      (None, "this torch is built without CUDA (torch.version.cuda is None): install a CUDA build")):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        message = refused("train_mnist.py", "--dataset", "digits", "--output_dir", tmp_path / "run")
        assert message.strip().startswith(f"error: CUDA_VISIBLE_DEVICES=0,1 names GPUs, but {why}"), message
        assert "To train on the CPU instead, unset CUDA_VISIBLE_DEVICES" in message
    assert not (tmp_path / "run").exists()
    for nothing_named in ("", "-1", "NoDevFiles"):  # what a job without GPUs, or a user hiding them, sets
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", nothing_named)
        check_gpus_usable()


def test_a_bad_flag_in_a_real_run_is_one_line_and_exit_2():
    result = script("train_mnist.py", "--dataset", "digits", "--lr", "nan")
    assert_refused(result, "argument --lr: must be a number above 0, got nan")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


COPIED = ["train_cifar.py", "train_mnist.py", "train_seedlings.py", "evaluate.py", "predict.py", "export.py",
          "split_dataset.py", "compute_mean_std.py"]  # the scripts a user copies into a repository


def test_a_script_copied_without_common_says_to_copy_it_too(tmp_path):
    """Copied alone (scripts/X.py in another repository), or next to a common/ package of the user's own: one line
    naming what is missing, before any work (each in a fresh interpreter, as a copy starts)."""
    alone, foreign = tmp_path / "repo" / "scripts", tmp_path / "other"
    alone.mkdir(parents=True)
    (foreign / "common").mkdir(parents=True)
    (foreign / "common" / "__init__.py").write_text("")
    runs = []
    for name in COPIED:
        folder = alone if name.startswith("train") else foreign
        shutil.copy(SCRIPTS / name, folder / name)
        runs.append(subprocess.Popen([sys.executable, folder / name, *TOOLS[name]], cwd=tmp_path,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for name, run in zip(COPIED, runs):
        output = run.communicate(timeout=120)[0]
        missing = "common" if name.startswith("train") else "common.errors"
        assert run.returncode == 1 and output == (
            f"error: {name} needs the common/ folder it came with, beside it or one folder up (No module named "
            f"'{missing}'): copy common/ into your repository too\n"), output


def test_a_script_and_a_common_of_another_version_say_so_in_one_line(tmp_path):
    """A script updated without common/ (or the other way round): a module or a name it imports that common/ lacks
    was a traceback; one line naming both and the fix (each a fresh interpreter, as a copy starts)."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "common", repo / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "scripts").mkdir()
    (repo / "common" / "tools.py").unlink()  # a module added since
    outputs = repo / "common" / "outputs.py"  # a function renamed since
    outputs.write_text(outputs.read_text().replace("def prepare_output_dir(", "def prepare_output_folder("))
    runs = {}
    for name in ("predict.py", "train_seedlings.py"):
        shutil.copy(SCRIPTS / name, repo / "scripts" / name)
        runs[name] = subprocess.Popen([sys.executable, repo / "scripts" / name, *TOOLS[name]], cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lacks = {"predict.py": "No module named 'common.tools'",
             "train_seedlings.py": f"cannot import name 'prepare_output_dir' from 'common.outputs' ({outputs})"}
    for name, run in runs.items():
        output = run.communicate(timeout=120)[0]
        assert run.returncode == 1 and output == (
            f"error: {name} and the common/ it found ({repo / 'common'}) are from different versions ({lacks[name]}): "
            "copy the script and common/ from the same version\n"), output
    assert not list(tmp_path.glob("*.csv")) and sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_a_dataset_still_in_its_archive_or_a_file_of_it_as_data_dir_says_what_to_pass(tmp_path):
    seedlings = ODD_IMAGES.parent / "seedlings"
    archives = {"zip": shutil.make_archive(tmp_path / "plants", "zip", seedlings),
                "tar": shutil.make_archive(tmp_path / "plants", "gztar", seedlings)}
    for kind, archive in archives.items():
        note = f"{archive} is not a folder (a {kind} archive: extract it, then pass the folder it makes)"
        with pytest.raises(UserError, match=re.escape(note)):
            find_splits(archive, val_fraction=0.3, seed=42)
    with pytest.raises(UserError, match=re.escape(f"no CIFAR-10 found at {archives['zip']} (a zip archive: extract")):
        build_cifar10(archives["zip"])
    with pytest.raises(UserError, match=re.escape("no mnist IDX files found (a zip archive: extract it, then pass")):
        build_mnist(archives["zip"])
    with pytest.raises(UserError, match=r"^.*README\.md is not a folder: expected a folder of class folders"):
        find_splits(REPO / "README.md", val_fraction=0.3, seed=42)  # not an archive: no note
    result = script("compute_mean_std.py", archives["zip"], "--output", tmp_path / "mean_std.json")
    assert_refused(result, f"cannot read image {archives['zip']}: cannot identify image file")
    assert "(a zip archive: extract it, then pass the folder it makes)" in result.output
    # one of the IDX files themselves: their folder
    (tmp_path / "idx").mkdir()
    write_idx(tmp_path / "idx" / "train-images-idx3-ubyte.gz", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(UserError, match=re.escape(f"--data_dir {tmp_path / 'idx' / 'train-images-idx3-ubyte.gz'} "
                                                  f"is a file, and its folder holds the IDX files: pass --data_dir "
                                                  f"{tmp_path / 'idx'}")):
        build_mnist(tmp_path / "idx" / "train-images-idx3-ubyte.gz")


def test_a_wrong_model_or_pretrained_file_is_refused_before_any_image_is_read(tmp_path):
    data = shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / "data")
    for name, size in (("train_seedlings.py", ["--image_size", 64]), ("train_cifar.py", [])):  # CIFAR-10: 32
        result = script(name, "--data_dir", data, "--model", "resnet19", "--output_dir", tmp_path / "run")
        assert_refused(result, "error: unknown model 'resnet19': use resnet18_cifar, mnist_convnet or a timm name "
                               "such as resnet50")
        result = script(name, "--data_dir", data, "--model", "vit_tiny_patch16_224", *size, "--output_dir",
                        tmp_path / "run")
        assert_refused(result, "error: --model vit_tiny_patch16_224 takes only 224x224 images and this run gives it "
                               f"{size[-1] if size else 32}x")
    result = script("train_seedlings.py", "--data_dir", data, "--pretrained", tmp_path / "resnet50.pth",
                    "--output_dir", tmp_path / "run")
    assert_refused(result, f"error: --pretrained {tmp_path / 'resnet50.pth'}: no such file")
    assert not list(data.glob(".checked*")) and not (tmp_path / "run").exists()  # no image check, no decode


def test_a_batch_of_one_that_batch_norm_cannot_train_on_is_one_message(tmp_path):
    """Where a BatchNorm layer sees 1x1 maps, one image a batch is one value per channel: PyTorch's traceback at the
    first step before. Elsewhere a batch of one trains."""
    result = script("train_mnist.py", "--dataset", "digits", "--batch_size", 1, "--output_dir", tmp_path / "digits")
    assert_refused(result, "error: --batch_size 1: the model (mnist_convnet) has a BatchNorm layer, BatchNorm2d(32), "
                           "that sees 1x1 maps at 8x8 images, so a batch of one image gives it one value per channel")
    data = shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / "data")  # its image check is written there
    result = script("train_seedlings.py", "--data_dir", data, "--model", "resnet18",
                    "--image_size", 32, "--batch_size", 1, "--mixup_alpha", 0, "--cutmix_alpha", 0, "--output_dir",
                    tmp_path / "seedlings")
    assert_refused(result, "the model (resnet18) has a BatchNorm layer, BatchNorm2d(512), that sees 1x1 maps at 32x32")
    from common.models import build_model, check_batch_norm, describe_model

    for name, size in (("resnet18", 64), ("resnet18_cifar", 32)):  # 2x2 and 4x4 maps at the last stage: refused not
        info = describe_model(name, "abc", image_size=(size, size), normalize=((0,) * 3, (1,) * 3), dataset="folder",
                              arguments={})
        check_batch_norm(build_model(name, **info["model_kwargs"]), info, batch_size=1)


def test_digits_with_a_data_dir_or_download_is_refused_not_ignored(tmp_path):
    for args in (["--data_dir", tmp_path / "photos"], ["--download"]):
        result = script("train_mnist.py", "--dataset", "digits", *args, "--output_dir", tmp_path / "run")
        assert_refused(result, f"error: {args[0]} is not used with --dataset digits, scikit-learn's bundled 8x8 "
                               "digits: drop it, or train on IDX files with --dataset mnist / fashion_mnist")
    assert not (tmp_path / "run").exists()


def test_a_run_refused_after_it_made_its_folder_leaves_none_and_keeps_the_folders_it_found(tmp_path):
    args = ["--data_dir", tmp_path / "typo"]
    assert_refused(script("train_seedlings.py", *args, "--output_dir", tmp_path / "new" / "run"), "typo not found")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert_refused(script("train_seedlings.py", *args, "--output_dir", tmp_path / "mine" / "run"), "typo not found")
    assert list(tmp_path.iterdir()) == [tmp_path / "mine"] and not list((tmp_path / "mine").iterdir())


@pytest.mark.slow
def test_under_a_two_process_launch_a_user_error_is_said_once_at_the_end(tmp_path):
    from conftest import launch

    for args, message in ((["--dataset", "mnist", "--data_dir", tmp_path / "typo"], "error: no mnist IDX files found"),
                          (["--dataset", "digits", "--lr", "abc"], "error: argument --lr: must be a number above 0")):
        result = launch(SCRIPTS / "train_mnist.py", *args, "--output_dir", tmp_path / "new" / "run")
        assert result.returncode != 0
        assert not (tmp_path / "new").exists()  # the folders it made for the run, empty, went with it
        assert result.output.count(message) == 1, result.output
        # torchrun's failure table comes last; our message is its root cause's "traceback" line
        root_cause = result.output.split("Root Cause (first observed failure):")[1]
        assert "traceback : " in root_cause and message in root_cause and "exitcode  : 2" in root_cause
        assert 'train_mnist.py", line' not in result.output
    # a tool of one process, launched as two: refused before it writes (each process would write the same files)
    result = launch(SCRIPTS / "split_dataset.py", ODD_IMAGES.parent / "seedlings", tmp_path / "split")
    message = "error: split_dataset.py runs in one process and was launched as 2, each of which would write the same"
    assert result.returncode != 0 and result.output.count(message) == 1, result.output
    assert not (tmp_path / "split").exists()


@pytest.mark.parametrize("tool", ["export.py", "compute_mean_std.py", "split_dataset.py"])
def test_a_tool_of_one_process_launched_as_several_is_refused_before_it_reads_anything(tmp_path, monkeypatch, tool):
    monkeypatch.setenv("WORLD_SIZE", "4")  # what a launcher of 4 processes gives each
    args = {"export.py": ["--model_dir", tmp_path / "best", "--output", tmp_path / "m.onnx", "--check_images",
                          tmp_path],
            "compute_mean_std.py": [tmp_path, "--output", tmp_path / "stats.json"],
            "split_dataset.py": [tmp_path, tmp_path / "split"]}[tool]
    assert_refused(script(tool, *args), f"error: {tool} runs in one process and was launched as 4, each of which "
                                        f"would write the same files: run it with python scripts/{tool} (not "
                                        "accelerate launch)")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_compile_on_the_cpu_without_a_cpp_compiler_is_one_message_before_anything_is_written(tmp_path):
    """A slim container has no g++; Inductor needs one for CPU kernels and failed at the first step in 30 frames.
    A process of its own: Inductor reads CXX once, when it is imported."""
    from conftest import run_command

    missing = tmp_path / "bin" / "g++"
    result = run_command([sys.executable, SCRIPTS / "train_mnist.py", "--dataset", "digits", "--compile",
                          "--output_dir", tmp_path / "run"], env={"CXX": str(missing)})
    assert_refused(result, "error: --compile on the CPU needs a C++ compiler, which torch.compile builds its kernels "
                           f"with, and none works here ({missing}): install one (apt-get install g++), or drop "
                           "--compile")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_report_to_wandb_without_wandb_is_refused(tmp_path):
    if importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    result = script("train_mnist.py", "--dataset", "digits", "--report_to", "wandb", "--output_dir", tmp_path / "run")
    assert_refused(result, "--report_to wandb: the wandb package is not installed", "pip install wandb")
    assert not (tmp_path / "run").exists()


# ---- images: 16-bit, RGBA, damaged ----

def test_16_bit_images_are_scaled_to_8_bits_not_clipped():
    wide, narrow = Image.open(ODD_IMAGES / "gray16.png"), np.asarray(Image.open(ODD_IMAGES / "gray8.png"))
    assert wide.mode.startswith("I") and np.asarray(wide).max() > 255  # a real 16-bit file
    assert np.array_equal(np.asarray(read_image(ODD_IMAGES / "gray16.png", channels=1)), narrow)
    rgb = np.asarray(read_image(ODD_IMAGES / "gray16.png"))
    assert rgb.shape[2] == 3 and np.array_equal(rgb[..., 0], narrow) and 0.2 < rgb.mean() / 255 < 0.8
    assert np.asarray(read_image(ODD_IMAGES / "rgba.png")).shape[2] == 3
    for broken in ("truncated.png", "not_an_image.png"):
        with pytest.raises((OSError, ValueError)):
            read_image(ODD_IMAGES / broken)


def test_a_palette_image_with_a_transparent_colour_is_read_without_pillows_warning(tmp_path):
    """Pillow warned ("Palette images with Transparency expressed in bytes should be converted to RGBA images",
    pointing at its own code, naming no image) once per process of a run reading such a PNG; the pixels stay."""
    import warnings

    rgb = Image.open(ODD_IMAGES / "rgba.png").convert("RGB")
    # a tRNS chunk of several entries (an alpha per palette colour), as image editors write them
    rgb.convert("P", palette=Image.ADAPTIVE, colors=16).save(tmp_path / "palette.png", transparency=b"\0\xff\x80")
    assert isinstance(Image.open(tmp_path / "palette.png").info["transparency"], bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for channels, mode in ((3, "RGB"), (1, "L")):
            expected = np.asarray(Image.open(tmp_path / "palette.png").convert("RGBA").convert(mode))
            assert np.array_equal(np.asarray(read_image(tmp_path / "palette.png", channels=channels)), expected)


def test_an_image_not_opened_for_want_of_file_descriptors_is_not_called_unreadable(tmp_path, seedlings, monkeypatch):
    """Out of file descriptors (`ulimit -n`) as it opens one image: with --skip_bad_images that image was left out as
    unreadable and the image check kept it so for the next runs (predict.py skipped it). Now the run stops, with the
    message that names the limit, and keeps no check of that image's split."""
    data = shutil.copytree(seedlings, tmp_path / "data", ignore=shutil.ignore_patterns(".checked*"))
    victim = sorted((data / "Maize").iterdir())[0]
    real_open = Image.open

    def short_of_descriptors(path, *args, **kwargs):
        if Path(str(path)) == victim:
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(Image, "open", short_of_descriptors)
    result = script("train_seedlings.py", "--data_dir", data, "--skip_bad_images", "--model", "test_resnet",
                    "--image_size", 32, "--epochs", 1, "--output_dir", tmp_path / "run")
    assert result.returncode == 1 and "Traceback" not in result.output, result.output
    assert "error: too many open files: this process may hold" in result.output and "left out" not in result.output
    for record in data.glob(".checked-*.json"):  # the split that holds it kept no check; the other's names none bad
        assert json.loads(record.read_text())["bad"] == []
    assert len(list(data.glob(".checked-*.json"))) < 2


def test_a_floating_point_image_is_named_not_read_black(tmp_path, seedlings):
    """A 32-bit float TIFF (mode F: microscopy, remote sensing) of values in 0-1 came out black (Pillow's convert
    clips to 0-255); its range is unknown, so it is an unreadable image with the fix, in training as in the tools."""
    data = tmp_path / "data"
    for split in ("train", "val"):
        shutil.copytree(seedlings, data / split)
    float_image = data / "train" / "Maize" / "float.tif"
    Image.fromarray(np.random.default_rng(0).random((48, 48), dtype=np.float32), mode="F").save(float_image)
    assert Image.open(float_image).mode == "F"
    fix = "a 32-bit floating-point image (mode F), whose values have no fixed range: save it as 8 or 16 bits"
    with pytest.raises(ValueError, match=re.escape(fix)):
        read_image(float_image)
    message = refused("train_seedlings.py", "--data_dir", data, "--output_dir", tmp_path / "run", "--model",
                      "test_resnet", "--image_size", 32, "--epochs", 1)
    assert f"error: cannot read image {float_image}: {fix}" in message, message
    assert f"error: cannot read image {float_image}: {fix}" in refused("compute_mean_std.py", float_image, "--output",
                                                                       tmp_path / "stats.json")


def test_an_image_larger_than_pillow_opens_is_named_with_its_size_and_the_fix(monkeypatch):
    """Pillow refuses an image of more than twice Image.MAX_IMAGE_PIXELS (179 megapixels: a drone's or a slide
    scanner's) as a possible decompression bomb; here the limit is lowered to a fixture's size."""
    image = ODD_IMAGES / "gray8.png"  # 48 x 48: 2,304 pixels, refused above 2 x 1,000
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    with pytest.raises(ValueError) as error:
        read_image(image)
    assert str(error.value) == (
        "2,304 pixels, more than Pillow opens (its guard against decompression bombs: 2,000); the scripts resize it to "
        "a few hundred pixels a side anyway, so downscale it once beforehand (e.g. ImageMagick: mogrify -resize "
        f"'4096x4096>' {image})")


def test_a_split_whose_images_are_all_unreadable_is_named_even_when_skipping():
    from common.decode_cache import check_images

    files = [ODD_IMAGES / "truncated.png", ODD_IMAGES / "not_an_image.png"]
    with pytest.raises(UserError, match=r"none of the 2 images could be read, e.g. .*truncated.png"):
        check_images(files, skip_bad_images=True)


def test_compute_mean_std_of_16_bit_images_is_that_of_their_8_bit_values(tmp_path):
    for name in ("gray16", "gray8"):
        (tmp_path / name).mkdir()
        shutil.copy(ODD_IMAGES / f"{name}.png", tmp_path / name)
        assert script("compute_mean_std.py", tmp_path / name, "--output", tmp_path / f"{name}.json").returncode == 0
    wide, narrow = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("gray16", "gray8"))
    assert wide["mean"] == narrow["mean"] and wide["std"] == narrow["std"] and 0.1 < wide["mean"][0] < 0.9


def test_compute_mean_std_checks_its_output_before_reading_images(tmp_path):
    images = ODD_IMAGES.parent / "seedlings"
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    for output, message in ((tmp_path / "missing" / "s.json", "does not exist"), (tmp_path, "is a folder"),
                            (tmp_path / "stats.txt", "must end in .json"),
                            (notes, "exists and is not a JSON written by compute_mean_std.py")):
        assert_refused(script("compute_mean_std.py", images, "--output", output), message)
    assert notes.read_text() == '{"mine": 1}'


# ---- damaged dataset files ----

@pytest.fixture
def idx_folder(tmp_path):
    """A small MNIST-layout folder of real digits, as the four IDX files."""
    from common.mnist import build_digits

    train, test = build_digits()
    folder = tmp_path / "idx"
    folder.mkdir()
    for split, data in (("train", train), ("t10k", test)):
        write_idx(folder / f"{split}-images-idx3-ubyte", data.images[:, 0].numpy())
        write_idx(folder / f"{split}-labels-idx1-ubyte", data.labels.numpy().astype(np.uint8))
    return folder


def test_damaged_idx_files_are_named_with_the_fix(idx_folder):
    images = idx_folder / "train-images-idx3-ubyte"
    data = images.read_bytes()
    gz = idx_folder / "train-images-idx3-ubyte.gz"
    images.unlink()
    gz.write_bytes(data)  # named .gz, not gzip
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is damaged .*fetch it again"):
        build_mnist(idx_folder)
    gz.write_bytes(gzip.compress(data)[:200])  # a download cut short
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is damaged"):
        build_mnist(idx_folder)


def test_swapped_idx_files_out_of_range_labels_and_other_sizes_are_refused(idx_folder):
    labels, images = idx_folder / "train-labels-idx1-ubyte", idx_folder / "train-images-idx3-ubyte"
    original_images, original_labels = images.read_bytes(), labels.read_bytes()
    images.write_bytes(original_labels)
    labels.write_bytes(original_images)
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte holds labels of shape .* are the files swapped"):
        build_mnist(idx_folder)
    images.write_bytes(original_images)
    write_idx(labels, np.full(len(np.frombuffer(original_labels[8:], np.uint8)), 12, dtype=np.uint8))
    with pytest.raises(UserError, match=r"train-labels-idx1-ubyte holds labels from 12 to 12, but the dataset has 10"):
        build_mnist(idx_folder)
    labels.write_bytes(original_labels)
    write_idx(idx_folder / "t10k-images-idx3-ubyte", np.zeros((450, 9, 9), np.uint8))
    with pytest.raises(UserError, match=r"training images .* are \(8, 8\) pixels but the test images are \(9, 9\)"):
        build_mnist(idx_folder)


def test_a_mistyped_fashion_mnist_folder_is_not_replaced_by_another_copy(tmp_path):
    with pytest.raises(UserError, match=r"no fashion_mnist IDX files found; tried .*typo.*apt-get install"):
        build_mnist(tmp_path / "typo", name="fashion_mnist")


def test_cifar_archive_that_is_not_a_tarball_says_how_to_fix_it_and_download_replaces_it(tmp_path):
    (tmp_path / "cifar-10-python.tar.gz").write_text("<html>proxy error</html>")
    with pytest.raises(UserError, match=r"not the CIFAR-10 archive. Delete it and run with --download"):
        build_cifar10(tmp_path)
    # --download tries to fetch a new one instead of reading the broken file (offline here: it says so)
    with pytest.raises(UserError, match=r"--download: could not fetch CIFAR10"):
        build_cifar10(tmp_path, download=True)
    with pytest.raises(UserError, match=r"--download: could not fetch MNIST") as offline:
        build_mnist(tmp_path / "mnist", name="mnist", download=True)
    assert "\n" not in str(offline.value)  # torchvision's lines (a mirror each) joined into the one message
    assert not (tmp_path / "mnist").exists()  # nor the empty mnist/MNIST/raw/ it had made


def test_mnist_and_fashion_mnist_files_given_as_the_other_are_named(tmp_path):
    """The two sets' IDX files look alike: read as the other, their images would train and be reported under the
    other set's class names. The official training sets are told apart by their first labels."""
    require(FASHION_MNIST / "train-labels-idx1-ubyte.gz", "apt-get install -y dataset-fashion-mnist")
    with pytest.raises(UserError, match=re.escape(f"{FASHION_MNIST} holds the fashion_mnist files (their labels begin "
                                                  "as that set's do), and --dataset mnist would name their classes as "
                                                  "mnist's: pass --dataset fashion_mnist")):
        build_mnist(FASHION_MNIST, name="mnist")
    with pytest.raises(UserError, match=r"has no class folders: .* \(it holds MNIST-style IDX files, which "
                                        r"scripts/train_mnist.py reads\)$"):
        find_splits(FASHION_MNIST, val_fraction=0.3, seed=42)  # train_seedlings.py on them
    labels = np.arange(60000, dtype=np.uint8) % 10  # MNIST's training labels begin 5 0 4 1 9 2 1 3 1 4
    labels[:10] = [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    for split, count in (("train", 60000), ("t10k", 10)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", np.zeros((count, 28, 28), np.uint8))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", labels[:count])
    with pytest.raises(UserError, match=r"holds the mnist files .* pass --dataset mnist$"):
        build_mnist(tmp_path, name="fashion_mnist")
    assert len(build_mnist(tmp_path, name="mnist")[0]) == 60000
    labels[0] = 6  # any other set in IDX files is read as it is named
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    assert build_mnist(tmp_path, name="fashion_mnist")[0].classes[0] == "T-shirt/top"


def test_a_cifar_data_dir_one_level_too_deep_names_the_tree_above(cifar_jpegs):
    for split in ("train", "test"):
        with pytest.raises(UserError, match=rf"it is a split of the ImageFolder tree {cifar_jpegs}, .*: pass "
                                            rf"--data_dir {cifar_jpegs}$"):
            build_cifar10(cifar_jpegs / split)


def test_cifar_class_folders_with_nothing_to_test_on_say_how_to_hold_some_out(tmp_path, cifar_jpegs):
    """The shared CIFAR-10 JPEGs unpack as cifar10/train/<class>/ alone: the script needs a held-out folder too."""
    only_train = tmp_path / "cifar10"
    shutil.copytree(cifar_jpegs / "train", only_train / "train")
    for given in (only_train, only_train / "train"):
        with pytest.raises(UserError, match=re.escape(
                f"no CIFAR-10 found at {given}: {only_train / 'train'} holds class folders but nothing beside them to "
                f"test on (test/ or val/). Hold some out: python scripts/split_dataset.py {only_train / 'train'} "
                f"{tmp_path / 'cifar10-split'} --val_fraction 0.1 (stratified), then --data_dir "
                f"{tmp_path / 'cifar10-split'}")):
            build_cifar10(given)
    with pytest.raises(UserError, match=r"no CIFAR-10 found at .*\. Accepted layouts:"):
        build_cifar10(tmp_path)  # a folder of datasets, not of classes: the layouts
    assert script("split_dataset.py", only_train / "train", tmp_path / "cifar10-split", "--val_fraction",
                  0.1).returncode == 0  # the command it gives works
    assert build_cifar10(tmp_path / "cifar10-split")[1].classes == sorted(p.name for p in only_train.glob("train/*"))
    # a class renamed in one split: said before any image is decoded (a full CIFAR-10 took its decode first)
    renamed = shutil.copytree(cifar_jpegs, tmp_path / "renamed", ignore=shutil.ignore_patterns(".*"))
    first = sorted(p.name for p in (renamed / "test").iterdir())[0]
    (renamed / "test" / first).rename(renamed / "test" / f"{first}s")
    with pytest.raises(UserError, match=re.escape(f"{renamed / 'train'} and {renamed / 'test'} have different class "
                                                  f"folders (only in train: ['{first}']; only in test: ['{first}s']). "
                                                  "Give both the same classes.")):
        build_cifar10(renamed)
    assert not [p.name for p in renamed.iterdir() if p.name.startswith(".")]


def test_cifar_100_is_named_with_how_to_train_it(tmp_path):
    """CIFAR-100's python files (train, test, meta: no data_batch_N) and their archive, the other CIFAR a user
    downloads: each place it can be given is named as CIFAR-100, with the two ways this script trains it."""
    folder = tmp_path / "data" / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, count in (("train", 20), ("test", 10)):
        batch = {b"data": np.zeros((count, 3072), np.uint8), b"fine_labels": list(range(count)),
                 b"coarse_labels": [0] * count}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": [b"apple"] * 100}))
    archive = tmp_path / "downloads" / "cifar-100-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-100-python")
    how = ("(its python files train, test and meta), not CIFAR-10, whose batches this script reads: give CIFAR-100 as "
           "a folder tree of its images (train/<class>/*.png + test/<class>/*.png: a tree trains with any number of "
           "classes), or as a Hugging Face dataset (--data_dir hf:NAME_OR_PATH --label_column fine_label)")
    for given, named in ((folder.parent, folder), (folder, folder), (folder / "train", folder),
                         (archive.parent, archive), (archive, archive)):
        with pytest.raises(UserError) as error:
            build_cifar10(given)
        assert str(error.value) == f"{named} is CIFAR-100 {how}"
    assert refused("train_cifar.py", "--data_dir", folder.parent, "--output_dir", tmp_path / "run").strip() == (
        f"error: {folder} is CIFAR-100 {how}")
    assert not (tmp_path / "run").exists()


def test_hf_prefix_on_a_plain_folder_says_to_drop_it(tmp_path, cifar_jpegs):
    with pytest.raises(UserError, match=r"neither one written by save_to_disk nor one of data files.*without hf:"):
        build_cifar10(f"hf:{cifar_jpegs}")
    with pytest.raises(UserError, match=r"^'hf:' names no dataset: pass hf:NAME \(a dataset on the Hub\)"):
        build_cifar10("hf:")
    with pytest.raises(UserError, match=rf"^hf:{tmp_path / 'typo'}: {tmp_path / 'typo'} not found$"):
        build_cifar10(f"hf:{tmp_path / 'typo'}")  # was "read as a dataset name on the Hub"


# ---- folders of class folders ----

def test_train_and_test_folders_for_the_seedlings_script_say_to_name_it_val(tmp_path):
    for split in ("train", "test"):
        shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / split)
    with pytest.raises(UserError, match=r"must be called val/ \(rename .*test to .*val\)"):
        find_splits(tmp_path, val_fraction=0.3, seed=42)


def test_val_fraction_typed_for_train_and_val_folders_is_refused_not_ignored(tmp_path):
    for split in ("train", "val"):
        shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / "data" / split)
    result = script("train_seedlings.py", "--data_dir", tmp_path / "data", "--val_fraction", 0.2, "--output_dir",
                    tmp_path / "run")
    assert_refused(result, f"error: --val_fraction 0.2 splits a folder of class folders here, and {tmp_path / 'data'} "
                           "has train/ and val/ (val/ validates): drop --val_fraction, or pass --data_dir "
                           f"{tmp_path / 'data' / 'train'} to split its training images")
    train, val, _, _ = find_splits(tmp_path / "data", val_fraction=0.3, seed=42)  # the default, not typed: val/
    assert len(train["files"]) == len(val["files"]) == 85


def test_names_that_are_not_utf8_are_refused_before_any_work_naming_their_bytes(tmp_path):
    """An old zip's Latin-1 names (b"caf\\xe9.png") stopped a run at its image check with a UnicodeEncodeError
    traceback (its fingerprint, like the CSV files and reports, writes names as UTF-8). Refused at the listing now,
    by every tool that lists images, for an image, a stray file or a class folder."""
    data = shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / "data")
    first = sorted((data / "Maize").iterdir())[0]
    try:
        os.rename(first, os.fsencode(data / "Maize") + b"/caf\xe9 \xff.png")
    except OSError:
        pytest.skip("this filesystem takes only UTF-8 names")
    fix = "Rename them to UTF-8: from Latin-1, an old zip's usual names, convmv -r -f latin1 -t utf-8 --notest FOLDER"
    named = f"1 file or folder name(s) are not UTF-8 text, e.g. {data / 'Maize'}/caf\\xe9 \\xff.png: the reports"
    for result in (script("train_seedlings.py", "--data_dir", data, "--output_dir", tmp_path / "run"),
                   script("predict.py", "--model_dir", "m", "--output", tmp_path / "p.csv", data / "Maize"),
                   script("split_dataset.py", data, tmp_path / "split"),
                   script("compute_mean_std.py", data)):
        assert_refused(result, named, fix)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing made
    # a path given in such bytes: refused when parsed (an --output_dir's run trained, then stopped at report.html)
    latin1 = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")
    result = script("train_mnist.py", "--dataset", "digits", "--output_dir", latin1)
    assert_refused(result, f"argument --output_dir: {tmp_path}/caf\\xe9 is not UTF-8 text, which the log and the "
                           "reports could not write: give a path whose names are UTF-8")
    assert len(result.stderr.strip().splitlines()) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    os.rename(os.fsencode(data / "Maize") + b"/caf\xe9 \xff.png", first)
    os.rename(data / "Maize", os.fsencode(tmp_path / "data") + b"/Ma\xefze")  # a class folder's name
    with pytest.raises(UserError, match=r"e\.g\. .*/data/Ma\\xefze: the reports"):
        find_splits(data, val_fraction=0.3, seed=42)


def test_a_class_with_one_image_is_named(tmp_path):
    for name, count in (("Maize", 3), ("Cleavers", 1)):
        (tmp_path / name).mkdir()
        for image in sorted((ODD_IMAGES.parent / "seedlings" / name).iterdir())[:count]:
            shutil.copy(image, tmp_path / name)
    with pytest.raises(UserError, match=r"every class needs at least 2 images, and Cleavers \(1\) has fewer"):
        find_splits(tmp_path, val_fraction=0.3, seed=42)


def test_a_zip_from_macos_trains_on_its_classes_and_a_folder_inside_a_class_is_left_out_with_a_count(tmp_path):
    """macOS's zip puts __MACOSX/<class>/._<image> beside the data: not a class (it was taken for one, and the
    message told the user to train on it), nor images for predict.py. A folder inside a class folder is not read
    for training: said, not dropped silently."""
    data = tmp_path / "seedlings"
    shutil.copytree(ODD_IMAGES.parent / "seedlings", data)
    first = sorted((data / "Maize").iterdir())[0]
    (data / "__MACOSX" / "Maize").mkdir(parents=True)
    (data / "__MACOSX" / "Maize" / f"._{first.name}").write_bytes(b"\x00\x05\x16\x07 resource fork")
    (data / "Maize" / "more").mkdir()
    shutil.copy(first, data / "Maize" / "more" / "another.png")
    train, val, classes, skipped = find_splits(data, val_fraction=0.3, seed=42)
    assert classes == sorted(p.name for p in (ODD_IMAGES.parent / "seedlings").iterdir())
    assert skipped == [data / "Maize" / "more"] and len(train["files"]) + len(val["files"]) == 85
    shutil.copy(first, data / "stray.png")  # an image beside the class folders: in no class, and said so
    assert find_splits(data, val_fraction=0.3, seed=42)[3] == [data / "stray.png", data / "Maize" / "more"]
    result = script("split_dataset.py", data, tmp_path / "split")
    assert result.returncode == 0, result.output
    assert ("left out 2 files that are not images, folders inside a class folder or images beside the class folders "
            f"(a class's images are those in its folder itself), e.g. {data / 'stray.png'}") in result.output, \
        result.output
    (data / "stray.png").unlink()
    # a class whose images are all in folders of its own, where the others hold theirs: not "--data_dir too high"
    grouped = shutil.copytree(data, tmp_path / "grouped", ignore=shutil.ignore_patterns("__MACOSX"))
    (grouped / "Maize" / "2019").mkdir()
    for path in (grouped / "Maize").glob("*.png"):
        path.rename(grouped / "Maize" / "2019" / path.name)
    with pytest.raises(UserError, match=re.escape(
            f"class folder {grouped / 'Maize'} has no images (.jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff), only "
            "folders (2019, more), where most other class folders hold their images: a class's images are read from "
            f"its folder itself, not from folders inside it. Move them up into {grouped / 'Maize'}, or make each of "
            "those folders a class of its own")):
        find_splits(grouped, val_fraction=0.3, seed=42)
    assert sorted(p.name for p in (tmp_path / "split" / "train").iterdir()) == classes
    # predict.py and export.py on the folder: its images, the one in the class's folder among them, not the forks
    found = find_images([data])
    assert len(found) == 86 and data / "Maize" / "more" / "another.png" in found
    assert not [p for p in found if "__MACOSX" in p.parts]
    # named twice (a folder and a file in it, the folder again): each once, at its first place, with a line
    result = script("predict.py", "--model_dir", tmp_path / "none", "--output", tmp_path / "p.csv",
                    data / "Maize" / first.name, data, f"{data}/./")
    assert result.returncode == 2  # no model: the images were listed first
    assert (f"left out {86 + 1} image(s) named more than once (e.g. {data / 'Maize' / first.name}): each is read "
            "once") in result.output, result.output
    assert find_images([first, data]) == [first, *(p for p in found if p != first)]


def test_a_mean_std_file_with_a_zero_std_is_refused_as_such(tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"mean": [0.5, 0.5, 0.5], "std": [0.2, 0.0, 0.2]}))
    result = script("train_seedlings.py", "--data_dir", ODD_IMAGES.parent / "seedlings", "--mean_std", stats,
                    "--output_dir", tmp_path / "run")
    assert_refused(result, "stds above 0", "A std of 0 means a channel has one value")
    assert "--lr" not in result.output


def test_the_peer_benchmark_refuses_a_careless_command_before_it_runs_anything(tmp_path):
    data = tmp_path / "seedlings"
    shutil.copytree(ODD_IMAGES.parent / "seedlings", data)
    cases = [(["seedlings", "--data_dir", tmp_path / "none"], f"{tmp_path / 'none'} not found (--data_dir)"),
             (["seedlings", "--data_dir", data, "--seed_script", data], "--seed_script is not used by the seedlings"),
             (["fashion_mnist", "--data_dir", data, "--peers_dir", data], "--peers_dir is not used by the fashion_mn"),
             (["fashion_mnist", "--data_dir", data], "train-images-idx3-ubyte.gz not found (--data_dir: the seed"),
             (["seedlings", "--data_dir", data, "--peers_dir", tmp_path], "timm_train.py not found (--peers_dir: tim"),
             (["seedlings", "--data_dir", data, "--work_dir", data / "work"], "--work_dir " + str(data / "work") +
              " is inside the input"),
             (["seedlings", "--data_dir", data, "--work_dir", data / "Maize" / "006196e1c.png"], "is inside the input")]
    (tmp_path / "file").write_text("not a folder")
    cases.append((["seedlings", "--data_dir", data, "--work_dir", tmp_path / "file"], "is a file: choose a folder"))
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "train-images-idx3-ubyte.gz").touch()  # only looked for before the seed script is
    cases += [(["seedlings", "--data_dir", tmp_path / "file"], f"{tmp_path / 'file'} is a file, not a folder"),
              (["fashion_mnist", "--data_dir", tmp_path / "idx", "--seed_script", tmp_path],
               f"{tmp_path} is a folder (--seed_script)")]  # it ran the benchmark, every run failing
    if not torch.cuda.is_available():
        cases.append((["seedlings", "--data_dir", data, "--device", "cuda"],
                      "--device cuda runs every script on one GPU, one process: this machine has no GPU that torch sees"))
    before = snapshot(data)
    for args, message in cases:
        assert_refused(script("benchmark_peers.py", *args), message)
    assert snapshot(data) == before


# ---- outputs never land on inputs ----

def test_an_output_dir_inside_the_data_is_refused(tmp_path):
    data = tmp_path / "seedlings"
    shutil.copytree(ODD_IMAGES.parent / "seedlings", data)
    before = snapshot(data)
    for output_dir in (data, data / "run"):
        result = script("train_seedlings.py", "--data_dir", data, "--output_dir", output_dir)
        assert_refused(result, f"--output_dir {output_dir} is inside the input {data}")
    assert snapshot(data) == before and sorted(p.name for p in data.iterdir()) == sorted(
        p.name for p in (ODD_IMAGES.parent / "seedlings").iterdir())


def test_an_output_in_a_runs_best_or_checkpoints_is_refused_and_a_folder_only_named_best_is_not(digits_run, tmp_path):
    """A run replaces its best/ whole at each better epoch and deletes its older checkpoints: a run, an evaluation or
    a CSV written in there would be lost with them, without a word."""
    before = snapshot(digits_run)
    best, checkpoint = digits_run / "best", sorted((digits_run / "checkpoints").glob("epoch_*"))[-1]
    for output_dir, said in ((best, f"is {best}, the best/ folder of a run"),
                             (best / "run", f"is inside {best}, the best/ folder of a run"),
                             (checkpoint / "run", f"is inside {checkpoint.parent}, the checkpoints/ folder of a run")):
        result = script("train_mnist.py", "--dataset", "digits", "--output_dir", output_dir)
        assert_refused(result, f"--output_dir {output_dir} {said}", "would be lost", "Choose a place outside it")
    assert_refused(script("evaluate.py", "--model_dir", best, "--output_dir", best / "evaluation"),
                   f"--output_dir {best / 'evaluation'} is inside {best}, the best/ folder of a run")
    assert_refused(script("predict.py", "--model_dir", best, "--output", best / "predictions.csv",
                          ODD_IMAGES.parent / "seedlings"), f"--output {best / 'predictions.csv'} is inside {best}")
    assert snapshot(digits_run) == before
    # a folder of the user's that is only named best, or a run's folder inside another run's, is no such folder
    shutil.copytree(digits_run, tmp_path / "outer")
    for output_dir in (tmp_path / "best" / "run", tmp_path / "outer" / "inner"):
        result = script("train_mnist.py", "--dataset", "digits", "--epochs", 1, "--output_dir", output_dir)
        assert result.returncode == 0, result.output
        assert (output_dir / "best" / "model.safetensors").is_file()


def test_split_dataset_refuses_a_target_inside_its_source(tmp_path):
    data = tmp_path / "seedlings"
    shutil.copytree(ODD_IMAGES.parent / "seedlings", data)
    before = snapshot(data)
    assert_refused(script("split_dataset.py", data, data / "split"), "target", "is inside the input")
    assert snapshot(data) == before


def test_split_dataset_refuses_a_source_that_is_already_split(tmp_path):
    for split in ("train", "val"):
        shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / "data" / split)
    assert_refused(script("split_dataset.py", tmp_path / "data", tmp_path / "split"), "already split into train/ and val/")
    assert not (tmp_path / "split").exists()


def test_split_dataset_link_across_filesystems_leaves_no_partial_target(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp folder")
    target = shm / f"split-test-{os.getpid()}"
    try:
        result = script("split_dataset.py", ODD_IMAGES.parent / "seedlings", target, "--link")
        assert_refused(result, "--link needs the source and the target on the same filesystem: drop --link")
        assert not target.exists() and not list(shm.glob(f".{target.name}*"))
        assert script("split_dataset.py", ODD_IMAGES.parent / "seedlings", target).returncode == 0  # the retry copies
        assert len(list(target.rglob("*.png"))) == len(list((ODD_IMAGES.parent / "seedlings").rglob("*.png")))
        # the benchmark tools' split (common.tools.split_once) links where it can and copies where it cannot
        from common.tools import split_once

        split, made = split_once(ODD_IMAGES.parent / "seedlings", shm / f"work-{os.getpid()}")
        assert made and sorted(p.relative_to(split) for p in split.rglob("*.png")) == sorted(
            p.relative_to(target) for p in target.rglob("*.png"))
    finally:
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(shm / f"work-{os.getpid()}", ignore_errors=True)


def test_an_output_dir_that_is_a_file_or_read_only_is_refused(tmp_path):
    (tmp_path / "file").write_text("notes")
    assert_refused(script("train_mnist.py", "--dataset", "digits", "--output_dir", tmp_path / "file"),
                   "is a file: choose a folder")
    seedlings = ODD_IMAGES.parent / "seedlings"  # the benchmarks' work folders too (two were tracebacks)
    for tool in (["benchmark_folders.py"], ["benchmark_hf.py", "--data_dir", seedlings], ["benchmark_accuracy.py",
                 "digits"], ["benchmark_peers.py", "seedlings", "--data_dir", seedlings]):
        assert_refused(script(*tool, "--work_dir", tmp_path / "file"),
                       f"error: --work_dir {tmp_path / 'file'} is a file: choose a folder (it is created if missing)")
    assert (tmp_path / "file").read_text() == "notes"
    (tmp_path / "scratch").symlink_to(tmp_path / "unmounted" / "scratch")  # it said "cannot write (File exists)"
    assert_refused(script("train_mnist.py", "--dataset", "digits", "--output_dir", tmp_path / "scratch"),
                   f"error: --output_dir {tmp_path / 'scratch'} is a link to {tmp_path / 'unmounted' / 'scratch'}, "
                   "which does not exist (a disk not mounted?): create that folder, or choose another --output_dir")
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", read_only]).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        assert_refused(script("train_mnist.py", "--dataset", "digits", "--output_dir", read_only / "run"),
                       "cannot write to --output_dir", "Read-only file system")
        assert_refused(script("benchmark_folders.py", "--work_dir", read_only / "work"),
                       f"error: cannot write to --work_dir {read_only / 'work'} (Read-only file system)")
        message = refused("split_dataset.py", seedlings, read_only / "split")  # not "free some space" there
        assert message == (f"error: cannot write {read_only / 'split'}: Read-only file system. Nothing half-written "
                           "was left. Make it writable, or choose a place you can write to, and run the command "
                           "again.\n"), message
    finally:
        subprocess.run(["umount", read_only])


@pytest.mark.slow
def test_data_on_a_read_only_filesystem_keeps_its_check_in_the_users_cache(tmp_path, cifar_jpegs, monkeypatch):
    """A cluster's shared datasets are often mounted read-only: the image check and the decode cache go into the
    user's cache folder instead ($XDG_CACHE_HOME), so that the next run maps them rather than decoding again (it was
    every run decoding, every process all of it); where that cannot be written either, a run decodes into memory."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root")
    data, cache = tmp_path / "ro", tmp_path / "cache"
    data.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", data]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    # matplotlib's font list stays where it is (it too follows XDG_CACHE_HOME, and would be built again)
    monkeypatch.setenv("MPLCONFIGDIR", os.environ.get("MPLCONFIGDIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "matplotlib"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    try:
        shutil.copytree(ODD_IMAGES.parent / "seedlings", data / "seedlings")
        shutil.copytree(cifar_jpegs, data / "cifar10")
        subprocess.run(["mount", "-o", "remount,ro", data], check=True)
        train = ("train_seedlings.py", "--data_dir", data / "seedlings", "--model", "test_resnet", "--image_size", 32,
                 "--epochs", 1, "--batch_size", 8)
        first = script(*train, "--output_dir", tmp_path / "seedlings")
        assert first.returncode == 0, first.output
        kept = user_cache_folder(data / "seedlings")
        assert kept.parent == cache / "image-classification" / "decode", kept
        assert (f"checked 59 images on 1 process(es) (59), kept in {kept / '.checked-train.json'}; decoded once for "
                "this machine into .checked-train-37px.npy\n" in first.output), first.output
        again = script(*train, "--output_dir", tmp_path / "seedlings-again")
        assert again.returncode == 0, again.output
        assert f"image check of 59 images read from {kept / '.checked-train.json'} (the files have not changed)\n" in (
            again.output), again.output
        assert "checked 59 images" not in again.output, again.output  # nothing decoded a second time
        trained = [load_file(tmp_path / run / "best" / "model.safetensors") for run in ("seedlings", "seedlings-again")]
        assert all(torch.equal(trained[0][name], trained[1][name]) for name in trained[0])  # the same images mapped

        # the cache folder cannot be made either (a file in its place: a read-only mode would not stop root)
        shutil.rmtree(cache / "image-classification")
        (cache / "image-classification").write_text("not a folder")
        cifar = script("train_cifar.py", "--data_dir", data / "cifar10", "--model", "test_resnet", "--epochs", 1,
                       "--max_steps", 2, "--batch_size", 16, "--output_dir", tmp_path / "cifar")
        assert cifar.returncode == 0, cifar.output
        assert (f"the decoded images could not be kept in {data / 'cifar10' / '.checked-train-32x32.npy'} (Read-only "
                "file system): decoded into memory for this run, by each process, and again by the next run\n"
                in cifar.output), cifar.output
        evaluated = script("evaluate.py", "--model_dir", tmp_path / "cifar", "--data_dir", data / "cifar10",
                           "--output_dir", tmp_path / "evaluation")
        assert evaluated.returncode == 0 and "(cifar10, test): 101 images" in evaluated.output, evaluated.output
    finally:
        subprocess.run(["umount", data])


# ---- checkpoints and best/ folders edited or damaged by hand ----

def write_checkpoint(folder, **state):
    folder.mkdir(parents=True)
    state = {"args": {}, "architecture": "mnist_convnet", "model_kwargs": {"num_classes": 10, "in_chans": 1},
             "epoch": 2, "batch": 0, "step": 20, "best_accuracy": 0.5, "lr_scheduler": {}, "num_processes": 1,
             **state}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def test_a_run_resumed_after_its_data_folder_changed_is_refused_before_a_step(tmp_path):
    """Photos added or removed between a stop and --resume latest: the order of samples and the LR schedule were
    drawn for the images the run had, so it would silently not go on as that run. Said; the same data resumes."""
    data = shutil.copytree(ODD_IMAGES.parent / "seedlings", tmp_path / "data")
    train = ["train_seedlings.py", "--data_dir", data, "--model", "test_resnet", "--image_size", 32, "--epochs", 2,
             "--batch_size", 8, "--val_fraction", 0.2, "--output_dir", tmp_path / "run"]
    assert script(*train).returncode == 0  # its epoch_001_end is kept: going back to it resumes epoch 2
    state = json.loads((tmp_path / "run" / "checkpoints" / "epoch_001_end" / "trainer_state.json").read_text())
    assert state["train_images"] == 68  # 85 images, 80% of each class
    added = data / "Maize" / "added.png"
    shutil.copy(sorted((data / "Maize").iterdir())[0], added)
    for _ in range(5):  # enough for the split to give the training set more images
        shutil.copy(added, data / "Maize" / f"added_{_}.png")
    result = script(*train, "--resume", tmp_path / "run" / "checkpoints" / "epoch_001_end")
    assert_refused(result, f"error: the training set has 72 images, but the run of checkpoint "
                           f"{tmp_path / 'run' / 'checkpoints' / 'epoch_001_end'} trained on 68: its order of samples "
                           "and LR schedule were drawn for those, so it cannot go on as that run")
    assert "epoch 2/2" not in result.output
    assert (tmp_path / "run" / "previous_run" / "checkpoints" / "epoch_002_end").is_dir()  # kept: nothing trained
    for extra in data.glob("Maize/added*.png"):  # the data as it was: the run goes on
        extra.unlink()
    assert script(*train, "--resume", "latest").returncode == 0


def test_a_hand_edited_trainer_state_is_named_not_a_traceback(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    write_checkpoint(checkpoints / "epoch_001_end")
    (checkpoints / "latest").write_text("epoch_001_end\n")
    assert find_checkpoint(tmp_path / "run", "latest")["step"] == 20
    for edit in ({"epoch": "two"}, {"step": -3}, {"args": None}, {"batch": 5}):  # batch 5 without its totals
        shutil.rmtree(checkpoints / "epoch_001_end")
        write_checkpoint(checkpoints / "epoch_001_end", **edit)
        with pytest.raises(UserError, match=r"trainer_state.json is damaged or not written by our training scripts"):
            find_checkpoint(tmp_path / "run", "latest")


def test_latest_naming_a_deleted_checkpoint_lists_the_ones_left(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    write_checkpoint(checkpoints / "epoch_001_end")
    (checkpoints / "latest").write_text("epoch_002_end\n")
    with pytest.raises(UserError, match=r"names epoch_002_end, which no longer exists. Pass one of .*epoch_001_end"):
        find_checkpoint(tmp_path / "run", "latest")


def test_a_meta_json_with_missing_or_wrong_keys_is_named(tmp_path):
    best = tmp_path / "best"
    best.mkdir()
    (best / "model.safetensors").write_bytes(b"")
    good = {"architecture": "mnist_convnet", "model_kwargs": {"num_classes": 3, "in_chans": 1},
            "class_names": ["a", "b", "c"], "image_size": [8, 8], "mean": [0.0], "std": [1.0]}
    for broken, problem in (({"class_names": None}, "class_names"), ({"image_size": [8]}, "image_size"),
                            ({"std": [0.0]}, "'std' is [0.0]"), ({"model_kwargs": {"num_classes": 3}}, "in_chans")):
        (best / "meta.json").write_text(json.dumps({**good, **broken}))
        with pytest.raises(UserError, match=rf"meta.json is not a model description .*{re.escape(problem)}"):
            load_best_model(best)
    del good["mean"]
    (best / "meta.json").write_text(json.dumps(good))
    with pytest.raises(UserError, match=r"'mean' is None"):
        load_best_model(best)


# ---- runs that a mistake must not cost (real training) ----

@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("digits") / "run"
    result = script("train_mnist.py", "--dataset", "digits", "--epochs", 1, "--output_dir", run)
    assert result.returncode == 0, result.output
    return run


@pytest.fixture
def finished_run(one_epoch_run, tmp_path):
    """A copy of a finished 1-epoch digits run, plus a file of the user's (a scheduler's log) in its folder."""
    run = shutil.copytree(one_epoch_run, tmp_path / "run")
    (run / "slurm-1234.out").write_text("the job's log\n")
    return run


@pytest.mark.slow
def test_overwrite_that_fails_before_training_loses_nothing(finished_run, idx_folder):
    before = snapshot(finished_run)
    write_idx(idx_folder / "t10k-labels-idx1-ubyte", np.full(450, 10, np.uint8))  # a damaged label file
    for args, message in ((["--dataset", "mnist", "--data_dir", finished_run.parent / "typo"], "no mnist IDX files"),
                          (["--dataset", "mnist", "--data_dir", idx_folder], "holds labels from 10 to 10"),
                          (["--dataset", "digits", "--resume", "latest"], "pass one of them")):
        result = script("train_mnist.py", *args, "--overwrite", "--output_dir", finished_run)
        assert_refused(result, message)
        assert snapshot(finished_run) == before


@pytest.mark.slow
def test_overwrite_that_fails_in_training_keeps_the_earlier_run_whole_in_previous_run(finished_run):
    before = snapshot(finished_run)
    result = script("train_mnist.py", "--dataset", "digits", "--lr", "1e6", "--overwrite", "--output_dir",
                    finished_run)
    assert_refused(result, "the loss became nan or inf", "previous_run")
    old_files = {name: digest for name, digest in before.items() if name != "slurm-1234.out"}
    assert snapshot(finished_run / "previous_run") == old_files
    # nothing of the old run is left at the top, half old and half new; the user's file did not move
    assert sorted(p.name for p in finished_run.iterdir()) == ["previous_run", "slurm-1234.out"]
    result = script("train_mnist.py", "--dataset", "digits", "--resume", "latest", "--output_dir", finished_run)
    assert_refused(result, f"{finished_run / 'previous_run'} holds what was set aside until a first checkpoint (the "
                           "run an --overwrite replaced, or the later checkpoints of a run resumed from an older one): "
                           "move its files back")


@pytest.mark.slow
def test_overwrite_that_succeeds_replaces_the_whole_run(finished_run):
    before = snapshot(finished_run)
    result = script("train_mnist.py", "--dataset", "digits", "--epochs", 2, "--overwrite", "--output_dir",
                    finished_run)
    assert result.returncode == 0, result.output
    after = snapshot(finished_run)
    assert not (finished_run / "previous_run").exists()
    assert after["slurm-1234.out"] == before["slurm-1234.out"]
    for name in ("metrics.jsonl", "curves.png", "confusion_matrix.png", "classification_report.txt",
                 "best/model.safetensors"):
        assert after[name] != before[name], name
    assert [json.loads(line)["epoch"] for line in (finished_run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.slow
def test_a_run_never_replaces_files_of_the_users_nor_starts_inside_another_runs_folders(finished_run, tmp_path):
    """A folder of the user's with files named as a run's outputs (their report.html, a best/ of photos, a dataset's
    test/) is refused, not written over; other files stay beside the run's, with a line. A run inside another run's
    own folders (previous_run/, logs/, ...) is refused: that run's next --overwrite would set it aside and delete it."""
    quick = ("--dataset", "digits", "--epochs", 1, "--max_steps", 2, "--no-find_label_issues")
    mine = tmp_path / "mine"
    (mine / "best").mkdir(parents=True)
    (mine / "best" / "photo.jpg").write_bytes(b"a photo")
    (mine / "report.html").write_text("my notes")
    before = snapshot(mine)
    for flags in ((), ("--overwrite",), ("--resume", "auto")):
        assert_refused(script("train_mnist.py", *quick, *flags, "--output_dir", mine),
                       f"--output_dir {mine} holds best, report.html, which no run wrote there", "move them away")
        assert snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["best", "report.html"]
    for inside in ("previous_run", "logs/tensorboard-run", "test"):
        nested = finished_run / inside
        assert_refused(script("train_mnist.py", *quick, "--output_dir", nested),
                       f"the {Path(inside).parts[0]}/ of the run in {finished_run}, which that run sets aside and "
                       "deletes with its other outputs when it is run again with --overwrite",
                       f"--output_dir {finished_run / 'runs' / nested.name}")
        assert not (finished_run / Path(inside).parts[0]).exists()
    runs = finished_run.parent  # a folder of runs (outputs/): not one more run among them
    assert_refused(script("train_mnist.py", *quick, "--output_dir", runs),
                   f"error: --output_dir {runs} is a folder of runs (run): give this run a folder of its own, e.g. "
                   f"--output_dir {runs / 'run-2'}")
    (mine / "best").rename(tmp_path / "photos")
    (mine / "report.html").rename(mine / "notes.html")
    result = script("train_mnist.py", *quick, "--output_dir", mine)
    assert result.returncode == 0, result.output
    assert (f"note: --output_dir {mine} already holds files of yours (notes.html): the run writes its outputs beside "
            "them and leaves them as they are") in result.output
    assert (mine / "notes.html").read_text() == "my notes" and (mine / "best" / "meta.json").is_file()


@pytest.mark.slow
def test_predict_never_writes_over_an_input_or_a_foreign_file(finished_run, tmp_path):
    images = tmp_path / "imgs"
    images.mkdir()
    for name in ("gray16.png", "rgba.png", "gray8.png"):
        shutil.copy(ODD_IMAGES / name, images)
    before = snapshot(images)
    best = ["--model_dir", finished_run / "best"]
    # `--output imgs/*.png` after the shell: the first image is the output, the rest the inputs
    assert_refused(script("predict.py", *best, "--output", images / "gray16.png", images / "rgba.png",
                          images / "gray8.png"), "its name must end in .csv", "shell glob")
    notes = tmp_path / "notes.csv"
    notes.write_text("my,own,table\n")
    assert_refused(script("predict.py", *best, "--output", notes, images), "exists and is not a CSV written by "
                   "predict.py", "--overwrite")
    assert notes.read_text() == "my,own,table\n"
    assert_refused(script("predict.py", *best, "--output", tmp_path / "missing" / "p.csv", images),
                   "the folder", "does not exist")
    assert_refused(script("predict.py", *best, "--output", images, images), "is a folder: give a file name")
    assert snapshot(images) == before
    # 16-bit and 8-bit versions of one image get the same prediction; a CSV of ours is replaced
    output = tmp_path / "p.csv"
    for _ in range(2):
        result = script("predict.py", *best, "--output", output, images)
        assert result.returncode == 0, result.output
    rows = {Path(line.split(",")[0]).name: line.split(",", 1)[1] for line in output.read_text().splitlines()[1:]}
    assert len(rows) == 3 and rows["gray16.png"] == rows["gray8.png"]


@pytest.mark.slow
def test_predict_with_no_readable_image_fails_and_writes_nothing(finished_run, tmp_path):
    images = tmp_path / "broken"
    images.mkdir()
    for name in ("truncated.png", "not_an_image.png"):
        shutil.copy(ODD_IMAGES / name, images)
    result = script("predict.py", "--model_dir", finished_run / "best", "--output", tmp_path / "p.csv", images)
    assert_refused(result, "none of the 2 images could be read", "truncated.png", "not_an_image.png")
    assert not (tmp_path / "p.csv").exists()
    piped = script("predict.py", "--model_dir", finished_run / "best", "--output", "-", images)  # nor a header
    assert_refused(piped, "none of the 2 images could be read", "standard output was not written")
    assert "file,class_1" not in piped.output


@pytest.mark.slow
def test_a_deleted_model_file_is_called_missing_not_corrupt(finished_run):
    (finished_run / "best" / "model.safetensors").unlink()
    result = script("predict.py", "--model_dir", finished_run / "best", "--output", finished_run / "p.csv",
                    ODD_IMAGES / "gray8.png")
    assert_refused(result, "model.safetensors is missing (deleted?)")
    checkpoint = sorted((finished_run / "checkpoints").glob("epoch_*"))[-1]
    (checkpoint / "model.safetensors").unlink()
    result = script("train_mnist.py", "--dataset", "digits", "--resume", checkpoint, "--output_dir", finished_run)
    assert_refused(result, f"checkpoint {checkpoint} is damaged: {checkpoint / 'model.safetensors'} is missing")

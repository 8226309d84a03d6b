"""Unit tests of the builders in common/: data sources, device transforms, models."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import UserError
from common.cifar import CIFAR10_CLASSES, build_cifar10, load_image_folder
from common.data import build_dataloader, preprocess
from common.folders import random_resized_crop
from common.mnist import build_digits, build_mnist, read_idx
from common.models import build_model
from conftest import FASHION_MNIST, REPO, refused, require, run_command, write_idx


# --- IDX / MNIST ---------------------------------------------------------------------------------

def test_read_idx_plain_and_gz_agree(tmp_path):
    array = np.random.default_rng(0).integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "a-idx3-ubyte", array)
    write_idx(tmp_path / "a-idx3-ubyte.gz", array)
    np.testing.assert_array_equal(read_idx(tmp_path / "a-idx3-ubyte"), array)
    np.testing.assert_array_equal(read_idx(tmp_path / "a-idx3-ubyte.gz"), array)


def test_read_idx_truncated_file_names_it(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte"
    write_idx(path, np.zeros((5, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match="train-images-idx3-ubyte is truncated"):
        read_idx(path)


def test_real_fashion_mnist_from_debian_package():
    require(FASHION_MNIST / "train-images-idx3-ubyte.gz", "apt-get install -y dataset-fashion-mnist")
    train, test = build_mnist(FASHION_MNIST, name="fashion_mnist")
    assert train.images.shape == (60000, 1, 28, 28) and train.images.dtype == torch.uint8
    assert test.images.shape == (10000, 1, 28, 28)
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert train.classes[0] == "T-shirt/top" and train.classes[9] == "Ankle boot"


def test_mnist_torchvision_layout(tmp_path, fashion_subset):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for path in fashion_subset.iterdir():
        (raw / path.name).write_bytes(path.read_bytes())
    train, test = build_mnist(tmp_path, name="fashion_mnist")
    assert (len(train), len(test)) == (2001, 1001)


def test_missing_mnist_names_paths_layouts_and_download(tmp_path):
    with pytest.raises(UserError) as error:
        build_mnist(tmp_path / "nowhere", name="mnist")
    message = str(error.value)
    assert str(tmp_path / "nowhere") in message and "train-images-idx3-ubyte" in message and "--download" in message


def test_digits_split_is_stratified_and_uint8():
    train, test = build_digits()
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (1, 8, 8)
    assert train.images.max() == 255 and train.images.dtype == torch.uint8
    counts = torch.bincount(test.labels)
    assert counts.min() >= 43 and counts.max() <= 46


@pytest.mark.parametrize("seed, test_fraction", [(42, 0.25), (0, 0.25), (7, 0.25), (3, 0.1), (5, 0.5)])
def test_digits_are_scikit_learns_images_and_split_read_without_importing_it(seed, test_fraction):
    """The same images in the same order as load_digits + train_test_split(stratify=...), which older runs and
    checkpoints were trained on, without scikit-learn's 2-3 s import on every process."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[:, None]
    expected = train_test_split(images, digits.target, test_size=test_fraction, random_state=seed,
                                stratify=digits.target)
    train, test = build_digits(test_fraction=test_fraction, seed=seed)
    for got, want in zip((train.images, test.images, train.labels, test.labels), expected):
        np.testing.assert_array_equal(got.numpy(), want)


def test_folder_splits_are_scikit_learns_train_test_split_and_a_split_too_small_is_refused():
    """split_dataset (folders, Hugging Face splits, --val_fraction) draws what train_test_split(stratify=...) drew
    before it (runs and checkpoints made then keep their images), and refuses where it raised."""
    from sklearn.model_selection import train_test_split

    from common.images import split_dataset

    rng = np.random.default_rng(0)
    for _ in range(60):
        classes = int(rng.integers(2, 15))
        labels = np.concatenate([np.arange(classes)] * 2 + [rng.integers(0, classes, int(rng.integers(0, 300)))])
        labels, fraction, seed = rng.permutation(labels).tolist(), float(rng.choice([0.05, 0.1, 0.3, 0.5, 0.9])), int(
            rng.integers(1000))
        try:
            expected = [sorted(part.tolist()) for part in train_test_split(
                np.arange(len(labels)), test_size=fraction, random_state=seed, stratify=labels)]
        except ValueError:
            with pytest.raises(UserError, match=r"cannot split \d+ images into train/val with --val_fraction .*: it "
                                                r"leaves \d+ (training|validation) images for \d+ classes, which need "
                                                r"one each\. (Raise|Lower) --val_fraction, or add images"):
                split_dataset(labels, val_fraction=fraction, seed=seed)
            continue
        assert list(split_dataset(labels, val_fraction=fraction, seed=seed)) == expected


def test_a_process_of_a_launch_imports_neither_scikit_learn_nor_datasets_it_does_not_use():
    """2-3 s each on every process: the digits are read (and folders split) without scikit-learn, Accelerate's
    preparing of a DataLoader for 2 processes no longer imports Hugging Face datasets to look for its
    IterableDataset, and the end of a run (the suspected labels, the classification report) imports neither
    cleanlab nor scikit-learn (about a second)."""
    code = ("import sys; import torch; from accelerate.data_loader import prepare_data_loader; "
            "import common.distributed; from common.mnist import build_digits; "
            "from common.images import split_dataset; "
            "train, test = build_digits(); split_dataset(train.labels.tolist(), val_fraction=0.3, seed=1); "
            "prepare_data_loader(torch.utils.data.DataLoader(test, batch_size=8), num_processes=2, process_index=1); "
            "print(sorted(m for m in ('sklearn', 'datasets') if m in sys.modules)); "
            "from common.mistakes import find_label_issues; "
            "scores = dict(probabilities=torch.eye(10)[test.labels].numpy() * 0.9 + 0.01, labels=test.labels.numpy(), "
            "indices=torch.arange(len(test)).numpy()); scores['labels'][:5] = (scores['labels'][:5] + 1) % 10; "
            "found = find_label_issues(scores, class_names=test.classes, split='test', trained_on=False); "
            "from common.reporting import classification_report; "
            "text, _ = classification_report(scores['labels'], scores['probabilities'].argmax(1), test.classes); "
            "print(found['flagged'], 'accuracy' in text, "
            "sorted(m for m in ('sklearn', 'datasets', 'cleanlab') if m in sys.modules))")
    result = run_command([sys.executable, "-c", code])
    assert result.returncode == 0, result.output
    assert result.stdout.splitlines()[-2:] == ["[]", "5 True []"], result.output


# --- CIFAR-10 sources ----------------------------------------------------------------------------

def write_cifar_batches(folder, train, test):
    """The official python-batch format, written from real images."""
    folder.mkdir(parents=True)
    for name, dataset in (("data_batch_1", train), ("test_batch", test)):
        entry = {b"data": dataset.images.reshape(len(dataset), -1).numpy(), b"labels": dataset.labels.tolist()}
        (folder / name).write_bytes(pickle.dumps(entry))


def test_cifar_folder_batches_archive_and_hf_give_the_same_pixels(tmp_path, cifar_jpegs):
    train, test = build_cifar10(cifar_jpegs)
    assert train.classes == CIFAR10_CLASSES
    assert train.images.shape == (151, 3, 32, 32) and test.images.shape == (101, 3, 32, 32)

    write_cifar_batches(tmp_path / "cifar-10-batches-py", train, test)
    from_batches = build_cifar10(tmp_path)
    (tmp_path / "archive").mkdir()
    with tarfile.open(tmp_path / "archive" / "cifar-10-python.tar.gz", "w:gz") as archive:
        archive.add(tmp_path / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    from_archive = build_cifar10(tmp_path / "archive")

    import datasets
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR10_CLASSES)})
    splits = datasets.DatasetDict({
        split: datasets.Dataset.from_dict(
            {"img": [Image.fromarray(x.permute(1, 2, 0).numpy()) for x in ds.images], "label": ds.labels.tolist()},
            features=features)
        for split, ds in (("train", train), ("test", test))})
    splits.save_to_disk(tmp_path / "hf")
    from_hf = build_cifar10(f"hf:{tmp_path / 'hf'}")
    # split_dataset.py's layout: train/ + val/
    shutil.copytree(cifar_jpegs / "train", tmp_path / "split" / "train")
    shutil.copytree(cifar_jpegs / "test", tmp_path / "split" / "val")
    from_split = build_cifar10(tmp_path / "split")

    for other_train, other_test in (from_batches, from_archive, from_hf, from_split):
        assert torch.equal(other_train.images, train.images) and torch.equal(other_train.labels, train.labels)
        assert torch.equal(other_test.images, test.images) and torch.equal(other_test.labels, test.labels)


def test_cifar_batches_refuse_code_in_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": print}))
    (folder / "test_batch").write_bytes(b"")
    with pytest.raises(UserError, match="data_batch_1 is not a readable CIFAR-10 batch file"):
        build_cifar10(tmp_path)


def test_missing_cifar_names_layouts_and_download(tmp_path):
    with pytest.raises(UserError) as error:
        build_cifar10(tmp_path)
    message = str(error.value)
    for expected in ("cifar-10-batches-py", "cifar-10-python.tar.gz", "train/<class>", "hf:", "--download"):
        assert expected in message


def test_image_folder_names_corrupt_image_and_empty_class(tmp_path, cifar_jpegs):
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    first = next((cifar_jpegs / "train" / "cat").iterdir())
    (tmp_path / "cat" / "good.jpg").write_bytes(first.read_bytes())
    with pytest.raises(UserError, match="class folder .*dog has no images"):
        load_image_folder(tmp_path, size=(32, 32))
    (tmp_path / "dog" / "broken.jpg").write_bytes(first.read_bytes()[:200])
    with pytest.raises(UserError, match="broken.jpg"):
        load_image_folder(tmp_path, size=(32, 32))


# --- batches and device transforms ---------------------------------------------------------------

def test_dataloader_fetches_whole_batches(cifar_jpegs):
    train, _ = build_cifar10(cifar_jpegs)
    batch = next(iter(build_dataloader(train, batch_size=64, shuffle=False)))
    assert batch["image"].shape == (64, 3, 32, 32) and batch["image"].dtype == torch.uint8
    assert torch.equal(batch["index"], torch.arange(64))
    assert torch.equal(batch["image"], train.images[:64])


@pytest.mark.parametrize("padding_mode", ["constant", "reflect"])
def test_preprocess_crops_are_shifted_windows_and_flips_mirror(padding_mode):
    torch.manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    out = (preprocess(images, normalize=((0, 0, 0), (1, 1, 1)), padding=2, padding_mode=padding_mode,
                      flip=True) * 255).round()
    padded = torch.nn.functional.pad(images.float(), (2, 2, 2, 2), mode=padding_mode)
    shifts = set()
    for i in range(len(images)):
        windows = {(dy, dx): padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)}
        matches = [(shift, flipped) for shift, window in windows.items() for flipped in (False, True)
                   if torch.equal(out[i], window.flip(2) if flipped else window)]
        assert matches, f"sample {i} is not a (flipped) crop of its padded image"
        shifts.update(matches)
    assert len(shifts) > 10, "crops and flips should differ between samples"


def test_preprocess_normalises():
    images = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    out = preprocess(images, normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    assert torch.allclose(out, torch.full_like(out, 2.0))


def erased_boxes(out):
    """Each sample's erased (== 0) pixels as (count, height, width of their bounding box), from channel 0."""
    boxes = []
    for mask in out[:, 0] == 0:
        rows, cols = mask.any(1).nonzero(), mask.any(0).nonzero()
        height = int(rows.max() - rows.min() + 1) if len(rows) else 0
        width = int(cols.max() - cols.min() + 1) if len(cols) else 0
        boxes.append((int(mask.sum()), height, width))
    return boxes


def test_cutout_erases_one_square_per_sample_at_the_mean_colour():
    torch.manual_seed(0)
    images = torch.full((256, 3, 32, 32), 200, dtype=torch.uint8)
    out = preprocess(images, normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), erase={"cutout": 16})
    assert ((out == 0) | out.isclose(torch.tensor((200 / 255 - 0.5) / 0.25))).all()  # erased: 0, the mean colour
    assert torch.equal(out[:, 0] == 0, out[:, 2] == 0)  # all channels of a pixel
    boxes = erased_boxes(out)
    assert all(count == height * width and 0 < height <= 16 and 0 < width <= 16 for count, height, width in boxes)
    assert sum(count == 256 for count, _, _ in boxes) > 50  # whole squares inside, clipped ones at the borders
    assert len({out[i, 0].eq(0).nonzero()[0].tolist()[0] for i in range(256)}) > 10  # at different places


def test_random_erasing_erases_a_rectangle_of_2_to_33_percent_in_a_share_of_the_samples():
    torch.manual_seed(0)
    images = torch.full((2000, 3, 32, 32), 200, dtype=torch.uint8)
    out = preprocess(images, normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), erase={"erasing": 0.25})
    boxes = erased_boxes(out)
    erased = [(count, height, width) for count, height, width in boxes if count]
    assert 0.21 < len(erased) / len(boxes) < 0.29
    assert all(count == height * width for count, height, width in erased)  # one whole rectangle, inside
    areas = [count / 1024 for count, _, _ in erased]
    assert min(areas) >= 0.015 and max(areas) <= 0.36 and 0.14 < sum(areas) / len(areas) < 0.21
    assert any(height > 2 * width for _, height, width in erased)  # aspect ratios from 0.3 to 3.3
    assert any(width > 2 * height for _, height, width in erased)


def test_device_random_resized_crop_maps_each_image_by_its_own_affine_map():
    torch.manual_seed(0)
    image = torch.arange(3 * 16 * 16).remainder(251).to(torch.uint8).view(1, 3, 16, 16)
    same_size = random_resized_crop(image.expand(64, -1, -1, -1), size=16, scale=(1, 1), ratio=(1, 1), degrees=0)
    variants = {"none": image[0], "h": image[0].flip(2), "v": image[0].flip(1), "hv": image[0].flip(1, 2)}
    seen = [next(name for name, want in variants.items() if torch.allclose(out, want.float(), atol=1e-3))
            for out in same_size]  # the whole image, exactly, mirrored or not
    assert set(seen) == set(variants)
    out = random_resized_crop(image.expand(64, -1, -1, -1), size=8)
    assert out.shape == (64, 3, 8, 8) and out.dtype == torch.float32 and out.min() >= 0 and out.max() <= 255
    assert len({tuple(o.flatten().round().tolist()) for o in out}) == 64  # a crop, flip and angle of its own
    quarter = random_resized_crop(image, size=16, scale=(1, 1), ratio=(1, 1), degrees=0)  # the RNG moved
    assert quarter.shape == (1, 3, 16, 16)


def test_residual_blocks_start_as_the_identity_unless_told_otherwise():
    from common.errors import UserError
    from common.models import build_model

    for name in ("resnet18_cifar", "test_resnet"):  # ours (torchvision's blocks) and a timm ResNet
        torch.manual_seed(0)
        identity = build_model(name, num_classes=10)
        torch.manual_seed(0)
        plain = build_model(name, num_classes=10, identity_start=False)
        last = {key for key, tensor in identity.state_dict().items()  # each block's last BatchNorm
                if ".bn" in key and key.endswith(".weight") and tensor.eq(0).all()}
        assert len(last) == {"resnet18_cifar": 8, "test_resnet": 4}[name]
        assert all(plain.state_dict()[key].eq(1).all() for key in last)
        assert all(torch.equal(tensor, plain.state_dict()[key])  # the same draw otherwise
                   for key, tensor in identity.state_dict().items() if key not in last)
    with pytest.raises(UserError, match=r"^--no-identity_start: --model mnist_convnet has no residual blocks"):
        build_model("mnist_convnet", num_classes=10, identity_start=False)
    with pytest.raises(UserError, match=r"^--no-identity_start: --model vit_tiny_patch16_224 has no residual blocks"):
        build_model("vit_tiny_patch16_224", num_classes=10, identity_start=False)


def test_the_device_transforms_make_every_tensor_on_the_batch_device():
    """The GPU path, checked on the meta device: a tensor made on the CPU beside the batch fails there as it fails
    on CUDA (Cutout's side once did, found only on an H100)."""
    from common.evaluation import probabilities

    images = torch.zeros(4, 3, 32, 32, dtype=torch.uint8, device="meta")
    normalize = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    for options in ({"padding": 4, "flip": True, "padding_mode": "reflect", "erase": {"cutout": 12}},
                    {"padding": 4, "flip": True, "erase": {"erasing": 0.5}}, {}):
        assert preprocess(images, normalize=normalize, **options).device.type == "meta"
    crops = random_resized_crop(images, size=16)
    assert crops.shape == (4, 3, 16, 16) and crops.device.type == "meta"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3, device="meta"), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten())
    for tta in ("none", "flip", "flip_translate"):
        assert probabilities(model, preprocess(images, normalize=normalize), tta=tta).shape == (4, 5)


def test_the_worker_augmentation_rotates_within_the_given_degrees_or_not_at_all():
    from torchvision.transforms import v2

    from common.folders import build_train_transform

    def rotations(transform):
        return [step.degrees for step in transform.transforms if isinstance(step, v2.RandomRotation)]

    assert rotations(build_train_transform(16)) == [[-30.0, 30.0]]  # the seedlings' default
    assert rotations(build_train_transform(16, degrees=10)) == [[-10.0, 10.0]]
    assert rotations(build_train_transform(16, degrees=0)) == []  # --rotation 0
    assert rotations(build_train_transform(16, "randaugment", geometry=False, degrees=30)) == []  # on the device


# --- models --------------------------------------------------------------------------------------

def test_resnet18_cifar_stem_keeps_resolution():
    model = build_model("resnet18_cifar", num_classes=10)
    assert (model.conv1.kernel_size, model.conv1.stride) == ((3, 3), (1, 1))
    assert isinstance(model.maxpool, torch.nn.Identity)
    features = model.layer1(model.relu(model.bn1(model.conv1(torch.zeros(2, 3, 32, 32)))))
    assert features.shape == (2, 64, 32, 32)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_mnist_convnet_layers_match_the_seed():
    model = build_model("mnist_convnet", num_classes=10, in_chans=1)
    convs = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride, c.bias is not None) for c in convs] == [
        (12, (3, 3), (1, 1), False), (24, (6, 6), (2, 2), False), (32, (6, 6), (2, 2), True)]
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Conv2d", "BatchNorm2d", "ReLU", "Conv2d", "BatchNorm2d", "ReLU", "Conv2d", "BatchNorm2d",
                     "ReLU", "AdaptiveAvgPool2d", "Flatten", "Linear", "ReLU", "Dropout", "Linear"]
    assert model[11].out_features == 256 and model[13].p == 0.5
    x = torch.zeros(3, 1, 28, 28)
    assert model[:3](x).shape == (3, 12, 28, 28)  # "same"
    assert model[:6](x).shape == (3, 24, 12, 12)  # valid, stride 2
    assert model[:9](x).shape == (3, 32, 6, 6)  # Keras "same", stride 2: ceil(12 / 2)
    assert model(x).shape == (3, 10) and model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_any_timm_model_by_name():
    model = build_model("resnet18", num_classes=12)
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 12)


@pytest.mark.parametrize("name", ["resnet18_cifar", "resnet18"])
def test_channels_last_model_computes_the_same_in_nhwc(name):
    torch.manual_seed(0)
    plain = build_model(name, num_classes=10).eval()
    fast = build_model(name, num_classes=10, channels_last=True).eval()
    fast.load_state_dict(plain.state_dict())
    convs = [m for m in fast.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        features = fast.layer1(fast.conv1(x))
        assert features.is_contiguous(memory_format=torch.channels_last)  # NHWC all the way, whatever the input
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-4)


def test_decoded_image_folder_is_cached_beside_the_data(tmp_path, cifar_jpegs, monkeypatch):
    import common.decode_cache

    root = tmp_path / "train"
    shutil.copytree(cifar_jpegs / "train", root)
    first = load_image_folder(root, size=(32, 32))
    assert (tmp_path / ".checked-train-32x32.npy").exists() and (tmp_path / ".checked-train.json").exists()

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded although the cache was valid")

    monkeypatch.setattr(common.decode_cache, "read_image", no_decoding)
    second = load_image_folder(root, size=(32, 32))
    assert torch.equal(second.images, first.images) and torch.equal(second.labels, first.labels)
    assert second.classes == first.classes

    monkeypatch.undo()  # a damaged cache is decoded again
    expected = first.images.clone()  # not the mapping of the file damaged below in place
    for damage in (lambda cache: os.truncate(cache, 1000), lambda cache: cache.write_text("not an array")):
        damage(tmp_path / ".checked-train-32x32.npy")
        assert torch.equal(load_image_folder(root, size=(32, 32)).images, expected)
    shutil.copy(next((root / "cat").iterdir()), root / "cat" / "zz_copy.jpg")  # a changed folder is decoded afresh
    assert len(load_image_folder(root, size=(32, 32))) == len(first) + 1


@pytest.mark.parametrize("helper_dies", [False, True])
def test_forked_helpers_decode_their_rows_into_the_cache_as_one_process_does(tmp_path, cifar_jpegs, monkeypatch,
                                                                             helper_dies):
    """Where a process has several cores, helper processes forked from it decode every n-th image into the cache:
    the same pixels and the same unreadable files, named, as one process alone; a helper that dies before it reports
    leaves its rows to the process that forked it."""
    import common.decode_cache
    from common.images import list_image_folder

    root = tmp_path / "train"
    shutil.copytree(cifar_jpegs / "train", root)
    (root / "cat" / "zz_broken.jpg").write_bytes(b"not a jpeg")
    files, *_ = list_image_folder(root)

    def decoded(cores, processes=1):
        for cache in tmp_path.glob(".checked-*"):
            cache.unlink()
        monkeypatch.setattr(common.decode_cache, "machine_share", lambda: (cores, processes))
        return common.decode_cache.check_images(files, skip_bad_images=True, record=tmp_path / ".checked-train.json",
                                                cache={"resize": [32, 32]})

    monkeypatch.setattr(common.decode_cache, "FORK_ROWS", 1)
    good, bad, alone = decoded(1)
    alone = alone.clone()
    crowded = decoded(2, 4)  # more processes than cores on the machine: this process decodes alone
    assert crowded[:2] == (good, bad) and torch.equal(crowded[2], alone)
    pids, reader = tmp_path / "pids", common.decode_cache.read_image

    def read_image(path, **kwargs):  # which processes decoded
        with open(pids, "a") as out:
            out.write(f"{os.getpid()}\n")
        return reader(path, **kwargs)

    monkeypatch.setattr(common.decode_cache, "read_image", read_image)
    if helper_dies:
        monkeypatch.setattr(common.decode_cache, "_helper", lambda *args: os._exit(1))
    helped = decoded(3)
    assert helped[:2] == (good, bad) and bad == [(root / "cat" / "zz_broken.jpg", "cannot identify image file "
                                                  f"{str(root / 'cat' / 'zz_broken.jpg')!r}")]
    assert torch.equal(helped[2], alone) and len(good) == len(files) - 1 == 151
    assert len(set(pids.read_text().split())) == (1 if helper_dies else 3)


def test_each_size_is_decoded_once_and_a_read_only_folders_own_check_is_read_first(tmp_path, cifar_jpegs, capsys):
    """A run at another --image_size decodes its own .npy, and the record keeps both: going back to the first size
    maps it (a record naming only the last size decoded every size change again). Where the data folder cannot be
    written, a check kept there (by whoever could write it) is read from there, and a size it lacks is decoded once
    into the user's cache, not into memory every run."""
    from common.decode_cache import check_images
    from common.images import list_image_folder

    files, *_ = list_image_folder(cifar_jpegs / "train")
    beside, cache = tmp_path / "data" / ".checked-train.json", tmp_path / "cache" / ".checked-train.json"
    beside.parent.mkdir(), cache.parent.mkdir()
    small, large = {"resize": 37, "center_crop": 32}, {"resize": 55, "center_crop": 48}

    def check(record, size):
        images = check_images(files, skip_bad_images=False, record=record, cache=size)[2].clone()
        return images, capsys.readouterr().out

    first, decoded = check(beside, small)
    assert "checked 151 images on 1 process(es) (151), kept in" in decoded and first.shape == (151, 3, 32, 32)
    assert "decoded once for this machine into .checked-train-55to48px.npy" in check(beside, large)[1]
    again, read = check(beside, small)
    assert read == f"image check of 151 images read from {beside} (the files have not changed)\n" and (
        torch.equal(again, first))
    assert json.loads(beside.read_text())["decoded"] == [".checked-train-37to32px.npy", ".checked-train-55to48px.npy"]

    beside.with_name(".checked-train-55to48px.npy").unlink()  # the folder's own check holds 32 px only now
    before = beside.read_text()
    assert check([beside, cache], small)[1] == f"image check of 151 images read from {beside} (the files have not " \
                                               "changed)\n"
    assert f"kept in {cache}; decoded once" in check([beside, cache], large)[1]
    assert check([beside, cache], large)[1] == f"image check of 151 images read from {cache} (the files have not " \
                                               "changed)\n"
    assert beside.read_text() == before  # read, never written
    assert sorted(path.name for path in cache.parent.iterdir()) == [".checked-train-55to48px.npy", cache.name]


def test_a_decode_interrupted_by_ctrl_c_leaves_no_half_written_cache_beside_the_data(tmp_path, cifar_jpegs,
                                                                                     monkeypatch):
    """The cache is written under a temporary name as big as the whole (185 MB for 45,000 CIFAR-10 images at 37 px):
    a Ctrl-C in the decode removes it (a killed run's is removed by the next run on the machine)."""
    import common.decode_cache
    from common.images import list_image_folder

    files, *_ = list_image_folder(cifar_jpegs / "train")
    reader, calls = common.decode_cache.read_image, []

    def read_image(path, **kwargs):
        calls.append(path)
        if len(calls) == 50:
            raise KeyboardInterrupt
        return reader(path, **kwargs)

    monkeypatch.setattr(common.decode_cache, "read_image", read_image)
    monkeypatch.setattr(common.decode_cache, "machine_share", lambda: (1, 1))
    record, cache = tmp_path / ".checked-train.json", {"resize": [32, 32]}
    with pytest.raises(KeyboardInterrupt):
        common.decode_cache.check_images(files, skip_bad_images=False, record=record, cache=cache)
    assert len(calls) == 50 and sorted(p.name for p in tmp_path.iterdir()) == []
    good, bad, images = common.decode_cache.check_images(files, skip_bad_images=False, record=record, cache=cache)
    assert len(good) == len(files) == 151 and not bad and images.shape == (151, 3, 32, 32)


def test_the_center_cropped_eval_transform_is_torchvisions_compose_pixel_for_pixel(cifar_jpegs):
    """build_eval_transform calls torchvision's functions instead of its v2.Compose (a fifth of the time per image):
    the same uint8 pixels, from a PIL image (RGB, grayscale) or a tensor, scaled up or down, square or not."""
    from torchvision.transforms import v2

    from common.images import build_eval_transform, read_image

    photo = read_image(next((cifar_jpegs / "train" / "cat").iterdir()))
    wide = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8))
    inputs = [photo, photo.convert("L"), wide, v2.functional.pil_to_tensor(wide)]
    for resize, crop in [(37, [32, 32]), (73, [64, 64]), (20, [16, 12]), ([48, 30], [48, 30])]:
        compose = v2.Compose([v2.ToImage(), v2.Resize(resize, antialias=True), v2.CenterCrop(crop), v2.ToPureTensor()])
        ours = build_eval_transform({"resize": resize, "center_crop": crop})
        for image in inputs:
            expected, got = compose(image), ours(image)
            assert type(got) is torch.Tensor and got.dtype == torch.uint8 and torch.equal(got, expected), resize


@pytest.mark.parametrize("threads, small", [(1, False), (2, True), (4, False)])
def test_the_decode_keeps_the_order_and_the_errors_on_one_thread_or_several(monkeypatch, threads, small):
    import common.decode_cache

    monkeypatch.setattr(common.decode_cache, "machine_share", lambda: (threads, 1))
    monkeypatch.setattr(common.decode_cache, "SMALL_IMAGE_S", 1.0 if small else 0.0)  # every image small, or none
    used = set()

    def decode(item):
        used.add(threading.get_ident())
        return OSError(f"bad {item}") if item % 50 == 7 else item * 2

    results = common.decode_cache._decode_all(decode, list(range(1000)), chunk=64)
    assert [r if isinstance(r, int) else str(r) for r in results] == [
        f"bad {i}" if i % 50 == 7 else i * 2 for i in range(1000)]
    assert (len(used) > 1) == (threads > 1 and not small)


def test_an_evaluations_samples_are_gathered_in_chunks_of_rows_each_once_bit_for_bit():
    """common.evaluation.gather_samples packs the columns after the indices into one int64 tensor and gathers its rows
    a chunk at a time; here a stand-in for 2 processes: this one holds the samples 4, 0, 2, 6, 8, 10, the other one
    row more (1, 3, 5, 7, 9, and 4 and 0 again, as the padding of its last batch), so this one's rows are padded to
    as many first, and a chunk is 3 rows. Every sample comes back once, in index order, with its values as they were:
    nan, -0.0, inf, subnormal floats, int64 past float64's 2^53 (a streamed image's id), bools, bf16 (as float32 and
    back), and a 2-D column."""
    from common.evaluation import gather_samples

    index, other_index = torch.tensor([4, 0, 2, 6, 8, 10]), torch.tensor([1, 3, 5, 7, 9, 4, 0])
    calls, sent = [], []  # the collectives (the row counts, then each chunk's rows); this process's rows as sent

    def gather(tensor):  # the other process: the values of this one's rows, its own indices (the first column)
        if tensor.dim() == 1:
            calls.append("row counts")
            return torch.cat([tensor, torch.tensor([7])])
        calls.append(len(tensor))
        start, other = sum(map(len, sent)), tensor.clone()
        sent.append(tensor)
        other[start + torch.arange(len(other)) == 6] = sent[0][0]  # its seventh row: where this one has padding
        other[:, 0] = other_index[start:start + len(other)]
        return torch.cat([tensor, other])

    floats = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 0.1, -3.5])
    ids = torch.tensor([2 ** 62 + 1, -1, 0, 2 ** 53 + 1, 7, 2 ** 63 - 1])
    flags = torch.tensor([True, False, True, True, False, False])
    halves = torch.tensor([0.1, 2.5, -1, 3, 0, 65504], dtype=torch.bfloat16)
    probs = torch.rand(6, 10)
    two = SimpleNamespace(num_processes=2, device=torch.device("cpu"), gather=gather)
    row_bytes = 15 * 8 * 2  # 15 int64 columns, 2 processes
    gathered = gather_samples(two, index, floats, ids, flags, halves, probs, chunk_bytes=3 * row_bytes)
    assert calls == ["row counts", 3, 3, 1] and sent[-1][0, 0] == -1  # this one's seventh row: no sample
    assert gathered[0].tolist() == list(range(11))
    rows = {int(i): row for i, row in zip(index, range(6))} | {int(i): row for i, row in zip(other_index[:5], range(5))}
    for column, back in zip((floats, ids, flags, halves, probs), gathered[1:]):
        expected = column[[rows[i] for i in range(11)]]
        assert back.dtype == column.dtype and back.shape == expected.shape
        same = back.view(torch.int16) == expected.view(torch.int16) if column.dtype == torch.bfloat16 else (
            back.view(torch.int32) == expected.view(torch.int32) if column.dtype == torch.float32 else back == expected)
        assert same.all(), column
    calls.clear(), sent.clear()
    assert gather_samples(two, index, probs)[0].tolist() == list(range(11)) and calls == ["row counts", 7]  # one chunk
    one = gather_samples(SimpleNamespace(num_processes=1), index, floats)  # one process: sorted by index as well
    assert one[0].tolist() == sorted(index.tolist()) and one[1][0].view(torch.int32) == floats[1].view(torch.int32)


def test_the_lr_follows_the_global_batch_unless_given():
    from common.optim import scale_lr

    assert scale_lr(None, base_lr=0.1, base_batch=128, global_batch=512, rule="linear")[0] == pytest.approx(0.4)
    lr, line = scale_lr(None, base_lr=1e-2, base_batch=64, global_batch=256, rule="sqrt")
    assert lr == pytest.approx(2e-2) and line.startswith("lr 0.02 = 0.01 x sqrt(256 / 64)")
    assert scale_lr(0.05, base_lr=0.1, base_batch=128, global_batch=512, rule="linear") == (0.05, "lr 0.05 (--lr, as given)")


@pytest.mark.parametrize("name", ["train_mnist.py", "train_cifar.py"])
def test_a_script_imports_only_what_its_start_needs(name):
    """timm, torchvision, scikit-learn and matplotlib take seconds to import on every process; the CIFAR and
    MNIST scripts need them only for --ema_decay, the model, evaluation and the reports, and import them there."""
    code = (f"import sys; sys.argv = ['{name}']; from conftest import load_script; load_script('{name}').parse_args([]); "
            "print(sorted(m for m in ('timm', 'torchvision', 'sklearn', 'matplotlib') if m in sys.modules))")
    result = run_command([sys.executable, "-c", code], cwd=REPO / "tests")
    assert result.returncode == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == "[]", result.output


@pytest.mark.parametrize("has_bf16, config, flag, expected", [
    (True, "bf16", None, "bf16"), (False, "bf16", None, "no"), (False, "bf16", "bf16", "bf16"), (True, "no", None, "no"),
    (True, None, None, "bf16"), (False, None, None, "no"), (True, None, "no", "no"), (False, "BF16", None, "no"),
    (True, None, "bf16", "bf16")])
def test_mixed_precision_on_a_cpu_follows_the_flag_the_config_and_the_cpus_bf16_instructions(has_bf16, config, flag,
                                                                                                expected, monkeypatch,
                                                                                                capsys):
    """The flag, else the accelerate config (what `accelerate launch` passes on as ACCELERATE_MIXED_PRECISION), else
    bf16 where the CPU computes it. accelerate_configs/cpu.yaml's bf16 becomes fp32, with one line, on a CPU
    without bf16 instructions (slower there); --mixed_precision bf16 forces it."""
    from accelerate.state import AcceleratorState, GradientState

    import common.distributed

    monkeypatch.setattr(common.distributed, "cpu_computes_bf16", lambda: has_bf16)
    monkeypatch.setattr(common.distributed, "cpu_has_bf16_instructions", lambda: has_bf16)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    if config:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", config)
    try:
        assert common.distributed.build_accelerator(mixed_precision=flag, cpu=True).mixed_precision == expected
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    said = capsys.readouterr().out
    fell_back = "the accelerate config asks for bf16, but this CPU has no bf16 instructions" in said
    assert fell_back == (config in ("bf16", "BF16") and expected == "no")
    forced = "note: --mixed_precision bf16 on a CPU whose PyTorch has no bf16 instructions to use" in said
    assert forced == (flag == "bf16" and not has_bf16)  # forced where it is emulated: said what it costs


def test_a_mixed_precision_set_by_hand_that_accelerate_does_not_know_is_one_message(tmp_path, monkeypatch):
    """ACCELERATE_MIXED_PRECISION exported by hand (a launcher checks its config's own): was Accelerate's traceback."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp64")
    message = refused("train_mnist.py", "--dataset", "digits", "--output_dir", tmp_path / "run")
    assert message.strip() == ("error: ACCELERATE_MIXED_PRECISION=fp64 is not a mixed precision Accelerate knows (no, "
                               "fp16, bf16, fp8): unset it, or pass --mixed_precision no, bf16 or fp16")
    assert not (tmp_path / "run").exists()


def test_pytorch_kept_to_avx2_counts_as_a_cpu_without_bf16_instructions():
    """ATEN_CPU_CAPABILITY=avx2 keeps PyTorch's kernels off the bf16 instructions the CPU may have: fp32 then, as
    on a CPU without them (how docs/tests.md times the suite for the AVX2-only kind on another), and the line
    that says so names the cause."""
    import common.distributed

    has = common.distributed.cpu_has_bf16_instructions()
    program = ("import sys; sys.path.insert(0, '.'); import torch; from common.distributed import *; "
               "print(torch.backends.cpu.get_cpu_capability(), cpu_computes_bf16()); "
               "print(*choose_mixed_precision(None, cpu=True), sep='\\n')")
    kept = run_command([sys.executable, "-c", program], env={"ATEN_CPU_CAPABILITY": "avx2",
                                                             "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert kept.returncode == 0 and kept.stdout.splitlines()[0].split() == ["AVX2", "False"], kept.output
    cause = "PyTorch is kept from this CPU's bf16 instructions (ATEN_CPU_CAPABILITY=avx2)" if has else \
        "this CPU has no bf16 instructions (AVX-512 BF16 or AMX)"
    assert kept.stdout.splitlines()[1:] == ["no", f"the accelerate config asks for bf16, but {cause}, where bf16 runs "
                                            "slower than fp32: running in fp32 (--mixed_precision bf16 forces it)"]
    kept_below = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2")
    assert common.distributed.cpu_computes_bf16() == (has and not kept_below)


def test_macro_f1_is_scikit_learns_with_absent_and_never_predicted_classes():
    from sklearn.metrics import f1_score

    from common.evaluation import macro_f1

    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        classes, samples = int(torch.randint(2, 15, (1,), generator=generator)), int(torch.randint(1, 60, (1,)))
        labels = torch.randint(0, classes, (samples,), generator=generator)
        predictions = (labels.clone() if trial % 3 == 0 else torch.zeros_like(labels) if trial % 3 == 1
                       else torch.randint(0, classes, (samples,), generator=generator))
        assert macro_f1(labels, predictions, num_classes=classes) == pytest.approx(
            f1_score(labels, predictions, average="macro", labels=range(classes), zero_division=0), abs=1e-6)


def test_micro_batches_are_the_same_global_steps_on_any_process_count():
    """8 x 1, 4 x 2, 2 x 4 and 1 x 8 (processes x accumulation steps) train the same micro-batches in each optimizer
    step, and a resumed epoch goes on at the same one, whichever count wrote the checkpoint."""
    from common.data import MicroBatches

    def steps(processes, accumulation, start=0):
        """Each optimizer step of epoch 3 as its set of micro-batches (tuples), and their global indices."""
        per_process = []
        for rank in range(processes):
            accelerator = SimpleNamespace(process_index=rank, num_processes=processes,
                                          gradient_accumulation_steps=accumulation)
            sampler = MicroBatches(1000, batch_size=10, seed=7, accelerator=accelerator)
            sampler.set_epoch(3, start=start)
            batches = list(sampler)
            assert len(batches) == len(sampler) and all(len(batch) == 10 for batch in batches)
            per_process.append([(sampler.micro_batch(i), tuple(batch)) for i, batch in enumerate(batches)])
        return [sorted(sum((mine[step * accumulation:(step + 1) * accumulation] for mine in per_process), []))
                for step in range(len(per_process[0]) // accumulation)]

    reference = steps(1, 8)
    assert len(reference) == 12  # 100 micro-batches of 10 make 12 steps of 8; the last 4 are left out this epoch
    assert [index for index, _ in sum(reference, [])] == list(range(96))  # micro-batches 0-95, in order
    samples = [i for step in reference for _, batch in step for i in batch]
    assert len(set(samples)) == len(samples) == 960
    for processes, accumulation in ((8, 1), (4, 2), (2, 4)):
        assert steps(processes, accumulation) == reference
        assert steps(processes, accumulation, start=5 * 8) == reference[5:]  # resumed after 5 steps
    other_epoch = MicroBatches(1000, batch_size=10, seed=7, accelerator=SimpleNamespace(
        process_index=0, num_processes=1, gradient_accumulation_steps=8))
    other_epoch.set_epoch(4)
    assert [tuple(batch) for batch in other_epoch] != [batch for step in reference for _, batch in step]


def test_no_function_in_common_takes_more_than_six_parameters():
    """What travels together is passed together: no function or method of common/ takes more than 6 parameters from
    its caller (a method's self or cls is not one)."""
    import ast

    crowded = []
    for source in sorted((REPO / "common").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
                count = len(names) - (names[:1] in (["self"], ["cls"])) + bool(arguments.vararg) + bool(arguments.kwarg)
                if count > 6:
                    crowded.append(f"{source.name}:{node.lineno} {node.name} ({count})")
    assert not crowded, crowded


def test_a_process_start_is_read_to_the_clock_tick_not_to_the_boot_times_whole_second():
    """The start-up and wind-down lines count from the launcher's start; psutil's create_time put it up to a second
    early (the boot time in whole seconds), so a run said it took up to 1 s more than it did."""
    import psutil

    from common.run import started_at

    before = time.time()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = started_at(psutil.Process(process.pid))
        assert before - 0.02 <= started <= time.time(), (before, started, psutil.Process(process.pid).create_time())
    finally:
        process.kill()
        process.wait()

"""MNIST and Fashion-MNIST (the four IDX files) and scikit-learn's 8x8 digits, in memory."""

import gzip
from pathlib import Path

import numpy as np
import torch

from .data import InMemoryDataset, check_labels, download_dataset
from .decode_cache import decode_split
from .errors import UserError
from .images import archive_note, stratified_split
from .hf import find_hf_splits, is_hf

MNIST_CLASSES = [str(digit) for digit in range(10)]
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
IDX_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
TORCHVISION_FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}
# the first ten labels of each official 60,000-image training set: which of the two a folder holds
FIRST_LABELS = {"mnist": [5, 0, 4, 1, 9, 2, 1, 3, 1, 4], "fashion_mnist": [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]}
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # apt-get install dataset-fashion-mnist


def read_idx(path):
    """An IDX file (gzipped or not) as a numpy uint8 array of the shape its header gives."""
    path = Path(path)
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as error:  # not gzip, or a .gz cut short
        raise UserError(f"{path} is damaged ({error}): fetch it again (--download into a new --data_dir)") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise UserError(f"{path} is not an unsigned-byte IDX file (bad header): fetch it again")
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise UserError(f"{path} is truncated or corrupt: header says {shape}, file holds {body.size} values")
    return body.reshape(shape)


def _find_idx(folder, stem):
    # the original files use '-idx3-ubyte'; some mirrors write '.idx3-ubyte'
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def build_mnist(data_dir, *, name="mnist", download=False, accelerator=None, hf_options=None):
    """(train, test) InMemoryDatasets for `mnist` or `fashion_mnist` from the four IDX files, or from a Hugging Face
    dataset (`hf:NAME_OR_PATH`: its images decoded once to 28x28 grayscale, its classes its own).

    Looks in `data_dir`, `data_dir/raw` and the torchvision layout `data_dir/MNIST/raw` (or FashionMNIST),
    nowhere else: a mistyped --data_dir must not train on other files.
    """
    if is_hf(data_dir):
        train, test, _, _ = find_hf_splits(data_dir, val_fraction=None, seed=None, options=hf_options)
        return tuple(decode_split(split, size=(28, 28), channels=1, accelerator=accelerator) for split in (train, test))
    root = Path(data_dir)
    folder = TORCHVISION_FOLDERS[name]
    candidates = [root, root / "raw", root / folder / "raw"]
    found = next((c for c in candidates if _find_idx(c, IDX_FILES["train_images"])), None)
    if found is None and download:
        download_dataset(folder, root)
        found = root / folder / "raw"
    if found is None and root.is_file() and _find_idx(root.parent, IDX_FILES["train_images"]):
        raise UserError(f"--data_dir {root} is a file, and its folder holds the IDX files: pass --data_dir "
                        f"{root.parent}")
    if found is None:
        archive = archive_note(root) if root.is_file() else ""
        raise UserError(
            f"no {name} IDX files found{archive}; tried {', '.join(str(c) for c in candidates)}. Accepted layouts: "
            "a folder with train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
            f"t10k-labels-idx1-ubyte (each optionally .gz), or torchvision's {root}/{folder}/raw/. Add --download "
            "to fetch them (needs internet)" + (f"; on Debian: apt-get install dataset-fashion-mnist, then --data_dir "
                                  f"{DEBIAN_FASHION_MNIST}." if name == "fashion_mnist" else ".")
        )
    arrays, paths = {}, {}
    for key, stem in IDX_FILES.items():
        paths[key] = _find_idx(found, stem)
        if paths[key] is None:
            raise UserError(f"{found} has train-images-idx3-ubyte but lacks {stem} (or {stem}.gz)")
        arrays[key] = read_idx(paths[key])
        wanted = 3 if key.endswith("images") else 1
        if arrays[key].ndim != wanted:
            raise UserError(f"{paths[key]} holds {'labels' if arrays[key].ndim == 1 else 'images'} of shape "
                            f"{list(arrays[key].shape)}, not {key.split('_')[1]}: are the files swapped or misnamed?")
    if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise UserError(f"the training images in {found} are {arrays['train_images'].shape[1:]} pixels but the test "
                        f"images are {arrays['test_images'].shape[1:]}: both must come from the same dataset")
    labels = arrays["train_labels"]
    other = next((kind for kind, first in FIRST_LABELS.items() if kind != name and len(labels) == 60000
                  and labels[:10].tolist() == first), None)
    if other:  # else the images would be trained and reported under the other set's class names
        raise UserError(f"{found} holds the {other} files (their labels begin as that set's do), and --dataset "
                        f"{name} would name their classes as {name}'s: pass --dataset {other}")
    classes = FASHION_MNIST_CLASSES if name == "fashion_mnist" else MNIST_CLASSES

    def dataset(split):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if len(images) != len(labels):
            raise UserError(f"{paths[f'{split}_images']} holds {len(images)} images but {paths[f'{split}_labels']} "
                            f"{len(labels)} labels")
        check_labels(labels, classes, source=paths[f"{split}_labels"])
        return InMemoryDataset(torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.copy()), classes)

    return dataset("train"), dataset("test")


def build_digits(*, test_fraction=0.25, seed=42):
    """scikit-learn's bundled 1,797 8x8 digits (offline), split stratified into (train, test): the file and the split
    of `load_digits` and `train_test_split(..., stratify=labels)`, read without importing scikit-learn, which takes
    2-3 s on every process of a launch (tests/test_builders.py holds the two to the same images)."""
    import importlib.util

    sklearn = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    table = np.loadtxt(sklearn / "datasets" / "data" / "digits.csv.gz", delimiter=",")  # 64 pixels 0..16, the label
    images = np.round(table[:, :-1].reshape(-1, 1, 8, 8) * (255 / 16)).astype(np.uint8)
    labels = table[:, -1].astype(np.int64)
    train, test = stratified_split(labels, test_fraction=test_fraction, seed=seed)
    return (InMemoryDataset(torch.from_numpy(images[train]), torch.from_numpy(labels[train]), MNIST_CLASSES),
            InMemoryDataset(torch.from_numpy(images[test]), torch.from_numpy(labels[test]), MNIST_CLASSES))


# for scripts/evaluate.py: each dataset by the name describe_model records, as (data_dir, seed) -> (train, test);
# the digits are split by the training run's seed
DATASETS = {
    "mnist": lambda data_dir, seed: build_mnist(data_dir, name="mnist"),
    "fashion_mnist": lambda data_dir, seed: build_mnist(data_dir, name="fashion_mnist"),
    "digits": lambda data_dir, seed: build_digits(seed=seed),
}

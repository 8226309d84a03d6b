"""CIFAR-10 in memory: the official python batches, their .tar.gz, an ImageFolder tree or a Hugging Face dataset."""

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import torch

from .data import InMemoryDataset, check_labels, download_dataset
from .decode_cache import decode_split
from .errors import UserError
from .hf import find_hf_splits, is_hf
from .images import (IMAGE_EXTENSIONS, archive_note, check_classes, check_same_classes, folder_entries,
                     list_image_folder)

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def build_cifar10(data_dir, *, download=False, accelerator=None, hf_options=None):
    """(train, test) InMemoryDatasets from the python batches, their .tar.gz, an ImageFolder tree (train/ and
    test/ or val/) or a Hugging Face dataset (`hf:NAME_OR_PATH`, its splits and columns chosen by `hf_options`);
    images from files decoded once, shared out among the `accelerator`'s processes."""
    if is_hf(data_dir):
        train, test, _, _ = find_hf_splits(data_dir, val_fraction=None, seed=None, options=hf_options)
        return tuple(decode_split(split, size=(32, 32), accelerator=accelerator) for split in (train, test))
    root = Path(data_dir)
    found = _find_cifar10(root)
    if download and (found is None or found == ("archive", root / "cifar-10-python.tar.gz")
                     and not tarfile.is_tarfile(found[1])):  # torchvision replaces an archive whose checksum is wrong
        download_dataset("CIFAR10", root)
        found = _find_cifar10(root)
    if found is None:
        cifar100 = _find_cifar100(root)
        if cifar100:
            raise _not_cifar10(cifar100)
        archive = archive_note(root) if root.is_file() else ""  # a zip of the JPEG tree, say
        whole = root.parent  # --data_dir DIR/train, one level too deep
        if root.name in ("train", "test", "val") and _find_cifar10(whole) == ("folder", whole):
            raise UserError(f"no CIFAR-10 found at {root}: it is a split of the ImageFolder tree {whole}, which the "
                            f"script reads whole (train/ to train, the other to test): pass --data_dir {whole}")
        images = root / "train" if (root / "train").is_dir() else root  # class folders, no held-out split beside
        if root.is_dir() and _holds_class_folders(images):
            base = root.parent if root.name == "train" else root
            split = base.with_name(f"{base.name}-split")
            raise UserError(f"no CIFAR-10 found at {root}: {images} holds class folders but nothing beside them to "
                            f"test on (test/ or val/). Hold some out: python scripts/split_dataset.py {images} {split} "
                            f"--val_fraction 0.1 (stratified), then --data_dir {split}")
        raise UserError(
            f"no CIFAR-10 found at {root}{archive}. Accepted layouts: {root}/cifar-10-batches-py/ (the official python "
            f"batches), {root}/cifar-10-python.tar.gz, an ImageFolder tree {root}/train/<class>/*.jpg + "
            f"{root}/test/<class>/*.jpg (or val/, as scripts/split_dataset.py writes), or --data_dir "
            "hf:NAME_OR_PATH for a Hugging Face dataset. Add --download to fetch the official batches (needs internet)."
        )
    kind, path = found
    if kind == "folder":
        held_out = _held_out_folder(path)
        listed = {folder: list_image_folder(folder) for folder in (path / "train", held_out)}  # before any decode
        check_classes(listed[path / "train"][2], path / "train")
        check_same_classes(listed[path / "train"][2], path / "train", listed[held_out][2], held_out)
        return tuple(load_image_folder(folder, size=(32, 32), accelerator=accelerator, listed=listing)
                     for folder, listing in listed.items())
    return _cifar10_from_batches(kind, path)


def _holds_class_folders(folder):
    """Whether `folder`'s first folder holds images (a class of an ImageFolder tree, not a dataset of a data/)."""
    classes = sorted(name for name, kind in folder_entries(folder) if kind == "dir")
    return bool(classes) and any(kind == "file" and Path(name).suffix.lower() in IMAGE_EXTENSIONS
                                 for name, kind in folder_entries(folder / classes[0]))


def _held_out_folder(folder):
    """folder/test, else folder/val (what scripts/split_dataset.py writes), else None."""
    return next((folder / name for name in ("test", "val") if (folder / name).is_dir()), None)


CIFAR100_FILES = ("train", "test", "meta")  # its python files, in cifar-100-python/ (and its .tar.gz)


def _find_cifar100(root):
    """Where `root` holds CIFAR-100's python files or its archive (a user's likely other download), or is one of
    those files, else None."""
    for folder in (root / "cifar-100-python", root, *([root.parent] if root.name in CIFAR100_FILES else [])):
        if all((folder / name).is_file() for name in CIFAR100_FILES):
            return folder
    archive = root / "cifar-100-python.tar.gz"
    return archive if archive.is_file() else None


def _not_cifar10(where):
    return UserError(f"{where} is CIFAR-100 (its python files train, test and meta), not CIFAR-10, whose batches this "
                     "script reads: give CIFAR-100 as a folder tree of its images (train/<class>/*.png + "
                     "test/<class>/*.png: a tree trains with any number of classes), or as a Hugging Face dataset "
                     "(--data_dir hf:NAME_OR_PATH --label_column fine_label)")


def _find_cifar10(root):
    for batches in (root / "cifar-10-batches-py", root):
        if (batches / "data_batch_1").is_file():
            return "batches", batches
    for archive in (root / "cifar-10-python.tar.gz", root):
        if archive.is_file() and archive.name.endswith((".tar.gz", ".tgz")):
            return "archive", archive
    for folder in (root, root / "cifar10"):
        if (folder / "train").is_dir() and _held_out_folder(folder):
            return "folder", folder
    return None


class _ArrayUnpickler(pickle.Unpickler):
    """The CIFAR batches are pickles: allow numpy arrays and builtins only, never arbitrary code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("builtins", "bytes")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR-10 batch file")
        return super().find_class(module, name)


def _read_batch(data, name):
    try:
        entry = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
        images = np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        return images, np.asarray(entry[b"labels"], dtype=np.int64)
    except Exception as error:
        raise UserError(f"{name} is not a readable CIFAR-10 batch file ({error})") from None


def _cifar10_from_batches(kind, path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if kind == "batches":
        present = [name for name in names if (path / name).is_file()]
        files = {name: (path / name).read_bytes() for name in present}
    else:
        try:
            with tarfile.open(path) as archive:
                members = [m for m in archive.getmembers() if m.isfile()]
                files = {Path(m.name).name: archive.extractfile(m).read()
                         for m in members if Path(m.name).name in names}
        except (tarfile.TarError, OSError, EOFError) as error:
            raise UserError(f"cannot read {path} as a .tar.gz of CIFAR-10 batches ({error}): it is damaged or "
                            "not the CIFAR-10 archive. Delete it and run with --download, or point --data_dir at "
                            "another copy") from None
        if not files and {Path(m.name).name for m in members} >= set(CIFAR100_FILES):
            raise _not_cifar10(path)
    train_names = [name for name in names[:5] if name in files]
    if not train_names or "test_batch" not in files:
        raise UserError(f"{path} lacks CIFAR-10 batch files: need data_batch_1..5 and test_batch, "
                        f"found {sorted(files)}")
    train = [_read_batch(files[name], f"{path}/{name}") for name in train_names]
    test = _read_batch(files["test_batch"], f"{path}/test_batch")

    def dataset(images, labels):
        check_labels(labels, CIFAR10_CLASSES, source=path)
        return InMemoryDataset(torch.from_numpy(images), torch.from_numpy(labels), CIFAR10_CLASSES)

    return (dataset(np.concatenate([b[0] for b in train]), np.concatenate([b[1] for b in train])),
            dataset(*test))


def load_image_folder(root, *, size, accelerator=None, listed=None):
    """A `root/<class>/<image>` tree (`listed`: its list_image_folder, if made already) as an InMemoryDataset of RGB
    images resized to `size` (PIL bilinear), decoded once into the decode cache beside it
    (ROOT/../.checked-NAME-HxW.npy, shared out among the `accelerator`'s processes): CIFAR-10's 60,000 JPEGs are
    read back in a second the next time."""
    root = Path(root)
    files, labels, classes, _ = listed or list_image_folder(root)
    return decode_split({"files": files, "labels": labels, "classes": classes, "root": root.parent,
                         "name": root.name}, size=size, accelerator=accelerator)


# for scripts/evaluate.py: each dataset by the name describe_model records, as (data_dir, seed) -> (train, test)
DATASETS = {"cifar10": lambda data_dir, seed: build_cifar10(data_dir)}

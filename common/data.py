"""Datasets that fit in memory (CIFAR-10, MNIST, Fashion-MNIST, scikit-learn digits).

Each is decoded once into a uint8 tensor (N, C, H, W). The DataLoader fetches a whole batch with one
index operation (`__getitems__`), so there is no per-sample decode, `ToTensor` or collate; the uint8
batch moves to the device and `preprocess` crops, flips and normalises it there, per sample random.
It is still a plain DataLoader, so `accelerator.prepare` shards it, seeds it and can skip batches.
"""

import gzip
import hashlib
import io
import math
import pickle
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import UserError
from .images import check_classes, convert_image, list_image_folder, read_image, split_dataset
from .outputs import write_if_possible

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MNIST_CLASSES = [str(digit) for digit in range(10)]
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


class InMemoryDataset(torch.utils.data.Dataset):
    """uint8 images (N, C, H, W) and int64 labels; batches come out as dicts with image, label and index.
    `rows`: the row of `images` that holds each sample, where `images` holds more (a folder's memory-mapped
    cache keeps a row for every file listed, unreadable ones included)."""

    def __init__(self, images, labels, classes, *, rows=None):
        assert images.dtype == torch.uint8 and images.ndim == 4 and len(labels) == len(images if rows is None else rows)
        self.images, self.labels, self.classes = images.contiguous(), labels.long(), list(classes)
        self.rows = None if rows is None else torch.as_tensor(rows, dtype=torch.long)

    @property
    def image_size(self):
        return tuple(self.images.shape[2:])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.__getitems__([index])

    def relabelled(self, classes):
        """This dataset with its labels numbered as `classes` (which hold all of its own), the same images."""
        to_new = torch.tensor([list(classes).index(name) for name in self.classes])
        return InMemoryDataset(self.images, to_new[self.labels], classes, rows=self.rows)

    def __getitems__(self, indices):
        # one gather for the whole batch; the DataLoader calls this instead of __getitem__ per sample.
        # index_select copies whole rows: 6x the speed of images[index], which indexes element by element
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = index if self.rows is None else self.rows[index]
        return {"image": self.images.index_select(0, rows), "label": self.labels[index], "index": index}


def hold_out(dataset, *, fraction, seed):
    """(train, validation) InMemoryDatasets: a stratified share `fraction` of `dataset` set aside to choose
    the best epoch on (--val_fraction), the same on every process and every run of that seed."""
    train, val = split_dataset(dataset.labels.tolist(), val_fraction=fraction, seed=seed, classes=dataset.classes)
    return tuple(InMemoryDataset(dataset.images[part], dataset.labels[part], dataset.classes) for part in (train, val))


def _keep_as_is(batch):
    return batch


def build_dataloader(dataset, *, batch_size, shuffle, drop_last=False, sampler=None):
    """A DataLoader over an InMemoryDataset; the batch is already built, so collation is the identity.
    `sampler` (a ClassBalancedSampler) replaces the shuffle.

    The loader gets a generator of its own: without one, starting each pass draws from the global RNG, which
    the augmentation and dropout use, and a run resumed mid-epoch would no longer draw the same numbers.
    (Accelerate's seedable sampler reseeds it from (seed, epoch) for the shuffle.)
    With a GPU the batches are pinned, so that Accelerate's non-blocking copy (build_accelerator) does not
    make the host wait for the device at every batch.
    """
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None,
                                       sampler=sampler, drop_last=drop_last, collate_fn=_keep_as_is,
                                       generator=torch.Generator(), pin_memory=torch.cuda.is_available())


def preprocess(images, *, normalize, padding=0, flip=False, cutout=0, erasing=0.0):
    """uint8 (N, C, H, W) on any device -> float normalised by `normalize` (mean, std: a value per channel); per
    sample random: crop (zero padding) and flip,
    then a Cutout square of side `cutout` (DeVries & Taylor 2017: its center anywhere in the image, so part
    of it may fall outside) and, with probability `erasing`, a random erasing rectangle (Zhong et al. 2017, as
    torchvision's RandomErasing: 2-33% of the area, aspect ratio 0.3-3.3). Erased pixels are 0 after
    normalisation, the mean colour. No Python loop over the batch."""
    n, _, height, width = images.shape
    device = images.device
    if padding or flip:
        # one gather does both: each sample's crop window, its columns read backwards when it is mirrored
        padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
        dy = torch.randint(0, 2 * padding + 1, (n, 1), device=device)
        dx = torch.randint(0, 2 * padding + 1, (n, 1), device=device)
        cols = torch.arange(width, device=device).expand(n, width)
        if flip:
            cols = torch.where(torch.rand(n, 1, device=device) < 0.5, width - 1 - cols, cols)
        rows = (dy + torch.arange(height, device=device))[:, :, None]
        batch = torch.arange(n, device=device)[:, None, None]
        images = padded[batch, :, rows, (dx + cols)[:, None, :]].permute(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
    # (x / 255 - mean) / std as one multiply and one add
    mean, std = (torch.tensor(values, device=device).view(1, -1, 1, 1) for values in normalize)
    images = images.float().mul_(1 / (255 * std)).sub_(mean / std)
    if cutout:
        center_y, center_x = torch.randint(0, height, (n,), device=device), torch.randint(0, width, (n,), device=device)
        images = _erase(images, center_y - cutout // 2, center_x - cutout // 2, cutout, cutout)
    if erasing:
        area = torch.empty(n, device=device).uniform_(0.02, 1 / 3) * height * width
        ratio = torch.empty(n, device=device).uniform_(math.log(0.3), math.log(1 / 0.3)).exp()
        box_h = (area * ratio).sqrt().round().long().clamp(1, height)
        box_w = (area / ratio).sqrt().round().long().clamp(1, width)
        top = (torch.rand(n, device=device) * (height - box_h + 1)).long()
        left = (torch.rand(n, device=device) * (width - box_w + 1)).long()
        erased = torch.rand(n, device=device) < erasing
        images = _erase(images, top, left, torch.where(erased, box_h, 0), box_w)
    return images


def random_resized_crop(images, *, size, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3), degrees=30.0):
    """The folder datasets' training augmentation on the device, for a batch at once: per sample a random
    resized crop (`scale` of the area, aspect `ratio`), horizontal and vertical flips and a rotation of up to
    `degrees`, as one affine map sampled bilinearly (affine_grid + grid_sample). uint8 or float (N, C, H, W)
    in, float (N, C, size, size) on the 0-255 scale out, for `preprocess`; corners rotated in are black."""
    n, device = len(images), images.device
    area = torch.empty(n, device=device).uniform_(*scale)
    aspect = torch.empty(n, device=device).uniform_(math.log(ratio[0]), math.log(ratio[1])).exp()
    width, height = (area * aspect).sqrt().clamp(max=1), (area / aspect).sqrt().clamp(max=1)  # of the input
    center_x = (torch.rand(n, device=device) * 2 - 1) * (1 - width)
    center_y = (torch.rand(n, device=device) * 2 - 1) * (1 - height)
    flip_x = torch.where(torch.rand(n, device=device) < 0.5, -1.0, 1.0)
    flip_y = torch.where(torch.rand(n, device=device) < 0.5, -1.0, 1.0)
    angle = torch.empty(n, device=device).uniform_(-degrees, degrees).deg2rad()
    cos, sin = angle.cos(), angle.sin()
    # output grid (x, y) in [-1, 1] -> rotate -> flip and scale to the crop -> move to its center
    theta = torch.stack([torch.stack([width * flip_x * cos, -width * flip_x * sin, center_x], 1),
                         torch.stack([height * flip_y * sin, height * flip_y * cos, center_y], 1)], 1)
    grid = F.affine_grid(theta, (n, images.shape[1], size, size), align_corners=False)
    return F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _erase(images, top, left, box_h, box_w):
    """Zero each sample's rectangle [top, top + box_h) x [left, left + box_w) (clipped to the image)."""
    _, _, height, width = images.shape
    rows = torch.arange(height, device=images.device) - torch.as_tensor(top)[:, None]
    cols = torch.arange(width, device=images.device) - torch.as_tensor(left)[:, None]
    inside = ((rows >= 0) & (rows < torch.as_tensor(box_h).view(-1, 1)))[:, :, None] & (
        (cols >= 0) & (cols < torch.as_tensor(box_w).view(-1, 1)))[:, None, :]
    return images.masked_fill_(inside[:, None], 0.0)


# --- CIFAR-10 -------------------------------------------------------------------------------------

def build_cifar10(data_dir, *, download=False):
    """(train, test) InMemoryDatasets from the python batches, their .tar.gz, an ImageFolder tree (train/ and
    test/ or val/) or `hf:NAME`."""
    data_dir = str(data_dir)
    if data_dir.startswith("hf:"):
        return _cifar10_from_hf(data_dir[3:])
    root = Path(data_dir)
    found = _find_cifar10(root)
    if download and (found is None or found == ("archive", root / "cifar-10-python.tar.gz")
                     and not tarfile.is_tarfile(found[1])):  # torchvision replaces an archive whose checksum is wrong
        _download("CIFAR10", root)
        found = _find_cifar10(root)
    if found is None:
        raise UserError(
            f"no CIFAR-10 found at {root}. Accepted layouts: {root}/cifar-10-batches-py/ (the official python "
            f"batches), {root}/cifar-10-python.tar.gz, an ImageFolder tree {root}/train/<class>/*.jpg + "
            f"{root}/test/<class>/*.jpg (or val/, as scripts/split_dataset.py writes), or --data_dir "
            "hf:NAME_OR_PATH for a Hugging Face dataset. Add --download to fetch the official batches (needs internet)."
        )
    kind, path = found
    if kind == "folder":
        held_out = _held_out_folder(path)
        train = load_image_folder(path / "train", size=(32, 32))
        check_classes(train.classes, path / "train")
        test = load_image_folder(held_out, size=(32, 32))
        if train.classes != test.classes:
            raise UserError(f"{path}/train and {held_out} have different class folders: "
                            f"{train.classes} vs {test.classes}")
        return train, test
    return _cifar10_from_batches(kind, path)


def _download(name, root):
    """torchvision's download of dataset `name` into `root`; no network gives one message, not a traceback."""
    import torchvision  # only needed to download

    try:
        getattr(torchvision.datasets, name)(root=root, download=True)
    except (OSError, RuntimeError) as error:  # URLError is an OSError; torchvision raises RuntimeError on a bad file
        raise UserError(f"--download: could not fetch {name} into {root} ({error}). Without internet (a compute "
                        "node), download it on a machine that has it and copy the files into --data_dir") from None


def _held_out_folder(folder):
    """folder/test, else folder/val (what scripts/split_dataset.py writes), else None."""
    return next((folder / name for name in ("test", "val") if (folder / name).is_dir()), None)


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


def check_labels(labels, classes, *, source):
    """Every label must name one of `classes`: a label out of range would stop training hours in."""
    labels = np.asarray(labels)
    if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
        raise UserError(f"{source} holds labels from {labels.min()} to {labels.max()}, but the dataset has "
                        f"{len(classes)} classes (0 to {len(classes) - 1}): the file is damaged or from another dataset")


def _cifar10_from_batches(kind, path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if kind == "batches":
        present = [name for name in names if (path / name).is_file()]
        files = {name: (path / name).read_bytes() for name in present}
    else:
        try:
            with tarfile.open(path) as archive:
                files = {Path(m.name).name: archive.extractfile(m).read()
                         for m in archive.getmembers() if m.isfile() and Path(m.name).name in names}
        except (tarfile.TarError, OSError, EOFError) as error:
            raise UserError(f"cannot read {path} as a .tar.gz of CIFAR-10 batches ({error}): it is damaged or "
                            "not the CIFAR-10 archive. Delete it and run with --download, or point --data_dir at "
                            "another copy") from None
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


def _cifar10_from_hf(name_or_path):
    import datasets  # imported here: only this source needs it

    if Path(name_or_path).exists():
        try:
            splits = datasets.load_from_disk(name_or_path)
        except FileNotFoundError:
            raise UserError(f"hf:{name_or_path} is a folder but not a dataset saved with datasets' save_to_disk. For "
                            f"a folder of images pass --data_dir {name_or_path} (without hf:)") from None
    else:
        try:
            splits = datasets.load_dataset(name_or_path)
        except Exception as error:
            raise UserError(f"cannot load Hugging Face dataset {name_or_path!r} (not a local folder saved with "
                            f"save_to_disk, and the hub said: {error})") from None
    if not {"train", "test"} <= set(splits):
        raise UserError(f"Hugging Face dataset {name_or_path!r} needs 'train' and 'test' splits, has {list(splits)}")
    return tuple(_from_hf_split(splits[split], name_or_path) for split in ("train", "test"))


def _from_hf_split(split, name):
    import datasets

    image_column = next((c for c, f in split.features.items() if isinstance(f, datasets.Image)), None)
    label_column = next((c for c, f in split.features.items() if isinstance(f, datasets.ClassLabel)), None)
    if image_column is None or label_column is None:
        raise UserError(f"Hugging Face dataset {name!r} needs an Image column and a ClassLabel column, "
                        f"has {dict(split.features)}")
    images = np.stack([np.asarray(convert_image(image).resize((32, 32))) for image in split[image_column]])
    labels = torch.tensor(split[label_column], dtype=torch.long)
    return InMemoryDataset(torch.from_numpy(images).permute(0, 3, 1, 2), labels,
                           split.features[label_column].names)


def decode_image(path, *, size, channels):
    """One image file -> uint8 array (H, W, C), converted to RGB or grayscale and resized (bilinear) to `size`.

    Raises OSError or ValueError for a file that is not a readable image.
    """
    image = read_image(path, channels=channels)
    if image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.BILINEAR)
    return np.asarray(image).reshape(size[0], size[1], channels)


def load_image_folder(root, *, size):
    """Decode a `root/<class>/<image>` tree into an InMemoryDataset of RGB images resized to `size`.

    The decoded tensor is kept in `root/.decoded-HxW.safetensors`, with a fingerprint of the files' names,
    sizes and times, so the next run reads it back instead of decoding again (CIFAR-10's 60,000 JPEGs:
    seconds instead of tens of seconds); any change to the files makes it decode afresh.
    """
    files, labels, classes, _ = list_image_folder(root)
    cache = Path(root) / f".decoded-{size[0]}x{size[1]}.safetensors"
    stats = [(f.relative_to(root), f.stat()) for f in files]
    fingerprint = hashlib.sha256("\n".join(
        f"{name}:{stat.st_size}:{stat.st_mtime_ns}" for name, stat in stats).encode()).hexdigest()
    cached = _read_decoded(cache, fingerprint)
    if cached is not None:
        return InMemoryDataset(cached, torch.tensor(labels), classes)

    def decode(path):
        try:
            return decode_image(path, size=size, channels=3)
        except (OSError, ValueError) as error:
            raise UserError(f"cannot read image {path}: {error}") from None

    with ThreadPoolExecutor(max_workers=8) as pool:
        images = torch.from_numpy(np.stack(list(pool.map(decode, files, chunksize=256)))).permute(0, 3, 1, 2)
    _write_decoded(cache, images, fingerprint)
    return InMemoryDataset(images, torch.tensor(labels), classes)


def _read_decoded(path, fingerprint):
    try:
        with safe_open(path, framework="pt") as f:
            return f.get_tensor("images") if f.metadata().get("fingerprint") == fingerprint else None
    except (OSError, SafetensorError):  # no cache yet, or a damaged one: decode again
        return None


def _write_decoded(path, images, fingerprint):
    """Best effort: a read-only or full data folder just means decoding again next time."""
    write_if_possible(path, lambda tmp: save_file({"images": images.contiguous()}, tmp,
                                                  metadata={"fingerprint": fingerprint}))


# --- MNIST and Fashion-MNIST (IDX files) ------------------------------------------------------------

IDX_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
TORCHVISION_FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}
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


def build_mnist(data_dir, *, name="mnist", download=False):
    """(train, test) InMemoryDatasets for `mnist` or `fashion_mnist` from the four IDX files.

    Looks in `data_dir`, `data_dir/raw` and the torchvision layout `data_dir/MNIST/raw` (or FashionMNIST),
    nowhere else: a mistyped --data_dir must not train on other files.
    """
    root = Path(data_dir)
    folder = TORCHVISION_FOLDERS[name]
    candidates = [root, root / "raw", root / folder / "raw"]
    found = next((c for c in candidates if _find_idx(c, IDX_FILES["train_images"])), None)
    if found is None and download:
        _download(folder, root)
        found = root / folder / "raw"
    if found is None:
        raise UserError(
            f"no {name} IDX files found; tried {', '.join(str(c) for c in candidates)}. Accepted layouts: a folder "
            "with train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
            f"(each optionally .gz), or torchvision's {root}/{folder}/raw/. Add --download to fetch them "
            "(needs internet)" + (f"; on Debian: apt-get install dataset-fashion-mnist, then --data_dir "
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
    """scikit-learn's bundled 1,797 8x8 digits (offline), split stratified into (train, test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[:, None]  # values 0..16 -> 0..255
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=test_fraction, random_state=seed, stratify=digits.target)
    return (InMemoryDataset(torch.from_numpy(train_x), torch.from_numpy(train_y), MNIST_CLASSES),
            InMemoryDataset(torch.from_numpy(test_x), torch.from_numpy(test_y), MNIST_CLASSES))


# every in-memory dataset by the name describe_model records, as (data_dir, seed) -> (train, test): what
# scripts/evaluate.py reads (digits are split by the training run's seed)
IN_MEMORY_DATASETS = {
    "cifar10": lambda data_dir, seed: build_cifar10(data_dir),
    "mnist": lambda data_dir, seed: build_mnist(data_dir, name="mnist"),
    "fashion_mnist": lambda data_dir, seed: build_mnist(data_dir, name="fashion_mnist"),
    "digits": lambda data_dir, seed: build_digits(seed=seed),
}

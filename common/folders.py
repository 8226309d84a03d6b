"""Class-folder datasets read from files (Plant Seedlings, your own photos): decoded and augmented in DataLoader
workers, or gathered from the decode cache and augmented on the device. Batches are uint8, like the in-memory
datasets; normalisation happens on the device."""

import atexit
import json
import math
import multiprocessing
import multiprocessing.util  # its exit function must be registered before ours
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .data import InMemoryDataset, build_dataloader, mix_seed
from .decode_cache import check_images, machine_share, split_record
from .errors import UserError
from .hf import find_hf_splits, is_hf
from .images import check_classes, check_same_classes, folder_entries, list_image_folder, read_image, split_dataset

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def read_mean_std(path):
    """(mean, std) per RGB channel from a JSON of scripts/compute_mean_std.py; ImageNet's without one."""
    if path is None:
        return IMAGENET_MEAN, IMAGENET_STD
    try:
        stats = json.loads(Path(path).read_text())
        mean, std = [float(v) for v in stats["mean"]], [float(v) for v in stats["std"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"--mean_std {path}: not a JSON with mean and std written by scripts/compute_mean_std.py "
                        f"({error})") from None
    if len(mean) != 3 or len(std) != 3 or not all(map(math.isfinite, mean + std)) or min(std) <= 0:
        raise UserError(f"--mean_std {path}: needs 3 finite means and 3 stds above 0 (R, G, B), has mean {mean} and "
                        f"std {std}. A std of 0 means a channel has one value in every image: leave --mean_std out "
                        "to use ImageNet's")
    return tuple(mean), tuple(std)


def build_train_transform(image_size, auto_augment="none", *, geometry=True, degrees=30.0):
    """Per-sample augmentation, uint8 (3, S, S) out: random resized crop, both flips, a rotation within +-`degrees`
    (seedlings are seen from above: any orientation is real; 0: none), then `auto_augment`. Without `geometry` only
    the policy (the cached path does the rest on the device, `random_resized_crop`); None when nothing is left to do
    per sample."""
    from torchvision.transforms import v2  # imported here: the in-memory datasets do not need it

    policy = {"none": [], "trivialaugment": [v2.TrivialAugmentWide()], "randaugment": [v2.RandAugment()]}[auto_augment]
    if not geometry and not policy:
        return None
    crop = [v2.RandomResizedCrop(image_size, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip(),
            v2.RandomVerticalFlip(), *([v2.RandomRotation(degrees)] if degrees else [])] if geometry else []
    return v2.Compose([v2.ToImage(), *crop, *policy, v2.ToPureTensor()])


def random_resized_crop(images, *, size, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3), degrees=30.0):
    """`build_train_transform`'s geometry on the device for a whole batch: per sample one affine map (crop, flips,
    rotation) sampled bilinearly. float (N, C, size, size) on the 0-255 scale out, for `preprocess`."""
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


def find_splits(data_dir, *, val_fraction, seed, hf_options=None, fraction_typed=False):
    """(train, val, classes, skipped) from `root/train` + `root/val`, or split from `root`, or from a Hugging Face
    dataset (`hf:...`, chosen by `hf_options`: common.hf.hf_options); a split is a dict of "files", "labels",
    "classes", "name" (train, val), "root" (where its decode cache goes) and "source" (the data, in words).
    `fraction_typed`: --val_fraction was typed, and is refused where train/ and val/ (a dataset's validation split)
    leave it nothing to do."""
    if is_hf(data_dir):
        return find_hf_splits(data_dir, val_fraction=val_fraction, seed=seed, options=hf_options,
                              fraction_typed=fraction_typed)
    root = Path(data_dir)
    has_train, has_val, has_test = (_is_split(root / name) for name in ("train", "val", "test"))
    if has_train and not has_val and has_test:
        raise UserError(f"{root} has train/ and test/: the folder that chooses the best model must be called val/ "
                        f"(rename {root / 'test'} to {root / 'val'}), or pass --data_dir {root / 'train'} to split "
                        "the training images here")
    if has_train != has_val:
        have, lack = ("train", "val") if has_train else ("val", "train")
        raise UserError(f"{root} has {have}/ but no {lack}/: add {root / lack}/<class>/<image>, "
                        + (f"or pass --data_dir {root / 'train'} to split the training images here (--val_fraction)"
                           if has_train else f"or put the training images in {root / 'train'}/<class>/"))
    if has_train and fraction_typed:
        raise UserError(f"--val_fraction {val_fraction} splits a folder of class folders here, and {root} has train/ "
                        f"and val/ (val/ validates): drop --val_fraction, or pass --data_dir {root / 'train'} to split "
                        "its training images")
    if has_train:
        train_files, train_labels, classes, skipped = list_image_folder(root / "train")
        val_files, val_labels, val_classes, val_skipped = list_image_folder(root / "val")
        check_same_classes(classes, root / "train", val_classes, root / "val")
        check_classes(classes, root / "train")
        splits, skipped = {"train": (train_files, train_labels), "val": (val_files, val_labels)}, skipped + val_skipped
    else:
        files, labels, classes, skipped = list_image_folder(root)
        check_classes(classes, root)
        parts = split_dataset(labels, val_fraction=val_fraction, seed=seed, classes=classes)
        splits = {name: ([files[i] for i in part], [labels[i] for i in part]) for name, part in zip(("train", "val"),
                                                                                                   parts)}
    source = str(root) if has_train else f"{root} (split here: --val_fraction {val_fraction}, stratified, --seed)"
    if has_train and _is_split(root / "test"):  # read by no run: said, with what scores it
        source += (f" (its test/ is not read in training: python scripts/evaluate.py --model_dir OUTPUT_DIR "
                   f"--data_dir {root / 'test'} scores the trained model on it)")
    train, val = ({"files": files, "labels": labels, "classes": classes, "name": name, "root": root,
                   "source": source} for name, (files, labels) in splits.items())
    return train, val, classes, skipped


def _is_split(folder):
    """A folder of class folders (not a class that happens to be called "train")."""
    return folder.is_dir() and any(kind == "dir" for _, kind in folder_entries(folder))


def build_folder_dataset(split, *, transform, skip_bad_images, cache=None, seed=None, accelerator=None):
    """An ImageFileDataset of a split (`find_splits`), its images checked once (`check_images`; the unreadable ones
    in `left_out`). `cache`: the eval_transform spec the images are decoded to once, into the decode cache. With a
    cache and no `transform`, an InMemoryDataset over the mapped cache instead: a batch is one gather, no workers,
    no Python per image, so that the CPU only copies bytes while the device augments."""
    good, bad, images = check_images(split["files"], skip_bad_images=skip_bad_images, cache=cache,
                                     accelerator=accelerator, record=split_record(split))
    labels, classes = [split["labels"][i] for i in good], split["classes"]
    emptied = sorted(set(split["labels"]) - set(labels))
    if emptied:  # --skip_bad_images left a class out whole: the run would neither learn nor score it
        lost = [path for path, label in zip(split["files"], split["labels"]) if label == emptied[0]]
        why = dict((str(path), error) for path, error in bad)[str(lost[0])]
        raise UserError(f"class {classes[emptied[0]]}: none of its {len(lost)} {split.get('name', '')} images can be "
                        f"read (e.g. {lost[0]}: {why}), so --skip_bad_images would leave the class out of the run, "
                        "which could neither learn nor score it. Replace its images, or move the folder out of the "
                        "data to train without that class.")
    if images is not None and transform is None:
        dataset = InMemoryDataset(images, torch.tensor(labels), classes, rows=good,
                                  files=[split["files"][i] for i in good])
    else:
        dataset = ImageFileDataset([split["files"][i] for i in good], labels, classes, transform=transform,
                                   cache=None if images is None else (images, good), seed=seed)
    dataset.left_out = [path for path, _ in bad]
    return dataset


class ImageFileDataset(torch.utils.data.Dataset):
    """Images from files, or from a cache (`cache`: the images and each file's row), transformed per sample.

    With `seed` the augmentation is drawn from (seed, epoch, index), not from the worker that makes it, so a run
    resumed mid-epoch augments as the uninterrupted one; the epoch reaches the workers through shared memory.
    """

    def __init__(self, files, labels, classes, *, transform, cache=None, seed=None):
        self.files, self.labels, self.classes = list(files), torch.tensor(labels), list(classes)
        self.transform, self.seed = transform, seed
        self.cache, self.cache_rows = cache if cache is not None else (None, None)
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def relabelled(self, classes):
        to_new = [list(classes).index(name) for name in self.classes]
        return ImageFileDataset(self.files, [to_new[label] for label in self.labels.tolist()], classes,
                                transform=self.transform, cache=(self.cache, self.cache_rows), seed=self.seed)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        image = self.cache[self.cache_rows[index]] if self.cache is not None else self._read(index)
        if self.seed is None:
            return {"image": self.transform(image), "label": self.labels[index], "index": index}
        # fork_rng: with no workers this runs in the training process, whose own random stream must not move
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, int(self.epoch), index))
            return {"image": self.transform(image), "label": self.labels[index], "index": index}

    def _read(self, index):
        try:
            return read_image(self.files[index])
        except (OSError, ValueError) as error:  # it was read at the image check: it changed since
            raise UserError(f"cannot read image {self.files[index]} ({error}), which the image check read before: it "
                            "was deleted, moved or changed while the run went on, or its filesystem went away. Put it "
                            "back and run again (a training run: with --resume latest, from its last "
                            "checkpoint)") from None


def balanced_sampling_weights(labels):
    """Each sample's weight for drawing every class equally often (--sampler balanced, MicroBatches' `weights`)."""
    labels = np.asarray(labels)
    return torch.as_tensor(1.0 / np.bincount(labels)[labels], dtype=torch.double)


def balanced_class_weights(labels, num_classes):
    """Loss weights n / (num_classes * count), scikit-learn's "balanced"."""
    counts = np.bincount(np.asarray(labels), minlength=num_classes)
    return torch.tensor(len(labels) / (num_classes * np.maximum(counts, 1)), dtype=torch.float32)


def training_cache(eval_transform):
    """The decode cache of a training split: the whole square that evaluation resizes to (`eval_transform`'s
    "resize"), so that the random crops on the device see as much of each image as evaluation does."""
    return {"resize": eval_transform["resize"], "center_crop": eval_transform["resize"]}


CACHE_LIMIT_GB = 4  # --cache_images' default: the decode cache when the decoded images take at most this much


def choose_cache(given, *, images, size):
    """(whether to decode the images once into the decode cache, why): `given` (--cache_images or
    --no-cache_images), else when `images` of size x size take at most CACHE_LIMIT_GB. Then no worker decodes or
    augments an image again, which pays on a CPU (workers slow the training threads) and on a GPU; a larger set
    streams from its files. A function of the data alone, so that a resumed run makes the same choice."""
    if given is not None:
        return given, "--cache_images" if given else "--no-cache_images"
    need = images * 3 * size * size
    within = need <= CACHE_LIMIT_GB * 1e9
    return within, (f"{need / 1e9:.1f} GB" if need >= 1e8 else f"{need / 1e6:.1f} MB") + (
        f" decoded, {'within' if within else 'over'} the default's {CACHE_LIMIT_GB} GB")


# A batch that a worker has not handed over after this long is lost (the worker stuck, or the thread that sends it
# failed, which the run never hears of): an error naming it, not a wait forever. The slowest batch of a slow network
# filesystem takes seconds.
LOADER_TIMEOUT_S = 300


def choose_num_workers(given=None):
    """(DataLoader workers per process, why): `given`, else this process's share of the machine's cores less one,
    1 to 8. More workers than cores only take turns (on 2 cores, at half the speed)."""
    if given is not None:
        return given, "--num_workers"
    cores, local = machine_share()
    return max(1, min(8, cores // local - 1)), f"{cores} cores / {local} processes on this machine, less one"


def build_file_dataloader(dataset, *, batch_size=1, shuffle=False, num_workers=None, batch_sampler=None):
    """Persistent workers decode and augment, 4 batches ahead. A dataset that gathers whole batches itself gets
    `build_dataloader`'s loader instead, without workers."""
    if hasattr(dataset, "__getitems__"):
        return build_dataloader(dataset, batch_size=batch_size, shuffle=shuffle, batch_sampler=batch_sampler)
    num_workers = choose_num_workers(num_workers)[0]
    if num_workers:  # the workers' sockets for passing tensors then go into this process's temporary folder, which
        socket_folder()  # its exit removes: a worker killed at the end left a /tmp/pymp-* each
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, batch_sampler=batch_sampler,
                                       num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
                                       prefetch_factor=4 if num_workers > 0 else None,
                                       generator=torch.Generator(), worker_init_fn=_ignore_sigterm,
                                       timeout=LOADER_TIMEOUT_S if num_workers else 0)


def socket_folder():
    """multiprocessing's temporary folder of this process, made now: the DataLoader workers' sockets for passing
    tensors go there. Under TMPDIR, unless a socket's path there would be longer than AF_UNIX allows (107 bytes: a
    job's deep TMPDIR), then under /tmp: Python 3.11 made it under TMPDIR all the same, the socket's bind failed in a
    worker's sending thread, and the run waited for that batch forever."""
    deep = len(os.fsencode(os.path.join(tempfile.gettempdir(), "pymp-abcdefgh", "listener-abcdefgh"))) > 107
    saved = tempfile.tempdir
    try:
        if deep and os.path.isdir("/tmp"):
            tempfile.tempdir = "/tmp"
        return multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def _ignore_sigterm(worker_id):
    """Slurm and torchrun signal the whole process group: a worker killed by SIGTERM would crash the training
    process before it saves. The workers end with it (`_stop_workers_at_exit`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_workers_at_exit():
    """multiprocessing's exit handler SIGTERMs daemonic children and waits: forever, for workers that ignore it
    and that nothing shut down (after an error, or a persistent loader still referenced). So kill them first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would call a killed worker a failure
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5)


atexit.register(_stop_workers_at_exit)  # after multiprocessing.util's (imported above), so it runs before it

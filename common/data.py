"""Datasets that fit in memory as a uint8 tensor (N, C, H, W) (common.cifar, common.mnist): a plain DataLoader
fetches a whole batch with one index operation, and `preprocess` crops, flips and normalises it on the device."""

import contextlib
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UserError
from .images import split_dataset


class InMemoryDataset(torch.utils.data.Dataset):
    """uint8 images (N, C, H, W) and labels; batches are dicts of image, label and index. `rows`: each sample's row
    of `images`, where it holds more (the decode cache keeps a row for every file, unreadable ones included);
    `files`: each sample's file, where it was decoded from one (for reports); `source`: where they came from, in
    words, where more than the dataset's name says it (a Hugging Face dataset's chosen splits and columns)."""

    def __init__(self, images, labels, classes, *, rows=None, files=None, source=None):
        assert images.dtype == torch.uint8 and images.ndim == 4 and len(labels) == len(images if rows is None else rows)
        self.images, self.labels, self.classes = images.contiguous(), labels.long(), list(classes)
        self.rows = None if rows is None else torch.as_tensor(rows, dtype=torch.long)
        self.files, self.source = files, source

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
        return InMemoryDataset(self.images, to_new[self.labels], classes, rows=self.rows, files=self.files)

    def image(self, index):
        """The stored image of sample `index`, uint8 (C, H, W), unaugmented (for reports)."""
        return self.images[index if self.rows is None else self.rows[index]]

    def __getitems__(self, indices):
        # one gather for the whole batch; the DataLoader calls this instead of __getitem__ per sample.
        # index_select copies whole rows: 6x the speed of images[index], which indexes element by element
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = index if self.rows is None else self.rows[index]
        return {"image": self.images.index_select(0, rows), "label": self.labels[index], "index": index}


def hold_out(dataset, *, fraction, seed):
    """(train, validation): a stratified share `fraction` set aside (--val_fraction), the same for every seed."""
    train, val = split_dataset(dataset.labels.tolist(), val_fraction=fraction, seed=seed, classes=dataset.classes)
    return tuple(InMemoryDataset(dataset.images[part], dataset.labels[part], dataset.classes,
                                 files=None if dataset.files is None else [dataset.files[i] for i in part])
                 for part in (train, val))


def _keep_as_is(batch):
    return batch


def build_dataloader(dataset, *, batch_size=1, shuffle=False, batch_sampler=None):
    """A DataLoader whose batches the dataset builds, drawn by `batch_sampler` (training: MicroBatches) or in
    batches of `batch_size`. Pinned with a GPU, for non-blocking copies."""
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, batch_sampler=batch_sampler,
                                       collate_fn=_keep_as_is, pin_memory=torch.cuda.is_available())


def mix_seed(*numbers):
    """One 32-bit seed (numpy's limit) from several numbers, e.g. (seed, epoch, micro-batch)."""
    return int(np.random.SeedSequence(list(numbers)).generate_state(1)[0])


class MicroBatches(torch.utils.data.Sampler):
    """This process's training batches, in one global order that does not depend on the process count.

    Each epoch draws an order of the samples from (seed, epoch) alone (a permutation, or with `weights` a draw with
    replacement) and cuts it into micro-batches of `batch_size`. An optimizer step takes `per_step` of them, the
    run's global batch: processes x accumulation steps (2 x 1, 1 x 2), and process p takes the p-th run of
    `accumulation` micro-batches of each step. Every epoch has the same steps on any process count; the samples
    after its last full step are left out (another few each epoch). `set_epoch(epoch, start)` goes on from `start`
    global micro-batches into the epoch, so a checkpoint taken inside an epoch resumes on any process count.
    """

    def __init__(self, num_samples, *, batch_size, seed, accelerator, weights=None):
        self.batch_size, self.seed, self.weights = batch_size, seed, weights
        self.num_samples, self.rank = num_samples, accelerator.process_index
        self.accumulation = accelerator.gradient_accumulation_steps
        self.per_step = accelerator.num_processes * self.accumulation
        self.steps_per_epoch = num_samples // batch_size // self.per_step
        self.epoch, self.start = 1, 0

    def set_epoch(self, epoch, start=0):
        assert start % self.per_step == 0, "an epoch is resumed at an optimizer step"
        self.epoch, self.start = epoch, start

    def __len__(self):
        return (self.steps_per_epoch - self.start // self.per_step) * self.accumulation

    def __iter__(self):
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = (torch.randperm(self.num_samples, generator=generator) if self.weights is None else
                 torch.multinomial(self.weights, self.num_samples, replacement=True, generator=generator))
        steps = order[:self.steps_per_epoch * self.per_step * self.batch_size].view(self.steps_per_epoch, -1,
                                                                                    self.batch_size)
        mine = steps[:, self.rank * self.accumulation:(self.rank + 1) * self.accumulation]
        return iter(mine[self.start // self.per_step:].flatten(0, 1).tolist())

    def micro_batch(self, position):
        """The global index in the epoch of the micro-batch this process trains `position`-th since `start`."""
        step, within = divmod(self.start // self.per_step * self.accumulation + position, self.accumulation)
        return step * self.per_step + self.rank * self.accumulation + within


def preprocess(images, *, normalize, padding=0, padding_mode="constant", flip=False, erase=None):
    """uint8 (N, C, H, W) -> float normalised by `normalize` (mean, std); per sample random: a crop of the image
    padded by `padding` pixels (`padding_mode` "constant": zeros; "reflect": mirrored without repeating the edge, as
    torchvision's RandomCrop pads), a flip, and `erase` ({"cutout": side, "erasing": probability}): a Cutout square
    of that side (DeVries & Taylor 2017) and, with that probability, a rectangle as torchvision's RandomErasing
    (2-33% of the area, aspect 0.3-3.3), erased to 0, the mean colour."""
    n, _, height, width = images.shape
    device = images.device
    if padding or flip:
        # one gather does both: each sample's crop window, its columns read backwards when it is mirrored
        dy = torch.randint(0, 2 * padding + 1, (n, 1), device=device)
        dx = torch.randint(0, 2 * padding + 1, (n, 1), device=device)
        cols = torch.arange(width, device=device).expand(n, width)
        if flip:
            cols = torch.where(torch.rand(n, 1, device=device) < 0.5, width - 1 - cols, cols)
        rows, cols = dy + torch.arange(height, device=device), dx + cols  # in the padded image
        if padding and padding_mode == "reflect":  # the mirrored pixel's place in the image itself
            source, rows, cols = images, _reflect(rows - padding, height), _reflect(cols - padding, width)
        else:
            source = F.pad(images, (padding, padding, padding, padding)) if padding else images
        batch = torch.arange(n, device=device)[:, None, None]
        images = source[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)  # (N, H, W, C) -> NCHW
    # (x / 255 - mean) / std as one multiply and one add
    mean, std = (torch.tensor(values, device=device).view(1, -1, 1, 1) for values in normalize)
    images = images.float().mul_(1 / (255 * std)).sub_(mean / std)
    cutout, erasing = (erase or {}).get("cutout", 0), (erase or {}).get("erasing", 0.0)
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


def _reflect(index, size):
    """Positions -size < index < 2 size - 1 mirrored into [0, size) about the first and last pixel: -1 -> 1."""
    return (size - 1) - ((size - 1) - index.abs()).abs()


def _erase(images, top, left, box_h, box_w):
    """Zero each sample's rectangle [top, top + box_h) x [left, left + box_w), clipped to the image."""
    _, _, height, width = images.shape
    top, left, box_h, box_w = (torch.as_tensor(value, device=images.device).view(-1, 1)
                               for value in (top, left, box_h, box_w))  # Cutout's sides are ints
    rows, cols = torch.arange(height, device=images.device) - top, torch.arange(width, device=images.device) - left
    inside = ((rows >= 0) & (rows < box_h))[:, :, None] & ((cols >= 0) & (cols < box_w))[:, None, :]
    return images.masked_fill_(inside[:, None], 0.0)


def download_dataset(name, root):
    """torchvision's download of dataset `name` into `root`; no network gives one message, not a traceback."""
    import torchvision  # only needed to download

    # the folders torchvision makes first (ROOT/MNIST/raw), removed again if still empty after a failure
    made = [folder for folder in (Path(root) / name / "raw", Path(root) / name, Path(root)) if not folder.exists()]
    try:
        getattr(torchvision.datasets, name)(root=root, download=True)
    except (OSError, RuntimeError) as error:  # URLError is an OSError; torchvision raises RuntimeError on a bad file
        for folder in made:
            with contextlib.suppress(OSError):  # not empty: what was fetched stays
                folder.rmdir()
        raise UserError(f"--download: could not fetch {name} into {root} ({' '.join(str(error).split())}). Without "
                        "internet (a compute node), download it on a machine that has it and copy the files into "
                        "--data_dir") from None


def check_labels(labels, classes, *, source):
    """Every label must name one of `classes`: a label out of range would stop training hours in."""
    labels = np.asarray(labels)
    if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
        raise UserError(f"{source} holds labels from {labels.min()} to {labels.max()}, but the dataset has "
                        f"{len(classes)} classes (0 to {len(classes) - 1}): the file is damaged or from another dataset")

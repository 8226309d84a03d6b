"""Class-folder image datasets read from files (Plant Seedlings, or your own photos).

`root/<class>/<image>` is listed and split by common.images, and every image is decoded once up
front so that a corrupt file stops the run at the start, by name, not hours in inside a worker.
Training reads the files in DataLoader workers (random resized crop, flips, rotation) or, with
`cache`, crops from images decoded and resized once into memory. Batches are uint8, like the
in-memory datasets: normalisation (and mixup) happen on the device.
"""

import atexit
import hashlib
import json
import math
import multiprocessing
import multiprocessing.util  # noqa: F401  its exit function must be registered before ours
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .data import InMemoryDataset, build_dataloader
from .errors import UserError
from .images import read_image
from .outputs import write_if_possible

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


def check_images(files, *, skip_bad_images, cache_size=None, accelerator=None, record=None):
    """Decode every image once -> (indices of the good ones, [(file, error)] of the bad, cache).

    A bad image stops the run with its name unless `skip_bad_images`. With an `accelerator` each process
    checks its own share and the bad lists are gathered, so that all agree. `record`: a JSON file beside
    the data where the result is kept with a fingerprint of the files' names, sizes and times; a later
    check of the same files reads it instead of decoding (best effort: a read-only folder means checking
    again). With `cache_size` the cache holds every listed image as evaluation first sees it (short side
    resized to cache_size, center square), uint8 (N, 3, S, S), index it with the good indices: decoded
    once per machine into an .npy file beside the record and memory-mapped by every process, so the page
    cache holds one copy; without a record, or where it cannot be written, decoded in memory.
    """
    shrink = build_eval_transform({"resize": cache_size, "center_crop": cache_size}) if cache_size else None

    def decode(path):
        try:
            image = read_image(path)
            return shrink(image) if cache_size else True
        except (OSError, ValueError) as error:
            return error

    bad, cache = _check_shared_out(files, decode, accelerator=accelerator, record=record, cache_size=cache_size)
    bad_files = {path for path, _ in bad}
    if bad and not skip_bad_images:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(f"cannot read image {bad[0][0]}: {bad[0][1]}{more}. Remove it, or pass --skip_bad_images "
                        "to leave unreadable images out")
    good = [i for i, path in enumerate(files) if path not in bad_files]
    if files and not good:
        raise UserError(f"none of the {len(files)} images could be read, e.g. {bad[0][0]}: {bad[0][1]}")
    return good, bad, cache


def _check_shared_out(files, decode, *, accelerator, record, cache_size):
    """([(file, error)] of the unreadable `files`, the decoded cache or None); see check_images.

    The main process reads `record` and decides for all (another run may be writing it right now). Without
    a fitting record: each process decodes every n-th file from its index and the bad lists are gathered;
    with `cache_size` the processes of each machine share out its decode into the .npy file every one of them
    then maps (`_decode_shared_out`). The main process writes the record, with each process's share."""
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    fingerprint = _fingerprint(files) if rank == 0 else None  # only the main process reads and writes the record
    decoded = Path(record).with_name(f"{Path(record).stem}-{cache_size}px.npy") if record and cache_size else None
    kept = _broadcast(accelerator, _read_record(record, fingerprint, decoded) if rank == 0 else None)
    if kept is not None:
        if rank == 0:
            print(f"image check of {len(files)} images read from {record} (the files have not changed)")
        return [(Path(path), error) for path, error in kept], _map(decoded)

    if cache_size:  # one decode per machine, shared out among its processes, into the file every process maps
        bad, shares, cache = _decode_shared_out(files, decode, decoded, cache_size, accelerator)
    else:
        share = files[rank::processes]
        mine = [(str(path), f"{result}") for path, result in zip(share, _decode_all(decode, share))
                if isinstance(result, Exception)]
        bad, shares = (mine, [len(share)]) if processes == 1 else _gather_lists(accelerator, mine, len(share))
        cache = None
    order = {str(path): i for i, path in enumerate(files)}
    bad = sorted(((str(path), str(error)) for path, error in bad), key=lambda item: order[item[0]])
    if rank == 0:
        print(f"checked {len(files)} images on {len(shares)} process(es) ({' + '.join(map(str, shares))})"
              + (f", kept in {record}" if record else "")
              + (f"; decoded once for this machine into {decoded.name}" if decoded and decoded.exists() else ""))
    if record is not None and rank == 0:
        text = json.dumps({"fingerprint": fingerprint, "images": len(files), "checked_per_process": shares,
                           "decoded": decoded.name if decoded and decoded.exists() else None, "bad": bad})
        write_if_possible(Path(record), lambda tmp: tmp.write_text(text))
    return [(Path(path), error) for path, error in bad], cache


def _fingerprint(files):
    """A hash of the files' names, sizes and modification times."""
    stats = []
    for path in files:
        try:
            stat = os.stat(path)
            stats.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            stats.append(f"{path}:missing")
    return hashlib.sha256("\n".join(stats).encode()).hexdigest()


def _decode_shared_out(files, decode, path, cache_size, accelerator):
    """([(file, error)], each process's share, uint8 (N, 3, S, S) of every file, zeros for the bad).

    The machine's main process makes the .npy file `path` under a temporary name; each process of the
    machine decodes every n-th file into its rows; once all are done (the bad lists are gathered) the main
    process renames it and every process maps it. Where it cannot be written (a read-only data folder, no
    `path`), every process decodes all of them into memory instead."""
    machine, rank, processes = (_machine(accelerator) if accelerator and accelerator.num_processes > 1
                                else (0, 0, 1))
    tmp = None
    if path is not None and rank == 0:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npy")
        try:
            shape = (len(files), 3, cache_size, cache_size)
            np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape).flush()  # zeros, on disk
            with open(tmp, "r+b") as file:  # the blocks, now: a mapped write into a full disk is a SIGBUS
                os.posix_fallocate(file.fileno(), 0, os.fstat(file.fileno()).st_size)
        except OSError:
            tmp.unlink(missing_ok=True)
            tmp = None
    if processes > 1:  # the machine's main process names its file to the machine's other processes
        from accelerate.utils import gather_object

        tmp = dict(gather_object([(machine, tmp)]) if rank == 0 else gather_object([]))[machine]
    if tmp is None:
        results = _decode_all(decode, files)
        blank = torch.zeros(3, cache_size, cache_size, dtype=torch.uint8)
        images = torch.stack([blank if isinstance(result, Exception) else result for result in results])
        return [(str(f), f"{r}") for f, r in zip(files, results) if isinstance(r, Exception)], [len(files)], images
    rows = range(rank, len(files), processes)
    cache = np.load(tmp, mmap_mode="r+")
    mine = []
    for row, result in zip(rows, _decode_all(decode, [files[row] for row in rows])):
        if isinstance(result, Exception):
            mine.append((str(files[row]), f"{result}"))
        else:
            cache[row] = result.numpy()
    cache.flush()
    del cache
    if accelerator is None or accelerator.num_processes == 1:
        bad, shares = mine, [len(rows)]
    else:  # also the moment every process of every machine has written its rows
        bad, shares = _gather_lists(accelerator, mine, len(rows))
        bad = list(dict(bad).items())  # several machines: each image decoded once on each
    if rank == 0:
        os.replace(tmp, path)
    if accelerator:
        accelerator.wait_for_everyone()
    return bad, shares, _map(path)


def _machine(accelerator):
    """(this machine's index, this process's index on it, the machine's process count), from torchrun's
    environment: every machine runs LOCAL_WORLD_SIZE processes with consecutive ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return accelerator.process_index // local, accelerator.local_process_index, local


def _decode_all(decode, items):
    """`decode` of each item, in order, on threads (PIL decodes without the GIL): one per core of this process's
    share of the machine (`choose_num_workers`), at most 8."""
    with ThreadPoolExecutor(max_workers=choose_num_workers()[0] + 1) as pool:
        return list(pool.map(decode, items, chunksize=64))


def _map(path):
    """The .npy cache memory-mapped (copy on write: never written, and no warning about a read-only array), or
    None when there is none."""
    if path is None or not path.exists():
        return None
    return torch.from_numpy(np.load(path, mmap_mode="c"))


def _broadcast(accelerator, value):
    """The main process's `value` on every process."""
    if accelerator is None or accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def _read_record(record, fingerprint, decoded=None):
    """The bad list a check of these very files kept in `record` (and, when `decoded` is asked for, with that
    cache written), or None (no record, another list, no cache, damaged)."""
    try:
        kept = json.loads(Path(record).read_text())
        if kept["fingerprint"] != fingerprint or (decoded and not (kept["decoded"] == decoded.name
                                                                   and decoded.exists())):
            return None
        return [(str(path), str(error)) for path, error in kept["bad"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _gather_lists(accelerator, bad, count):
    """Every process's bad list, concatenated, and every process's share size, on every process."""
    from accelerate.utils import gather_object

    gathered = gather_object([(bad, count)])
    return [item for mine, _ in gathered for item in mine], [count for _, count in gathered]


def build_train_transform(image_size, auto_augment="none", *, geometry=True):
    """Per-sample augmentation, PIL or uint8 tensor in, uint8 (3, S, S) tensor out: random resized crop,
    horizontal and vertical flips, rotation (seedlings are photographed from above, so any orientation is a
    real one), then torchvision's TrivialAugmentWide or RandAugment (default settings) if asked for. Without
    `geometry` only the policy: the cached path does the rest on the device (common.data.random_resized_crop);
    None when that leaves nothing to do per sample."""
    from torchvision.transforms import v2  # imported here: the in-memory datasets do not need it

    policy = {"none": [], "trivialaugment": [v2.TrivialAugmentWide()], "randaugment": [v2.RandAugment()]}[auto_augment]
    if not geometry and not policy:
        return None
    crop = [v2.RandomResizedCrop(image_size, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip(),
            v2.RandomVerticalFlip(), v2.RandomRotation(30)] if geometry else []
    return v2.Compose([v2.ToImage(), *crop, *policy, v2.ToPureTensor()])


def build_eval_transform(spec):
    """The evaluation preprocessing that a model description's "eval_transform" names (common.models.
    describe_model), PIL image or uint8 tensor in, uint8 (C, H, W) tensor out: {"resize": S, "center_crop":
    [H, W]} resizes the shorter side to S and crops the center; {"resize": [H, W]} resizes a PIL image to that
    size with PIL's bilinear filter, as `common.data.decode_image` decodes the in-memory datasets."""
    from torchvision.transforms import v2

    if "center_crop" in spec:
        return v2.Compose([v2.ToImage(), v2.Resize(spec["resize"], antialias=True), v2.CenterCrop(spec["center_crop"]),
                           v2.ToPureTensor()])
    return v2.Compose([v2.Resize(spec["resize"]), v2.ToImage(), v2.ToPureTensor()])


def build_folder_dataset(split, *, transform, skip_bad_images, cache_size=None, seed=None, accelerator=None):
    """An ImageFileDataset of a split's images (`find_splits`), each decoded once by `check_images` (shared out
    among the `accelerator`'s processes, kept in ROOT/.checked-NAME.json); the unreadable ones, left out with
    `skip_bad_images`, are in its `left_out`. `seed`: see ImageFileDataset.

    With a cache and no `transform` (nothing to do per sample) an InMemoryDataset over the mapped cache
    instead: each batch is one gather of its rows, in the training process, with no workers and no Python per
    image, so that the CPU only copies bytes while the device augments."""
    good, bad, cache = check_images(split["files"], skip_bad_images=skip_bad_images, cache_size=cache_size,
                                    accelerator=accelerator, record=split["root"] / f".checked-{split['name']}.json")
    labels, classes = [split["labels"][i] for i in good], split["classes"]
    if cache is not None and transform is None:
        dataset = InMemoryDataset(cache, torch.tensor(labels), classes, rows=good)
    else:
        dataset = ImageFileDataset([split["files"][i] for i in good], labels, classes, transform=transform,
                                   cache=None if cache is None else (cache, good), seed=seed)
    dataset.left_out = [path for path, _ in bad]
    return dataset


class ImageFileDataset(torch.utils.data.Dataset):
    """Images from files, or from a uint8 cache (`cache`: the images and each file's row), transformed per sample;
    items are dicts like InMemoryDataset's.

    With `seed`, each sample's random augmentation is drawn from a generator seeded by (seed, epoch, index):
    a function of the sample alone, not of which DataLoader worker made it or when, so a run resumed in the
    middle of an epoch augments exactly as the uninterrupted one. TrainingRun tells the epoch (`set_epoch`)
    through shared memory, which the workers see.
    """

    def __init__(self, files, labels, classes, *, transform, cache=None, seed=None):
        self.files, self.labels, self.classes = list(files), torch.tensor(labels), list(classes)
        self.transform, self.seed = transform, seed
        self.cache, self.cache_rows = cache if cache is not None else (None, None)
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def relabelled(self, classes):
        """This dataset with its labels numbered as `classes` (which hold all of its own), the same images."""
        to_new = [list(classes).index(name) for name in self.classes]
        return ImageFileDataset(self.files, [to_new[label] for label in self.labels.tolist()], classes,
                                transform=self.transform, cache=(self.cache, self.cache_rows), seed=self.seed)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        image = self.cache[self.cache_rows[index]] if self.cache is not None else read_image(self.files[index])
        if self.seed is None:
            return {"image": self.transform(image), "label": self.labels[index], "index": index}
        # fork_rng: with no workers this runs in the training process, whose own random stream must not move
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.SeedSequence([self.seed, int(self.epoch), index]).generate_state(1)[0]))
            return {"image": self.transform(image), "label": self.labels[index], "index": index}


class ImageFiles(torch.utils.data.Dataset):
    """Unlabelled image files (predict.py, export.py), preprocessed in a DataLoader worker; an unreadable one
    is named on stderr and comes out as a blank image with ok False."""

    def __init__(self, paths, *, transform, channels, image_size):
        self.paths, self.transform, self.channels, self.image_size = paths, transform, channels, image_size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        try:
            image, ok = self.transform(read_image(self.paths[index], channels=self.channels)), True
        except (OSError, ValueError) as error:
            print(f"skipped {self.paths[index]}: not a readable image ({error})", file=sys.stderr)
            image, ok = torch.zeros((self.channels, *self.image_size), dtype=torch.uint8), False
        return {"image": image, "ok": ok, "index": index}


class ClassBalancedSampler(torch.utils.data.Sampler):
    """As many indices per epoch as there are samples, each class drawn equally often (with replacement).

    The draw depends on (seed, epoch) only, so every process draws the same order and Accelerate's sharding
    splits it, and a resumed epoch skips into the very same order.
    """

    def __init__(self, labels, *, seed):
        labels = np.asarray(labels)
        self.weights = torch.as_tensor(1.0 / np.bincount(labels)[labels], dtype=torch.double)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.weights)

    def __iter__(self):
        seed = int(np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0])
        generator = torch.Generator().manual_seed(seed)
        return iter(torch.multinomial(self.weights, len(self.weights), replacement=True, generator=generator).tolist())


def balanced_class_weights(labels, num_classes):
    """Loss weights n / (num_classes * count): each class weighs as much in the loss as the others
    (scikit-learn's "balanced")."""
    counts = np.bincount(np.asarray(labels), minlength=num_classes)
    return torch.tensor(len(labels) / (num_classes * np.maximum(counts, 1)), dtype=torch.float32)


def choose_num_workers(given=None):
    """(DataLoader workers per process, how they were chosen): `given` (--num_workers), else the cores this
    process may use shared among the processes of this machine, less one for the process itself, at least 1
    and at most 8. More workers than cores only make them take turns (and on 2 cores halved the speed)."""
    if given is not None:
        return given, "--num_workers"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, min(8, cores // local - 1)), f"{cores} cores / {local} processes on this machine, less one"


def build_file_dataloader(dataset, *, batch_size, shuffle, drop_last=False, num_workers=None, sampler=None):
    """Workers decode and augment, each 4 batches ahead; pinned memory when there is a GPU; workers persist
    across epochs. `num_workers` None: `choose_num_workers`. `sampler` (a ClassBalancedSampler) replaces the
    shuffle. A dataset that gathers whole batches itself (build_folder_dataset's cache with nothing to do per
    sample) gets common.data.build_dataloader's loader instead, without workers.

    As for the in-memory loader, a generator of its own keeps the global RNG out of it.
    """
    if hasattr(dataset, "__getitems__"):
        return build_dataloader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, sampler=sampler)
    num_workers = choose_num_workers(num_workers)[0]
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None,
                                       sampler=sampler, drop_last=drop_last, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
                                       prefetch_factor=4 if num_workers > 0 else None,
                                       generator=torch.Generator(), worker_init_fn=_ignore_sigterm)


def _ignore_sigterm(worker_id):
    """torchrun and Slurm send SIGTERM to the whole process group, workers included. A worker that died of it
    would crash the training process before it could save; the training process decides when to stop, and
    its workers end with it (`_stop_workers_at_exit`; a worker whose process was killed notices within 5 s)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_workers_at_exit():
    """At exit, multiprocessing stops the daemonic children with SIGTERM and waits for them: forever, for workers
    that ignore it and that nothing has shut down yet (an error left their DataLoader in a traceback, or a
    persistent one was still referenced). So every exit, after an error too, kills them first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would call a killed worker a failure
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5)


atexit.register(_stop_workers_at_exit)  # after multiprocessing.util's (imported above), so it runs before it

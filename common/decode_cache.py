"""The one decode cache: every image of a list decoded once, unreadable ones named, and the result kept beside the
data with a fingerprint of the files, so that the next run reads it instead of decoding again.

ROOT/.checked-NAME.json records the check (fingerprint, the bad files, the sizes decoded); with a `cache` spec the
images, as evaluation first sees them, go into ROOT/.checked-NAME-SIZE.npy, decoded once per machine and size (each
process its share) and memory-mapped by every process, so that the page cache holds one copy. Where ROOT is
read-only, what it does not hold goes into this user's cache folder instead (`split_record`). Both files are best
effort: where neither can be written (a full disk), a run decodes into memory.
"""

import glob
import hashlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, gather_object

from .data import InMemoryDataset
from .errors import UserError, sigterm_deferred
from .images import build_eval_transform, read_image
from .outputs import publish, remove, write_if_possible


def check_images(files, *, skip_bad_images, cache=None, accelerator=None, record=None):
    """Decode every file once -> (indices of the good ones, [(file, error)] of the bad, the cache or None).

    A bad image stops the run with its name unless `skip_bad_images`. `cache`: an eval_transform spec
    (common.models.describe_model) for a uint8 (N, 3, H, W) of every listed file, zeros for the bad ones.
    With an `accelerator` each process decodes its share and all agree on the result. `record`: the JSON file
    that keeps it, or a list of them (`split_record`), read in order, the last one written (None: nothing is kept).
    """
    shrink = build_eval_transform(cache) if cache else None
    channels = cache.get("channels", 3) if cache else 3

    def decode(path):
        try:
            image = read_image(path, channels=channels)
            return shrink(image) if shrink else True
        except (OSError, ValueError) as error:
            return error

    bad, images = _decode_unless_recorded(files, decode, accelerator=accelerator, record=record, cache=cache)
    if bad and not skip_bad_images:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(f"cannot read image {bad[0][0]}: {bad[0][1]}{more}. Remove it, or pass --skip_bad_images "
                        "to leave unreadable images out")
    bad_files = {str(path) for path, _ in bad}
    good = [i for i, path in enumerate(files) if str(path) not in bad_files]
    if files and not good:
        raise UserError(f"none of the {len(files)} images could be read, e.g. {bad[0][0]}: {bad[0][1]}")
    return good, bad, images


def decode_split(split, *, size, channels=3, accelerator=None):
    """A split as `find_splits` gives it (image files, or a Hugging Face dataset's images) as an InMemoryDataset of
    RGB (`channels` 3) or grayscale images resized to `size`, decoded once into the decode cache, shared out among
    the processes. An unreadable image stops it, named."""
    _, bad, images = check_images(split["files"], skip_bad_images=True, accelerator=accelerator,
                                  record=split_record(split), cache={"resize": list(size), "channels": channels})
    if bad:
        raise UserError(f"cannot read image {bad[0][0]}: {bad[0][1]}. Remove it, or replace it with a readable copy")
    return InMemoryDataset(images, torch.tensor(split["labels"]), split["classes"], files=split["files"],
                           source=split.get("source"))


def split_record(split):
    """Where a split's check is kept: ROOT/.checked-NAME.json, or, where ROOT cannot be written (a cluster's shared
    datasets, mounted read-only), [that one, the same name in this user's cache for ROOT (`user_cache_folder`)]: a
    check or a size kept beside the data is read from there, any other is kept in the cache, so that only the first
    run decodes it (each process its share, as beside the data) and the next maps it. None for a Hugging Face
    dataset in memory."""
    if not split["root"]:
        return None
    beside = split["root"] / f".checked-{split['name']}.json"
    if os.access(split["root"], os.W_OK):
        return beside
    try:
        folder = user_cache_folder(split["root"])
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # no home either: decoded into memory, as the message then says
        return beside
    return [beside, folder / beside.name]


def user_cache_folder(root):
    """This user's folder for the checks of data folder `root`: $XDG_CACHE_HOME (else ~/.cache)/image-classification/
    decode/NAME-HASH, the hash of `root`'s resolved path (another folder of the same name gets its own)."""
    given = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(given) if os.path.isabs(given) else Path.home() / ".cache"  # a relative one is ignored (XDG's rule)
    resolved = str(Path(root).resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:12]
    return base / "image-classification" / "decode" / f"{Path(resolved).name}-{digest}"


def _decode_unless_recorded(files, decode, *, accelerator, record, cache):
    """([(file, error)] of the unreadable `files`, the cache or None). The main process reads the records, the
    first that holds this check (and size) wins, and decides for all (another run may be writing one right now);
    else it writes the last."""
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    records = [Path(record)] if isinstance(record, (str, Path)) else [Path(place) for place in record or ()]
    fingerprint = _fingerprint(files) if rank == 0 else None
    shape = (len(files), cache.get("channels", 3), *_size(cache)) if cache else None
    kept, record = None, records[-1] if records else None
    for place in records if rank == 0 else ():
        kept = _read_record(place, fingerprint, _decoded_path(place, cache), shape)
        if kept is not None:
            record = place
            break
    kept, record = broadcast_object_list([kept, record]) if processes > 1 else (kept, record)
    decoded = _decoded_path(record, cache)
    if kept is not None:
        if rank == 0:
            print(f"image check of {len(files)} images read from {record} (the files have not changed)")
        return [(Path(path), error) for path, error in kept], _map(decoded)

    if cache:
        bad, shares, images = _decode_shared_out(files, decode, decoded, shape[1:], accelerator)
    else:
        share = files[rank::processes]
        mine = [(str(path), f"{result}") for path, result in zip(share, _decode_all(decode, share))
                if isinstance(result, Exception)]
        bad, shares = (mine, [len(share)]) if processes == 1 else _gather_lists(mine, len(share))
        images = None
    order = {str(path): i for i, path in enumerate(files)}
    bad = sorted(((str(path), str(error)) for path, error in bad), key=lambda item: order[item[0]])
    written = decoded is not None and decoded.exists()
    if rank == 0:
        sizes = (_decoded_names(record, fingerprint) if record else set()) | ({decoded.name} if written else set())
        text = json.dumps({"fingerprint": fingerprint, "images": len(files), "checked_per_process": shares,
                           "decoded": sorted(sizes), "bad": bad})
        kept = record is not None and write_if_possible(Path(record), lambda tmp: tmp.write_text(text))
        print(f"checked {len(files)} images on {len(shares)} process(es) ({' + '.join(map(str, shares))})"
              + (f", kept in {record}" if kept else "")
              + (f"; decoded once for this machine into {decoded.name}" if written else ""))
    return [(Path(path), error) for path, error in bad], images


def _size(spec):
    crop = spec.get("center_crop", spec["resize"])
    return (crop, crop) if isinstance(crop, int) else tuple(crop)


def _size_name(spec):
    """55px (short side resized to 55, center square cropped: the folder datasets' training cache), 55to48px
    (resized to 55, center 48 cropped: their evaluation cache) or 32x32 (resized to that size)."""
    if "center_crop" not in spec:
        return "x".join(map(str, _size(spec))) + ("-gray" if spec.get("channels", 3) == 1 else "")
    crop = _size(spec)[0]
    return f"{crop}px" if spec["resize"] == crop else f"{spec['resize']}to{crop}px"


def _fingerprint(files):
    """A hash of the files' names, sizes and modification times (a Hugging Face split's: its own fingerprint)."""
    if hasattr(files, "fingerprint"):
        return files.fingerprint()
    stats = []
    for path in files:
        try:
            stat = os.stat(path)
            stats.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            stats.append(f"{path}:missing")
    return hashlib.sha256("\n".join(stats).encode()).hexdigest()


def _decoded_path(record, cache):
    """Where the images decoded to `cache`'s size go beside `record`: .checked-NAME-SIZE.npy (None without either)."""
    return record.with_name(f"{record.stem}-{_size_name(cache)}.npy") if record and cache else None


def _read_record(record, fingerprint, decoded, shape):
    """The bad list kept in `record` for these very files (with the `decoded` cache of that shape, when asked for),
    or None: decode again (no record, other files, a cache missing, cut short or not ours)."""
    try:
        kept = json.loads(Path(record).read_text())
        if kept["fingerprint"] != fingerprint:
            return None
        if decoded:
            images = np.load(decoded, mmap_mode="r")
            if decoded.name not in _names(kept) or images.shape != shape or images.dtype != np.uint8:
                return None
        return [(str(path), str(error)) for path, error in kept["bad"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _decoded_names(record, fingerprint):
    """The decoded sizes `record` names for these very files whose .npy files are still there (a record rewritten
    for another size keeps them: a run at an earlier size maps its cache again)."""
    try:
        kept = json.loads(Path(record).read_text())
        if kept["fingerprint"] != fingerprint:
            return set()
        return {name for name in _names(kept) if (record.parent / name).exists()}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _names(kept):
    decoded = kept["decoded"]  # a list; one name or None in the records of before
    return set(decoded) if isinstance(decoded, list) else {decoded} - {None}


def _decode_shared_out(files, decode, path, shape, accelerator):
    """([(file, error)], each process's share, uint8 (N, *shape)). The machine's main process creates the .npy
    under a temporary name, each of the machine's processes decodes every n-th file into its rows, then the main
    process renames it and every process maps it. Where it cannot be written, every process decodes all of them
    into memory instead."""
    machine, rank, processes = (_machine(accelerator) if accelerator and accelerator.num_processes > 1
                                else (0, 0, 1))
    tmp = None
    try:  # from the moment the file is made: a Ctrl-C, a SIGTERM (common.errors.Terminated), a lost process
        if path is not None and rank == 0:
            _remove_dead_leftovers(path)
            tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp.npy")
            try:
                np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(files), *shape)).flush()
                with open(tmp, "r+b") as file:  # the blocks, now: a mapped write into a full disk is a SIGBUS
                    os.posix_fallocate(file.fileno(), 0, os.fstat(file.fileno()).st_size)
            except OSError as error:  # a full disk, or a read-only one
                remove(tmp)
                tmp = None
                print(f"the decoded images could not be kept in {path} ({error.strerror or error}): decoded into "
                      "memory for this run, by each process, and again by the next run", flush=True)
        if processes > 1:  # the machine's main process names its file to the machine's other processes
            tmp = dict(gather_object([(machine, tmp)]) if rank == 0 else gather_object([]))[machine]
        if tmp is None:
            results = _decode_all(decode, files)
            blank = torch.zeros(shape, dtype=torch.uint8)
            images = torch.stack([blank if isinstance(result, Exception) else result for result in results])
            return [(str(f), f"{r}") for f, r in zip(files, results) if isinstance(r, Exception)], [len(files)], images
        rows = range(rank, len(files), processes)
        mine = _decode_rows(decode, files, rows, tmp)
        if accelerator is None or accelerator.num_processes == 1:
            bad, shares = mine, [len(rows)]
        else:  # also the moment every process of every machine has written its rows
            bad, shares = _gather_lists(mine, len(rows))
            bad = list(dict(bad).items())  # several machines: each image decoded once on each
        if rank == 0:
            publish(tmp, path)
    except BaseException:  # the half-written file, as big as the cache, not left in the data
        if rank == 0 and tmp is not None:
            remove(tmp)
        raise
    if accelerator:
        accelerator.wait_for_everyone()
    return bad, shares, _map(path)


def _decode_rows(decode, files, rows, path):
    """Decode `rows` of `files` into their rows of the .npy at `path` -> [(file, error)] of the unreadable ones.
    Where this process has more than one core and at least FORK_ROWS rows, forked helper processes (as many as its
    cores, at most 8, this one included) each write every n-th row and send back only their errors: a CIFAR-10 JPEG
    decodes in 0.13 ms, so threads would wait on the GIL, and one thread used one core of 16 on a GPU machine. A
    helper that dies leaves its rows to this process."""
    # Linux only: macOS's Python forks no longer by default (a forked child of a process with its system libraries
    # loaded may crash there), Windows cannot
    workers = decoders() if len(rows) >= FORK_ROWS and sys.platform == "linux" else 1
    if workers == 1:
        return _write_rows(decode, files, rows, path, threads=True)
    decode(files[rows[0]])  # what the first image imports, imported once, before the helpers are forked
    context, helpers = multiprocessing.get_context("fork"), []
    for part in (rows[i::workers] for i in range(1, workers)):
        receive, send = context.Pipe(duplex=False)
        inherited = [receive, *(earlier for _, earlier, _ in helpers)]  # the read ends the fork copies
        helper = context.Process(target=_helper, args=(decode, files, part, path, send, inherited), daemon=True)
        with sigterm_deferred():
            helper.start()
        send.close()
        helpers.append((helper, receive, part))
    bad = _write_rows(decode, files, rows[0::workers], path, threads=False)
    for helper, receive, part in helpers:
        try:
            bad += receive.recv()
        except EOFError:  # killed (out of memory?) before it sent its errors: its rows are decoded here
            bad += _write_rows(decode, files, part, path, threads=False)
        receive.close()
        helper.join()
    return bad


FORK_ROWS = 1024  # fewer rows decode in a fraction of a second: not worth a fork


def _helper(decode, files, rows, path, send, inherited):
    # Ctrl-C reaches the whole process group: the process that forked it says so once, and ends its daemonic
    # helpers with SIGTERM as it exits (a handler it may have installed would only set a flag here)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for receive in inherited:  # held here, a read end would keep a send to a killed parent waiting forever
        receive.close()
    torch.set_num_threads(1)  # as a DataLoader worker: one core each, no thread pool shared across the fork
    try:
        send.send(_write_rows(decode, files, rows, path, threads=False))
    except BrokenPipeError:  # the process that forked it is gone (killed): nobody to tell
        pass
    send.close()


def _write_rows(decode, files, rows, path, *, threads):
    """Decode `rows` of `files` into the .npy at `path` (on threads: `_decode_all`) -> [(file, error)]."""
    images = np.load(path, mmap_mode="r+")
    items = [files[row] for row in rows]
    results = _decode_all(decode, items) if threads else [decode(item) for item in items]
    bad = []
    for row, result in zip(rows, results):
        if isinstance(result, Exception):
            bad.append((str(files[row]), f"{result}"))
        else:
            images[row] = result.numpy()
    images.flush()
    return bad


def _remove_dead_leftovers(path):
    """The half-written caches that killed runs of this machine left beside `path` (each as big as the cache)."""
    for tmp in path.parent.glob(f"{glob.escape(path.name)}.{glob.escape(socket.gethostname())}.*.tmp.npy"):
        pid = tmp.name.removesuffix(".tmp.npy").rsplit(".", 1)[-1]
        try:
            os.kill(int(pid), 0)  # raises if no such process: the run that was writing it is gone
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, OSError):  # not our name, or a live process of another user
            pass


def _machine(accelerator):
    """(this machine's index, this process's index on it, the machine's process count): torchrun starts
    LOCAL_WORLD_SIZE processes with consecutive ranks on every machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return accelerator.process_index // local, accelerator.local_process_index, local


def machine_share():
    """(the cores this process may use, the processes of this machine): the affinity a scheduler gave (Slurm,
    taskset), not every core of the machine, shared among the LOCAL_WORLD_SIZE processes torchrun started."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores, int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def decoders():
    """How many threads or helper processes decode this process's share of the images: its share of the machine's
    cores (machine_share), 1 to 8 (1 where the machine runs more processes than it has cores)."""
    cores, local = machine_share()
    return max(1, min(8, cores // local))


def _decode_all(decode, items, chunk=64):
    """`decode` of each item, in order, on threads (PIL decodes without the GIL): this process's share of the
    cores, at most 8, each thread taking `chunk` items at a time. Images that decode in under SMALL_IMAGE_S each are
    decoded in this thread: for them the GIL, not the decoder, sets the pace, and threads only hand it back and forth
    (8,000 CIFAR-10 JPEGs on 2 cores: 1.0-1.3 s in one thread, 2.1-2.2 s on two with a task per image, 1.6-1.7 s
    on two with a task per 64; 800 seedling PNGs: 0.6-0.8 s in one, 0.3 s on two)."""
    threads = decoders()
    results = [decode(item) for item in items[:1]]  # the first may pay an import
    started = time.perf_counter()
    results += [decode(item) for item in items[1:chunk]]
    small = time.perf_counter() - started < SMALL_IMAGE_S * (len(results) - 1)
    if threads == 1 or small:
        return results + [decode(item) for item in items[chunk:]]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        parts = pool.map(lambda part: [decode(item) for item in part],
                         [items[start:start + chunk] for start in range(chunk, len(items), chunk)])
        return results + [result for part in parts for result in part]


SMALL_IMAGE_S = 0.3e-3  # a CIFAR-10 JPEG decodes in 0.13 ms, a seedling PNG in 0.8


def _map(path):
    """The .npy cache memory-mapped copy-on-write (never written, and torch does not warn of a read-only array)."""
    return torch.from_numpy(np.load(path, mmap_mode="c")) if path is not None and path.exists() else None


def _gather_lists(bad, count):
    """Every process's bad list, concatenated, and every process's share size."""
    gathered = gather_object([(bad, count)])
    return [item for mine, _ in gathered for item in mine], [count for _, count in gathered]

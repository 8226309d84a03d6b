"""A Hugging Face dataset's training split streamed (`--streaming`): read as it trains, never whole on the disk.

Each process reads its share of the stream (`datasets.distributed.split_dataset_by_node`: whole shards when their
number divides by the process count, else every n-th example), shuffled through a buffer of `buffer_size` examples
seeded by (seed, epoch) (`IterableDataset.shuffle` + `set_epoch`: a buffer, not a permutation of the split), and
decodes each micro-batch in threads into the decode cache's size; crop, flips and rotation then happen on the device,
as for the decode cache. An optimizer step is taken only while every process has a whole micro-batch: when one
process's share ends, the epoch ends for all. Each process's position in the epoch (the examples it has read, bad
ones included) goes into every checkpoint, so that a stopped run goes on where each stream stopped: exact, on the same
process count (each share depends on it). The validation split is streamed once at the start and kept decoded in
memory, every image counted once.
"""

import hashlib
import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .data import InMemoryDataset, MicroBatches, mix_seed
from .errors import UserError
from .hf import encoded
from .images import build_eval_transform, read_image


def check_resumable(state, num_processes):
    """A stream stopped inside an epoch goes on only on the process count that read it: each share depends on it."""
    if state and len(state["read"]) != num_processes:
        raise UserError(f"this checkpoint stopped inside epoch {state['epoch']} of a stream read by "
                        f"{len(state['read'])} process(es), and each one's share of a stream depends on their number: "
                        f"resume it on {len(state['read'])} process(es), or from a checkpoint at an epoch's end "
                        f"(--resume PATH) on any number")


class StreamedImage:
    """One streamed example's image: `read_image` opens it; named `hf:NAME[split] file.png (example N as read)`."""

    def __init__(self, value, name, position):
        self.value, self.name, self.position = value, name, position

    def open(self):
        return encoded(self.value)

    def __str__(self):
        path = self.value.get("path") if isinstance(self.value, dict) else None
        return f"{self.name} " + (f"{path} " if path else "") + f"(example {self.position} as read)"


def example_id(value):
    """A number for an example that is the same in every epoch and on every process: of its image's bytes (or the
    file it names). The epoch's count of unique training images is made of these."""
    if isinstance(value, dict):
        data = value.get("bytes") or str(value.get("path")).encode()
    else:
        data = value.encode() if isinstance(value, str) else bytes(value)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class StreamedBatches(MicroBatches):
    """This process's micro-batches of a streamed training split (`common.hf.find_hf_stream`'s "train"), in the steps
    MicroBatches plans, as a DataLoader with MicroBatches would give them: dicts of uint8 images, labels and example
    ids. Also its own batch sampler (`set_epoch`, `micro_batch`, `state_dict`), which TrainingRun drives. `reading`:
    {"size": the decode cache's spec the images are decoded to, "shuffle_buffer": examples, "skip_bad_images"}."""

    def __init__(self, split, *, batch_size, seed, accelerator, reading):
        from datasets.distributed import split_dataset_by_node

        # the steps planned for an epoch; fewer if a process's share of the stream ends first
        super().__init__(split["num_examples"], batch_size=batch_size, seed=seed, accelerator=accelerator)
        self.accelerator, self.num_processes = accelerator, accelerator.num_processes
        self.stream = split_dataset_by_node(split["stream"], rank=self.rank, world_size=self.num_processes)
        self.image_column, self.label_of, self.name = split["image_column"], split["label_of"], split["files_name"]
        self.buffer_size, self.skip_bad_images = reading["shuffle_buffer"], reading["skip_bad_images"]
        self.shrink = build_eval_transform(reading["size"])
        self.threads = max(1, len(os.sched_getaffinity(0)) // max(1, accelerator.num_processes))  # decoding
        self.batch_sampler, self.dataset = self, None  # the DataLoader's attributes that TrainingRun reads
        self.read, self.left_out = 0, []
        self._resume_read = None  # this process's examples read in the epoch a checkpoint stopped in

    def state_dict(self):
        """Every process's examples read so far in the epoch (a collective: every process calls it)."""
        read = self.accelerator.gather(torch.tensor([self.read], device=self.accelerator.device)).tolist()
        return {"epoch": self.epoch, "read": read}

    def load_state_dict(self, state):
        check_resumable(state, self.num_processes)
        self._resume_read = (state["epoch"], state["read"][self.rank])

    def __iter__(self):
        stream = self.stream.shuffle(seed=mix_seed(self.seed), buffer_size=self.buffer_size)
        stream.set_epoch(self.epoch)
        examples = iter(stream)
        resumed, self._resume_read = self._resume_read, None
        self.read = resumed[1] if resumed and resumed[0] == self.epoch and self.start else 0
        for _ in itertools.islice(examples, self.read):  # read again, not decoded: where this share stopped
            pass
        device = self.accelerator.device
        with ThreadPoolExecutor(self.threads) as pool:
            for _ in range(len(self)):
                batch = self._next_batch(examples, pool)
                # a step only while every process has a whole micro-batch: the shares may differ in length
                if self.accelerator.gather(torch.tensor([batch is not None], device=device)).min().item() == 0:
                    self.accelerator.print(f"epoch {self.epoch}: a process's share of the stream ended before the "
                                           f"{self.steps_per_epoch} planned steps (its shards are shorter): the epoch "
                                           "ends there for all")
                    return
                yield batch

    def _next_batch(self, examples, pool):
        """The next micro-batch of this process's share, or None at its end; bad images left out (and counted) with
        --skip_bad_images, else the run stops naming the first."""
        images, labels, ids = [], [], []
        while len(images) < self.batch_size:
            chunk = list(itertools.islice(examples, self.batch_size - len(images)))
            if not chunk:
                return None
            first = self.read
            self.read += len(chunk)
            sources = [StreamedImage(example[self.image_column], self.name, first + i) for i, example in
                       enumerate(chunk)]
            for source, example, image in zip(sources, chunk, pool.map(self._decode, sources)):
                if isinstance(image, Exception):
                    if not self.skip_bad_images:
                        raise UserError(f"cannot read image {source}: {image}. Replace it in the dataset, or start "
                                        "the run again with --skip_bad_images to leave unreadable images out")
                    self.left_out.append(str(source))
                    continue
                images.append(image)
                labels.append(self.label_of(example))
                ids.append(example_id(source.value))
        return {"image": torch.stack(images), "label": torch.tensor(labels), "index": torch.tensor(ids)}

    def _decode(self, source):
        try:
            return self.shrink(read_image(source))
        except (OSError, ValueError) as error:
            return error


def decode_streamed_split(split, *, cache):
    """A streamed held-out split (`find_hf_stream`'s "val") decoded whole into memory at `cache`'s size, on every
    process (evaluation shares it out). An unreadable image stops it, named."""
    shrink = build_eval_transform(cache)
    images = []
    for position, example in enumerate(split["stream"]):
        source = StreamedImage(example[split["image_column"]], split["files_name"], position)
        try:
            images.append(shrink(read_image(source)))
        except (OSError, ValueError) as error:
            raise UserError(f"cannot read image {source}: {error}. Remove it, or replace it with a readable copy")
    if len(images) != len(split["labels"]):
        raise UserError(f"{split['files_name']} changed while it was read ({len(split['labels'])} labels, "
                        f"{len(images)} images): start again")
    return InMemoryDataset(torch.stack(images), torch.tensor(split["labels"]), split["classes"],
                           source=split["source"])

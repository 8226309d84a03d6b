"""Speed of our CIFAR-10 data path and training step against the seed scripts' way, in one run.

    python scripts/benchmark.py --data_dir data/cifar10/train                 # CPU, a couple of minutes
    python scripts/benchmark.py --data_dir data/cifar10/train --device cuda \
        --mixed_precision bf16 --channels_last --compile --train_images 10000          # on a GPU

Data path alone (images/s, batches moved to the device and augmented, no model):
  ours: images decoded once into a uint8 tensor, whole batches fetched by index through a DataLoader
        prepared by Accelerate, crop (pad 4) + flip + normalise on the device;
  seed: per-sample PIL decode + RandomCrop + RandomHorizontalFlip + ToTensor + Normalize, default
        collate, as in the seed posts (one process, no workers: the rate per CPU core).
Training step (images/s, ResNet-18 with the CIFAR stem, SGD, same batch, same --mixed_precision,
--channels_last and --compile):
  ours: `accelerator.prepare` + `accelerator.backward` (common.distributed.build_accelerator);
  plain: the same model and optimizer in a bare PyTorch loop (torch.autocast, torch.compile by hand).
Training with its data (--train_images N > 0; images/s over N images, after one untimed pass):
  ours: our data path + the Accelerate training step with the flags above, as train_cifar.py runs;
  seed: the seed scripts' whole loop: the PIL pipeline (--seed_workers workers; the seeds use none),
        fp32, the model in its default layout, a bare PyTorch loop.
Small-model step (--small_steps N > 0; the MNIST convnet on 28x28 crops of the same images, batch 64,
AdamW), where per-step costs show:
  ours: train_mnist.py's loop: the in-memory loader prepared by Accelerate, preprocess, the Accelerate
        step, the LR schedule and TrainingRun's bookkeeping (common.run);
  plain: a bare PyTorch loop over the same uint8 batches already in memory, preprocess, the same step.
Each figure is measured --repeats times; the table shows min and median, the JSON (--output) has all.
"""

import contextlib
import json
import platform
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
from common.cifar import CIFAR10_MEAN, CIFAR10_STD  # noqa: E402
from common.data import InMemoryDataset, build_dataloader, preprocess  # noqa: E402
from common.distributed import build_accelerator  # noqa: E402
from common.errors import run_main  # noqa: E402
from common.flags import ArgumentParser, device, nonnegative_int, positive_int  # noqa: E402
from common.folders import socket_folder  # noqa: E402
from common.images import build_eval_transform, list_image_folder, read_image  # noqa: E402
from common.models import build_model  # noqa: E402
from common.outputs import write_atomically  # noqa: E402
from common.tools import check_output_file  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default="data/cifar10/train", help="CIFAR-10 JPEGs, DIR/<class>/*.jpg")
    parser.add_argument("--images", type=positive_int, default=5000, help="images used, spread over the classes")
    parser.add_argument("--batch_size", type=positive_int, default=128, help="default: %(default)s")
    parser.add_argument("--train_steps", type=positive_int, default=5, help="timed training steps per repeat")
    parser.add_argument("--repeats", type=positive_int, default=3, help="default: %(default)s")
    parser.add_argument("--train_images", type=nonnegative_int, default=0,
                        help="also time whole training passes over this many images, ours vs the seed script's")
    parser.add_argument("--small_steps", type=nonnegative_int, default=0,
                        help="also time this many steps of the small MNIST convnet, ours vs a plain loop")
    parser.add_argument("--seed_workers", type=nonnegative_int, default=0,
                        help="DataLoader workers of the seed-style passes")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no", help="default: %(default)s")
    parser.add_argument("--channels_last", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", default=None, help="also write the results as JSON here")
    return parser.parse_args(argv)


class SeedStyleDataset(torch.utils.data.Dataset):
    """The seed posts' pipeline: open each JPEG with PIL per sample and run torchvision transforms."""

    def __init__(self, files, labels):
        self.files, self.labels = files, labels
        self.transform = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                             transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        with Image.open(self.files[index]) as image:
            return self.transform(image.convert("RGB")), self.labels[index]


def timed(function, *, device, repeats):
    """images/s of `function()` (which returns how many images it processed), once per repeat."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = function()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(count / (time.perf_counter() - start))
    return rates


def data_path_ours(dataloader, device):
    count = 0
    for batch in dataloader:
        images = preprocess(batch["image"].to(device, non_blocking=True), normalize=(CIFAR10_MEAN, CIFAR10_STD),
                            padding=4, flip=True)
        count += len(images)
    return count


def data_path_seed(dataloader, device):
    count = 0
    for images, labels in dataloader:
        images, labels = images.to(device), labels.to(device)
        count += len(images)
    return count


def train_steps(model, optimizer, batches, *, backward, autocast=contextlib.nullcontext):
    """SGD steps over `batches` ((images, labels) pairs); returns the number of images."""
    loss_fn, count = torch.nn.CrossEntropyLoss(), 0
    for images, labels in batches:
        with autocast():
            loss = loss_fn(model(images), labels)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        count += len(images)
    return count


def is_benchmark_json(path):
    try:
        return "data_speedup_median" in json.loads(Path(path).read_text())
    except (OSError, ValueError, TypeError):
        return False


def small_model_rates(pixels, *, accelerator, device, steps, repeats, autocast):
    """images/s of the MNIST convnet's step over `steps` batches of 64: train_mnist.py's loop (loader,
    Accelerate step, schedule, TrainingRun.record) and a bare loop (under `autocast`, as Accelerate's
    mixed precision runs ours), alternating within each repeat."""
    import tempfile

    from common.models import describe_model
    from common.optim import build_lr_scheduler
    from common.run import TrainingRun

    gray = pixels[:, :1, 2:30, 2:30].contiguous()  # 28x28, one channel: the MNIST shape
    index = torch.arange(steps * 64) % len(gray)
    dataset = InMemoryDataset(gray[index], torch.arange(len(index)) % 10, [str(i) for i in range(10)])
    rescale = partial(preprocess, normalize=((0.0,), (1.0,)))

    def build():
        torch.manual_seed(0)
        model = build_model("mnist_convnet", num_classes=10, in_chans=1).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
        return model, optimizer, torch.nn.CrossEntropyLoss(label_smoothing=0.05)

    model, optimizer, loss_fn = build()
    plain_batches = [(dataset.images[i:i + 64].to(device), dataset.labels[i:i + 64].to(device))
                     for i in range(0, len(dataset), 64)]

    def plain():
        for images, labels in plain_batches:
            with autocast():
                loss = loss_fn(model(rescale(images)), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return len(dataset)

    ours_model, ours_optimizer, ours_loss_fn = build()
    ours_model, ours_optimizer, loader = accelerator.prepare(
        ours_model, ours_optimizer, build_dataloader(dataset, batch_size=64, shuffle=True))
    lr_scheduler = build_lr_scheduler(ours_optimizer, schedule="onecycle", total_steps=10**9)
    output_dir = tempfile.mkdtemp(prefix="benchmark-run-")
    run = TrainingRun(accelerator, output_dir, total_steps=10**9,
                      model_info=describe_model("mnist_convnet", dataset.classes, image_size=(28, 28),
                                                normalize=((0.0,), (1.0,)), dataset="mnist", arguments={}))
    run.start(None, model=ours_model, lr_scheduler=lr_scheduler)
    epochs = run.epochs(10**9)

    def ours():  # the loop of train_mnist.py, as it is written there; each pass one epoch
        next(epochs)
        for batch in run.batches(loader):
            images, labels = rescale(batch["image"]), batch["label"]
            with accelerator.accumulate(ours_model):
                loss = ours_loss_fn(ours_model(images), labels)
                accelerator.backward(loss)
                ours_optimizer.step()
                ours_optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                lr_scheduler.step()
            run.record(loss, batch)
            if run.checkpoint_due():
                run.save_checkpoint()
        return len(dataset)

    for loop in (plain, ours):
        loop()  # warm-up
    rates = {"small_plain": [], "small_ours": []}
    for _ in range(repeats):
        rates["small_plain"] += timed(plain, device=device, repeats=1)
        rates["small_ours"] += timed(ours, device=device, repeats=1)
    shutil.rmtree(output_dir, ignore_errors=True)
    return rates


def main(args):
    if args.output:
        check_output_file(args.output, suffix=".json", what="a JSON written by benchmark.py",
                          is_ours=is_benchmark_json)
    device = torch.device(args.device)
    files, labels, classes, _ = list_image_folder(args.data_dir)
    stride = max(1, len(files) // args.images)
    files, labels = files[::stride][:args.images], labels[::stride][:args.images]
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "images": len(files),
               "batch_size": args.batch_size, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d"),
               "settings": f"mixed_precision={args.mixed_precision} channels_last={args.channels_last} "
                           f"compile={args.compile}"}

    # data path: ours decodes once (timed separately), then serves batches from memory
    start = time.perf_counter()
    resize = build_eval_transform({"resize": [32, 32]})
    pixels = torch.stack([resize(read_image(f)) for f in files])
    results["ours_decode_once_images_per_s"] = len(files) / (time.perf_counter() - start)
    accelerator = build_accelerator(mixed_precision=args.mixed_precision, compile=args.compile)
    dataset = InMemoryDataset(pixels, torch.tensor(labels), classes)
    ours_loader = accelerator.prepare(build_dataloader(dataset, batch_size=args.batch_size, shuffle=True))
    seed_loader = torch.utils.data.DataLoader(SeedStyleDataset(files, labels), batch_size=args.batch_size,
                                              shuffle=True, num_workers=0)
    for key, data_path, loader in (("data_ours", data_path_ours, ours_loader),
                                   ("data_seed", data_path_seed, seed_loader)):
        data_path(loader, device)  # warm-up: first allocations, first device copies
        results[key] = timed(lambda: data_path(loader, device), device=device, repeats=args.repeats)

    # training step: the same model, optimizer, batch and settings, plain PyTorch and through Accelerate
    batch = next(iter(ours_loader))
    images = preprocess(batch["image"].to(device), normalize=(CIFAR10_MEAN, CIFAR10_STD), padding=4, flip=True)
    batches = [(images, batch["label"].to(device))] * args.train_steps

    def build(channels_last):
        torch.manual_seed(0)
        model = build_model("resnet18_cifar", num_classes=len(classes), channels_last=channels_last).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)

    plain_model, plain_optimizer = build(args.channels_last)
    plain_model = torch.compile(plain_model) if args.compile else plain_model
    plain_autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16")
    ours_model, ours_optimizer = accelerator.prepare(*build(args.channels_last))  # autocast, compile: Accelerate's
    loops = {"train_plain": (plain_model, plain_optimizer, partial(train_steps, backward=torch.Tensor.backward,
                                                                      autocast=plain_autocast)),
             "train_ours": (ours_model, ours_optimizer, partial(train_steps, backward=accelerator.backward))}
    for model, optimizer, loop in loops.values():
        loop(model.train(), optimizer, batches[:2])  # warm-up (and compile)
    # alternate the two so that a slower or faster moment of the machine hits both alike
    results["train_plain"], results["train_ours"] = [], []
    for _ in range(args.repeats):
        for key, (model, optimizer, loop) in loops.items():
            results[key] += timed(lambda: loop(model, optimizer, batches), device=device, repeats=1)

    if args.small_steps:  # per-step costs: the small model's step with our bookkeeping against a bare loop
        results.update(small_model_rates(pixels.permute(0, 3, 1, 2), accelerator=accelerator, device=device,
                                         steps=args.small_steps, repeats=args.repeats, autocast=plain_autocast))

    if args.train_images:  # whole passes with their data: the seed script's loop against ours
        files, labels = files[:args.train_images], labels[:args.train_images]  # a subset of the images above
        if args.seed_workers:
            socket_folder()  # where its workers' sockets can be bound, as our loaders' are
        seed_loader = torch.utils.data.DataLoader(SeedStyleDataset(files, labels), batch_size=args.batch_size,
                                                  shuffle=True, num_workers=args.seed_workers,
                                                  persistent_workers=args.seed_workers > 0)
        seed_model, seed_optimizer = build(channels_last=False)
        ours_loader = accelerator.prepare(build_dataloader(
            InMemoryDataset(dataset.images[:len(files)], dataset.labels[:len(files)], classes),
            batch_size=args.batch_size, shuffle=True))
        seed_pass = partial(train_steps, seed_model.train(), seed_optimizer, backward=torch.Tensor.backward)
        ours_pass = partial(train_steps, ours_model, ours_optimizer, backward=accelerator.backward)

        def seed_batches():
            return ((images.to(device), labels.to(device)) for images, labels in seed_loader)

        def ours_batches():
            return ((preprocess(b["image"], normalize=(CIFAR10_MEAN, CIFAR10_STD), padding=4, flip=True), b["label"])
                    for b in ours_loader)

        for key, one_pass, batches_of in (("train_seed_script", seed_pass, seed_batches),
                                          ("train_ours_with_data", ours_pass, ours_batches)):
            one_pass(batches_of())  # warm-up: workers start, compile sees the last, smaller batch too
            results[key] = timed(lambda: one_pass(batches_of()), device=device, repeats=args.repeats)

    rows = {"data_ours": "data path, ours (uint8 in memory, on-device aug)",
            "data_seed": "data path, seed style (PIL + ToTensor)",
            "train_ours": "training step, ours (Accelerate)",
            "train_plain": "training step, plain PyTorch loop"}
    if args.small_steps:
        rows.update(small_ours="MNIST convnet step, ours (train_mnist.py loop)",
                    small_plain="MNIST convnet step, plain loop")
    if args.train_images:
        rows.update(train_ours_with_data="training with data, ours",
                    train_seed_script=f"training with data, seed script ({args.seed_workers} workers)")
    median = {key: statistics.median(results[key]) for key in rows}
    results["data_speedup_median"] = median["data_ours"] / median["data_seed"]
    results["train_ours_vs_plain_median"] = median["train_ours"] / median["train_plain"]
    if args.small_steps:
        results["small_ours_vs_plain_median"] = median["small_ours"] / median["small_plain"]
    if args.train_images:
        results["train_with_data_speedup_median"] = median["train_ours_with_data"] / median["train_seed_script"]
    print(f"device {results['device']} ({results['cpu_threads']} CPU threads), torch {results['torch']}, "
          f"{results['images']} CIFAR-10 JPEGs, batch {args.batch_size}, {args.repeats} repeats, training step: "
          f"{results['settings']}")
    print(f"{'images/s':<50} {'min':>10} {'median':>10}")
    for key, label in rows.items():
        print(f"{label:<50} {min(results[key]):>10,.0f} {median[key]:>10,.0f}")
    print(f"{'(ours: one-time decode of the JPEGs)':<50} {results['ours_decode_once_images_per_s']:>21,.0f}")
    print(f"data path speed-up, ours / seed style: {results['data_speedup_median']:.1f}x (medians)")
    print(f"training step, ours / plain: {results['train_ours_vs_plain_median']:.3f} (medians)")
    if args.small_steps:
        print(f"MNIST convnet step with our bookkeeping, ours / plain: {results['small_ours_vs_plain_median']:.3f} "
              f"(medians, {args.small_steps} steps of 64)")
    if args.train_images:
        print(f"training with data, ours / seed script: {results['train_with_data_speedup_median']:.1f}x (medians, "
              f"{len(files)} images a pass)")
    if args.output:
        write_atomically(args.output, lambda tmp: tmp.write_text(json.dumps(results, indent=2) + "\n"))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    run_main(main, parse_args())

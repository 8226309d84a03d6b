"""Fine-tune ResNet-50 (or any timm model) on Plant Seedlings, or any folder of class folders.

Recipe (the seed post's): Adam lr 1e-4, cosine annealing to 1e-6 (optional warmup), timm Mixup/CutMix
(mixup alpha 0.8, cutmix alpha 1.0, prob 0.1, switch prob 0.5, label smoothing 0.1) with a soft-target
cross entropy, gradient clipping at norm 5.0, SyncBatchNorm on several GPUs, mixed precision from the
Accelerate config, ImageNet-pretrained weights when you give them. Train images get a random resized
crop, flips and a rotation; evaluation resizes and center-crops. Training drops the last incomplete
batch: mixup needs an even batch, and an odd one would otherwise be mixed differently.
Accuracy and time: see README "Results" (only what was measured is reported there).

Data (--data_dir): `DIR/<class>/<image>` (split here: stratified, --val_fraction 0.3, --seed), or
`DIR/train/<class>/...` + `DIR/val/<class>/...` (for example written by scripts/split_dataset.py).
Normalisation: `--mean_std FILE` from scripts/compute_mean_std.py, else ImageNet's.

Launch:
    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/train_seedlings.py \\
        --data_dir data/plant-seedlings --pretrained resnet50_a1_in1k.safetensors
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/train_seedlings.py \\
        --data_dir data/plant-seedlings --model resnet18 --image_size 128 --epochs 5 --cache_images

Checkpoints: output_dir/checkpoints/ after every epoch (and every --checkpoint_every steps, and on SIGTERM);
continue a stopped run with the same command plus `--resume latest`.
"""

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import set_seed
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
from common.checkpoint import end_epoch, find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from common.errors import UserError, run  # noqa: E402
from common.flags import (ArgumentParser, add_common_args, args_to_dict, check_args, nonnegative_float,  # noqa: E402
                          nonnegative_int, number, probability, restore_args)
from common.data import preprocess  # noqa: E402
from common.distributed import build_accelerator  # noqa: E402
from common.engine import build_lr_scheduler, evaluate, train_one_epoch  # noqa: E402
from common.folders import (IMAGENET_MEAN, IMAGENET_STD, ImageFileDataset, build_file_dataloader,  # noqa: E402
                            build_transforms, check_images, find_splits, resize_size)
from common.outputs import prepare_output_dir, set_aside_earlier_run  # noqa: E402
from common.models import build_model, load_pretrained  # noqa: E402
from common.reporting import describe_launch, finish_run, log_epoch  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50", help="any timm model name (default: %(default)s)")
    parser.add_argument("--pretrained", default=None, metavar="FILE|hub",
                        help="ImageNet weights: a .safetensors/.pth file, or `hub` to download (online only)")
    parser.add_argument("--image_size", type=number(int, min=16, max=4096), default=224, help="train and eval crop (default: %(default)s)")
    parser.add_argument("--val_fraction", type=number(float, min=0, max=1, min_open=True, max_open=True), default=0.3, help="when DIR is split here (default: %(default)s)")
    parser.add_argument("--mean_std", default=None, help="JSON from scripts/compute_mean_std.py (default: ImageNet's)")
    parser.add_argument("--mixup_alpha", type=nonnegative_float, default=0.8, help="0 turns mixup off (default: %(default)s)")
    parser.add_argument("--cutmix_alpha", type=nonnegative_float, default=1.0, help="0 turns cutmix off (default: %(default)s)")
    parser.add_argument("--mixup_prob", type=probability, default=0.1, help="share of batches mixed (default: %(default)s)")
    parser.add_argument("--mixup_switch_prob", type=probability, default=0.5, help="cutmix instead of mixup (default: %(default)s)")
    parser.add_argument("--sync_bn", action=argparse.BooleanOptionalAction, default=None,
                        help="SyncBatchNorm (default: on with CUDA and more than one process, else off)")
    parser.add_argument("--num_workers", type=nonnegative_int, default=4, help="DataLoader workers per process (default: %(default)s)")
    parser.add_argument("--cache_images", action="store_true", help="decode and resize every image once, into memory")
    parser.add_argument("--skip_bad_images", action="store_true", help="leave unreadable images out instead of stopping")
    add_common_args(parser, output_dir="outputs/seedlings", epochs=20, batch_size=32, lr=1e-4, weight_decay=0.0,
                    label_smoothing=0.1, schedule="cosine", warmup_fraction=0.0, max_grad_norm=5.0)
    return parser.parse_args(argv)


def read_mean_std(path):
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


def main(args):
    check_args(args)
    checkpoint = find_checkpoint(args.output_dir, args.resume) if args.resume else None
    if checkpoint:  # a resumed run continues with the arguments it started with
        args = restore_args(args, checkpoint["args"], parse_args=parse_args, runtime={"num_workers", "cache_images"})
    mixing = args.mixup_alpha > 0 or args.cutmix_alpha > 0
    if mixing and args.batch_size % 2:
        raise UserError(f"mixup/cutmix mix each batch with its mirror image and need an even --batch_size, got "
                        f"{args.batch_size}; or turn them off with --mixup_alpha 0 --cutmix_alpha 0")
    accelerator = build_accelerator(mixed_precision=args.mixed_precision, compile=args.compile,
                                    grad_accum=args.grad_accum, report_to=args.report_to, output_dir=args.output_dir,
                                    dist_timeout=args.dist_timeout)
    output_dir = prepare_output_dir(args.output_dir, overwrite=args.overwrite, resume=args.resume,
                                    inputs=[args.data_dir], accelerator=accelerator)
    set_seed(args.seed)
    mean, std = read_mean_std(args.mean_std)

    # data: files listed and split the same way on every rank, every image decoded once up front
    train_split, val_split, classes, skipped = find_splits(args.data_dir, val_fraction=args.val_fraction,
                                                           seed=args.seed)
    if skipped:
        accelerator.print(f"warning: skipped {len(skipped)} files that are not images, e.g. {skipped[0]}")
    train_transform, eval_transform = build_transforms(args.image_size)
    datasets = {}
    for name, split, transform in (("train", train_split, train_transform), ("val", val_split, eval_transform)):
        good, bad, cache = check_images(split["files"], skip_bad_images=args.skip_bad_images,
                                        cache_size=resize_size(args.image_size) if args.cache_images else None)
        if bad:
            accelerator.print(f"warning: left out {len(bad)} unreadable {name} images, e.g. {bad[0][0]}")
        datasets[name] = ImageFileDataset([split["files"][i] for i in good], [split["labels"][i] for i in good],
                                          classes, transform=transform, cache=cache)
    loader = partial(build_file_dataloader, batch_size=args.batch_size, num_workers=args.num_workers)
    # drop_last: every training batch is full, so even (mixup) and the same size on every process
    train_dataloader = loader(datasets["train"], shuffle=True, drop_last=True)
    eval_dataloader = loader(datasets["val"], shuffle=False)
    if len(train_dataloader) == 0:
        raise UserError(f"{len(datasets['train'])} training images make no full batch of --batch_size "
                        f"{args.batch_size}: lower it")
    normalise = partial(preprocess, mean=mean, std=std)

    # model and optimisation; model_meta goes into best/meta.json (predict.py rebuilds the model from it)
    # and into every checkpoint
    model_meta = {"architecture": args.model, "model_kwargs": {"num_classes": len(classes), "in_chans": 3},
                  "class_names": classes, "image_size": [args.image_size, args.image_size],
                  "resize_size": resize_size(args.image_size), "mean": list(mean), "std": list(std),
                  "args": args_to_dict(args)}
    model = build_model(args.model, **model_meta["model_kwargs"], channels_last=args.channels_last)
    if args.pretrained and not checkpoint:
        accelerator.print(load_pretrained(model, args.model, args.pretrained))
    sync_bn = torch.cuda.is_available() and accelerator.num_processes > 1 and args.sync_bn is not False
    if args.sync_bn and not sync_bn:
        accelerator.print("--sync_bn ignored: SyncBatchNorm needs CUDA and more than one process")
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    total_steps = args.epochs * math.ceil(len(train_dataloader) / args.grad_accum)
    total_steps = min(total_steps, args.max_steps or total_steps)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=args.schedule, total_steps=total_steps,
                                      warmup_fraction=args.warmup_fraction, min_lr_ratio=1e-6 / args.lr)
    mixup = Mixup(mixup_alpha=args.mixup_alpha, cutmix_alpha=args.cutmix_alpha, prob=args.mixup_prob,
                  switch_prob=args.mixup_switch_prob, label_smoothing=args.label_smoothing,
                  num_classes=len(classes)) if mixing else None
    loss_fn = SoftTargetCrossEntropy() if mixing else torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    set_aside_earlier_run(output_dir, accelerator)  # all read and checked: --overwrite may now move the old run
    accelerator.init_trackers("train_seedlings", config=args_to_dict(args))
    accelerator.print(f"{args.data_dir}: {len(classes)} classes, {len(datasets['train'])} train / "
                      f"{len(datasets['val'])} val images, {total_steps} optimizer steps; SyncBatchNorm "
                      f"{'on' if sync_bn else 'off'}; {describe_launch(accelerator, batch_size=args.batch_size, grad_accum=args.grad_accum)}")

    # epoch loop; a checkpoint at the end of each epoch (and every --checkpoint_every steps, and on SIGTERM)
    progress = load_checkpoint(accelerator, checkpoint, output_dir, model=model, lr_scheduler=lr_scheduler,
                               meta=model_meta, total_steps=total_steps)  # a new run's start without --resume
    save = partial(save_checkpoint, accelerator, output_dir, lr_scheduler=lr_scheduler, meta=model_meta,
                   keep=args.keep_checkpoints)
    for epoch in range(progress["epoch"], args.epochs + 1):
        start = time.perf_counter()
        train = train_one_epoch(model, train_dataloader, optimizer, lr_scheduler, accelerator, progress=progress,
                                loss_fn=loss_fn, transform=normalise, mixup=mixup, max_grad_norm=args.max_grad_norm,
                                max_steps=total_steps, checkpoint_every=args.checkpoint_every, save_checkpoint=save)
        evaluation = evaluate(model, eval_dataloader, accelerator, transform=normalise)
        log_epoch(accelerator, output_dir, epoch=epoch, epochs=args.epochs, step=progress["step"], train=train,
                  evaluation=evaluation, lr=lr_scheduler.get_last_lr()[0], epoch_time_s=time.perf_counter() - start)
        end_epoch(accelerator, model, output_dir, progress, epoch=epoch, evaluation=evaluation, meta=model_meta,
                  save_checkpoint=save)  # best/ if it improved, then the epoch's checkpoint
        if progress["step"] >= total_steps:
            break
    finish_run(accelerator, output_dir, evaluation=evaluation, class_names=classes)


if __name__ == "__main__":
    run(main, parse_args())

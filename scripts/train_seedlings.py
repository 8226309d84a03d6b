"""Fine-tune ResNet-50 (or any timm model) on Plant Seedlings, or any folder of class folders.

Recipe. Kept from the seed post: Adam lr 1e-4 (here at a global batch of 32, scaled by the square root
of the global batch unless --lr is given), cosine annealing to 1e-6, timm Mixup/CutMix (mixup alpha
0.8, cutmix alpha 1.0, prob 0.1, switch prob 0.5) with a soft-target cross entropy, label smoothing 0.1,
gradient clipping at norm 5.0, SyncBatchNorm on several GPUs, mixed precision (from the Accelerate config),
ImageNet-pretrained weights when you give them. Changed: batch 32 per process (the seed: 256), 20 epochs
(the seed: 1000), the LR stepped per optimizer step rather than per epoch, random resized crop + flips +
rotation (+-30 degrees, --rotation) instead of a squashing resize, ImageNet's mean/std unless --mean_std, and
evaluation at 224 after a 256 resize and center crop. Training drops the last incomplete batch: mixup needs an
even batch.
Options, off by default: for imbalanced folders --class_weights balanced and --sampler balanced; stronger
augmentation with --auto_augment and --random_erasing; --ema_decay; --patience N (early stopping).
Accuracy and time: see docs/results.md (only what was measured is reported there).

Data (--data_dir): `DIR/<class>/<image>` (split here: stratified, --val_fraction 0.3, --seed), or
`DIR/train/<class>/...` + `DIR/val/<class>/...` (for example written by scripts/split_dataset.py), or a Hugging
Face dataset `hf:NAME_OR_PATH` (common/hf.py; with --streaming its training split is read while training,
common/streaming.py).
Decoded once into a cache file beside the data and augmented on the device when it takes at most 4 GB,
else read from the files by DataLoader workers (--cache_images / --no-cache_images choose).
Normalisation: `--mean_std FILE` from scripts/compute_mean_std.py, else ImageNet's.

Launch:
    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/train_seedlings.py \\
        --data_dir data/plant-seedlings --pretrained resnet50_a1_in1k.safetensors
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/train_seedlings.py \\
        --data_dir data/plant-seedlings --model resnet18 --image_size 128 --epochs 5

Checkpoints: output_dir/checkpoints/ after every epoch (and every --checkpoint_every steps, and on SIGTERM);
continue a stopped run with the same command plus `--resume latest`.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
try:  # a copy of this script needs the folder of what the scripts share (docs/recipes.md)
    import common.errors  # noqa: E402
except ModuleNotFoundError as missing:
    sys.exit(f"error: {Path(__file__).name} needs the common/ folder it came with, beside it or one folder up "
             f"({missing}): copy common/ into your repository too")
common.errors.on_another_version_of_common(__file__)
# torch only now: a copy without common/ is told so at once, not after seconds of imports
import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torchvision.transforms.v2.functional import center_crop  # noqa: E402
from common.checkpoint import resolve_args  # noqa: E402
from common.data import InMemoryDataset, MicroBatches, preprocess  # noqa: E402
from common.distributed import build_accelerator  # noqa: E402
from common.errors import UserError, run_main  # noqa: E402
from common.evaluation import evaluate  # noqa: E402
from common.flags import (ArgumentParser, add_common_args, args_to_dict, nonnegative_float,  # noqa: E402
                          nonnegative_int, number, path, positive_int, probability)
from common.folders import (balanced_class_weights, balanced_sampling_weights, build_file_dataloader,  # noqa: E402
                            build_folder_dataset, build_train_transform, choose_cache, choose_num_workers,
                            find_splits, random_resized_crop, read_mean_std, training_cache)
from common.hf import add_hf_args, find_hf_stream, hf_options  # noqa: E402
from common.images import SKIPPED, build_eval_transform  # noqa: E402
from common.models import (build_ema, build_model, check_batch_norm, check_model_name, describe_model,  # noqa: E402
                           load_pretrained, read_pretrained)
from common.optim import build_lr_scheduler, fused_on_cpu, scale_lr  # noqa: E402
from common.outputs import prepare_output_dir  # noqa: E402
from common.reporting import describe_launch  # noqa: E402
from common.run import TrainingRun, count_steps  # noqa: E402
from common.streaming import StreamedBatches, check_resumable, decode_streamed_split  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50", help="any timm model name (default: %(default)s)")
    parser.add_argument("--pretrained", type=path, default=None, metavar="FILE|hub",
                        help="ImageNet weights: a .safetensors/.pth file, or `hub` to download (online only)")
    parser.add_argument("--image_size", type=number(int, min=16, max=4096), default=224, help="train and eval crop (default: %(default)s)")
    parser.add_argument("--val_fraction", type=number(float, min=0, max=1, min_open=True, max_open=True), default=0.3, help="when DIR is split here (default: %(default)s)")
    parser.add_argument("--mean_std", type=path, default=None,
                        help="JSON from scripts/compute_mean_std.py (default: ImageNet's)")
    parser.add_argument("--mixup_alpha", type=nonnegative_float, default=0.8, help="0 turns mixup off (default: %(default)s)")
    parser.add_argument("--cutmix_alpha", type=nonnegative_float, default=1.0, help="0 turns cutmix off (default: %(default)s)")
    parser.add_argument("--mixup_prob", type=probability, default=0.1, help="share of batches mixed (default: %(default)s)")
    parser.add_argument("--mixup_switch_prob", type=probability, default=0.5, help="cutmix instead of mixup (default: %(default)s)")
    parser.add_argument("--sync_bn", action=argparse.BooleanOptionalAction, default=None,
                        help="SyncBatchNorm (default: on with CUDA and more than one process, else off)")
    parser.add_runtime_argument("--num_workers", type=nonnegative_int, default=None,
                                help="DataLoader workers per process (default: from the cores per process, in the log)")
    parser.add_argument("--cache_images", action=argparse.BooleanOptionalAction, default=None,
                        help="decode every image once into a file beside the data, augment on the device, no workers "
                             "(default: on when the decoded images take at most 4 GB; --no-cache_images: files)")
    parser.add_argument("--skip_bad_images", action="store_true", help="leave unreadable images out instead of stopping")
    parser.add_argument("--class_weights", choices=["none", "balanced"], default="none",
                        help="weigh each class's loss by n / (classes x its count) (default: %(default)s)")
    parser.add_argument("--sampler", choices=["random", "balanced"], default="random",
                        help="balanced: draw every class equally often, with replacement (default: %(default)s)")
    parser.add_argument("--auto_augment", choices=["none", "trivialaugment", "randaugment"], default="none",
                        help="a policy after crop, flips and rotation, in the workers (default: %(default)s)")
    parser.add_argument("--rotation", type=number(min=0, max=180), default=30.0,
                        help="rotate each training image by up to +-DEGREES (default: %(default)s, for plants seen "
                             "from above; 0 for photos that have an up)")
    parser.add_argument("--random_erasing", type=probability, default=0.0,
                        help="share of training images with a rectangle erased, on the device (default: %(default)s)")
    parser.add_argument("--patience", type=positive_int, default=None,
                        help="stop after N epochs without a better val accuracy (default: train every epoch)")
    add_common_args(parser)
    add_hf_args(parser, streaming=True)
    parser.set_defaults(output_dir="outputs/seedlings", epochs=20, batch_size=32, weight_decay=0.0,
                        label_smoothing=0.1, schedule="cosine", warmup_fraction=0.0, max_grad_norm=5.0)
    return parser.parse_args(argv)


def check_streaming(args):
    """--streaming reads each training image once an epoch, in the order of the stream: the options that need the
    whole split first, or a worker per image, are refused."""
    for flag, given in (("--auto_augment", args.auto_augment != "none"), ("--sampler balanced", args.sampler != "random"),
                        ("--class_weights balanced", args.class_weights != "none"),
                        ("--cache_images / --no-cache_images", args.cache_images is not None)):
        if given:
            raise UserError(f"{flag} cannot be used with --streaming: a stream is decoded per micro-batch and "
                            "augmented on the device, in the order it is read; drop one of them")
    if "val_fraction" in args.typed:
        raise UserError(f"--val_fraction {args.val_fraction} cannot be used with --streaming: a stream is not split "
                        "here, its held-out split validates (--val_split names it); drop --val_fraction")


def main(args):
    # --resume: the checkpoint's arguments, but for the loading flags
    args, checkpoint = resolve_args(args, parse_args=parse_args)
    mixing = args.mixup_alpha > 0 or args.cutmix_alpha > 0
    if mixing and args.batch_size % 2:
        raise UserError(f"mixup/cutmix mix each batch with its mirror image and need an even --batch_size, got "
                        f"{args.batch_size}; or turn them off with --mixup_alpha 0 --cutmix_alpha 0")
    if args.streaming:
        check_streaming(args)
    check_model_name(args.model, image_size=args.image_size)  # before the images are read, as --pretrained is
    pretrained = read_pretrained(args.model, args.pretrained) if args.pretrained and not checkpoint else None
    accelerator = build_accelerator(mixed_precision=args.mixed_precision, compile=args.compile,
                                    grad_accum=args.grad_accum, report_to=(args.report_to, args.output_dir),
                                    dist_timeout=args.dist_timeout)
    if checkpoint and args.streaming and checkpoint["batch"]:
        check_resumable(checkpoint.get("stream"), accelerator.num_processes)
    output_dir = prepare_output_dir(args.output_dir, overwrite=args.overwrite, resume=args.resume,
                                    inputs=[args.data_dir], accelerator=accelerator)
    set_seed(args.seed)

    # data: files listed and split the same way on every rank, every image decoded once up front (streamed: the
    # held-out split at the start, the training split as it is read)
    mean, std = read_mean_std(args.mean_std)
    if args.streaming:  # read while training: no image check, no decode cache beside the data
        (train_split, val_split, classes), skipped = find_hf_stream(args.data_dir, **hf_options(args)), []
    else:
        train_split, val_split, classes, skipped = find_splits(args.data_dir, val_fraction=args.val_fraction,
                                                               seed=args.seed, hf_options=hf_options(args),
                                                               fraction_typed="val_fraction" in args.typed)
    model_info = describe_model(args.model, classes, image_size=(args.image_size, args.image_size),
                                normalize=(mean, std), dataset="folder",
                                arguments=args_to_dict(args))  # into best/ and every checkpoint
    # each process checks its share of the images; the result is kept beside the data for the next run. With the
    # decode cache, crop, flips and rotation happen on the device: the CPU only gathers each batch's rows (without
    # --auto_augment), evaluation reads its images already resized and cropped, and no worker runs
    eval_spec = model_info["eval_transform"]
    num_workers, workers_rule = choose_num_workers(args.num_workers)
    if args.streaming:  # decoded per micro-batch at the cache's size and augmented on the device, as with the cache
        cache_images = True
        train_set = train_dataloader = StreamedBatches(
            train_split, batch_size=args.batch_size, seed=args.seed, accelerator=accelerator,
            reading={"size": training_cache(eval_spec), "shuffle_buffer": args.shuffle_buffer,
                     "skip_bad_images": args.skip_bad_images})
        eval_set = decode_streamed_split(val_split, cache=eval_spec)
    else:
        cache_images, cache_rule = choose_cache(args.cache_images, size=eval_spec["resize"],
                                                images=len(train_split["files"]) + len(val_split["files"]))
        folder_dataset = partial(build_folder_dataset, skip_bad_images=args.skip_bad_images, accelerator=accelerator)
        train_set = folder_dataset(train_split, transform=build_train_transform(args.image_size, args.auto_augment,
                                                                                geometry=not cache_images,
                                                                                degrees=args.rotation),
                                   cache=training_cache(eval_spec) if cache_images else None, seed=args.seed)
        eval_set = folder_dataset(val_split, transform=None if cache_images else build_eval_transform(eval_spec),
                                  cache=eval_spec if cache_images else None)
        # the same micro-batches and global steps on any process count (a run resumes on another one); all full
        weights = balanced_sampling_weights(train_set.labels) if args.sampler == "balanced" else None
        train_dataloader = build_file_dataloader(train_set, num_workers=num_workers, batch_sampler=MicroBatches(
            len(train_set), batch_size=args.batch_size, seed=args.seed, accelerator=accelerator, weights=weights))
        for name, left_out in ((SKIPPED, skipped),
                               ("unreadable train images", train_set.left_out),
                               ("unreadable val images", eval_set.left_out)):
            if left_out:
                accelerator.print(f"warning: left out {len(left_out)} {name}, e.g. {left_out[0]}")
    eval_dataloader = build_file_dataloader(eval_set, batch_size=args.batch_size, num_workers=num_workers)
    normalise = partial(preprocess, normalize=(mean, std), erase={"erasing": args.random_erasing})  # on the device

    def train_transform(images):
        return normalise(random_resized_crop(images, size=args.image_size, degrees=args.rotation) if cache_images
                         else images)

    eval_transform = partial(preprocess, normalize=(mean, std))

    # model and optimisation
    sync_bn = torch.cuda.is_available() and accelerator.num_processes > 1 and args.sync_bn is not False
    model = build_model(args.model, **model_info["model_kwargs"], channels_last=args.channels_last,
                        image_size=args.image_size)
    # SyncBatchNorm normalizes over every process's batch
    check_batch_norm(model, model_info, batch_size=args.batch_size * (accelerator.num_processes if sync_bn else 1))
    if pretrained is not None:
        accelerator.print(load_pretrained(model, args.model, args.pretrained, pretrained))
    if args.sync_bn and not sync_bn:
        accelerator.print("--sync_bn ignored: SyncBatchNorm needs CUDA and more than one process")
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # the recipe's LR is 1e-4 at a global batch of 32; without --lr it follows the global batch's square root
    global_batch = args.batch_size * accelerator.num_processes * args.grad_accum
    lr, lr_rule = scale_lr(args.lr, base_lr=1e-4, base_batch=32, global_batch=global_batch, rule="sqrt")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=args.weight_decay,
                                 **fused_on_cpu(accelerator.device))
    model, optimizer, eval_dataloader = accelerator.prepare(model, optimizer, eval_dataloader)
    total_steps = count_steps(train_dataloader, epochs=args.epochs, max_steps=args.max_steps)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=args.schedule, total_steps=total_steps,
                                      warmup_fraction=args.warmup_fraction, min_lr_ratio=1e-6 / lr)
    from timm.data import Mixup  # imported here, after common.errors.call_main has checked HF_ENDPOINT for timm
    mixup = Mixup(mixup_alpha=args.mixup_alpha, cutmix_alpha=args.cutmix_alpha, prob=args.mixup_prob,
                  switch_prob=args.mixup_switch_prob, label_smoothing=args.label_smoothing,
                  num_classes=len(classes)) if mixing else None
    # cross entropy takes Mixup's soft targets as they are (smoothed by Mixup already) and the class weights
    class_weights = (balanced_class_weights(train_set.labels, len(classes)).to(accelerator.device)
                     if args.class_weights == "balanced" else None)
    loss_fn = torch.nn.CrossEntropyLoss(weight=class_weights, label_smoothing=0.0 if mixing else args.label_smoothing)
    # --ema_decay: an average of the weights, evaluated beside them each epoch
    ema = build_ema(model, accelerator, decay=args.ema_decay) if args.ema_decay else None

    # the run's bookkeeping: where it starts, totals, checkpoints, metrics.jsonl, best/
    run = TrainingRun(accelerator, output_dir, model_info=model_info, total_steps=total_steps,
                      checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints)
    run.start(checkpoint, model=model, lr_scheduler=lr_scheduler)  # resume, or set an --overwrite's old run aside
    accelerator.init_trackers("train_seedlings", config=args_to_dict(args))
    workers = [name for name, dataset in (("training", train_set), ("evaluation", eval_set))
               if not isinstance(dataset, (InMemoryDataset, StreamedBatches))]
    train_images = train_split["num_examples"] if args.streaming else len(train_set)
    accelerator.print(f"{train_split['source']}: {len(classes)} classes, {train_images} train / {len(eval_set)} val "
                      f"images, {total_steps} optimizer steps, {lr_rule}; "
                      + (f"streamed: each process shuffles its share among {args.shuffle_buffer} examples "
                         f"(--shuffle_buffer) and decodes each micro-batch in {train_set.threads} threads; "
                         if args.streaming else f"decode cache {'on' if cache_images else 'off'} ({cache_rule}); ")
                      + (f"{num_workers} loader workers per process for {' and '.join(workers)} ({workers_rule}); "
                         if workers else "no loader workers: both sets are gathered from "
                         f"{'the stream and memory' if args.streaming else 'the cache'}; ")
                      + ("SyncBatchNorm on (its statistics span the processes: a resumed run matches an uninterrupted "
                         "one only on the same process count); " if sync_bn else "SyncBatchNorm off; ")
                      + f"{describe_launch(accelerator, batch_size=args.batch_size, grad_accum=args.grad_accum)}")

    for epoch in run.epochs(args.epochs, patience=args.patience):
        model.train()
        for batch in run.batches(train_dataloader):
            images, labels = train_transform(batch["image"]), batch["label"]
            images, targets = mixup(images, labels) if mixup else (images, labels)  # soft targets when mixed
            with accelerator.accumulate(model):
                loss = loss_fn(model(images), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:  # one optimizer step, whatever --grad_accum
                lr_scheduler.step()
                run.merge_batchnorm()  # running statistics as if one process had trained the whole step
                if ema is not None:
                    ema.update(model, step=run.step)
            run.record(loss, batch)  # the epoch's totals
            if run.checkpoint_due():  # --checkpoint_every, or a SIGTERM; a nan/inf loss stops the run here
                run.save_checkpoint()  # after a SIGTERM the run stops here, saved (exit 143)
        evaluation = evaluate(model, eval_dataloader, accelerator, transform=eval_transform, tta=args.tta)
        ema_evaluation = (evaluate(ema, eval_dataloader, accelerator, transform=eval_transform, tta=args.tta)
                          if ema is not None else None)
        run.log_epoch(evaluation, ema_evaluation)
        run.save_best(model, evaluation)  # best/ when validation accuracy improved
        if ema is not None:
            run.save_best(ema.module, ema_evaluation, weights="ema")
        run.save_checkpoint()  # epoch_NNN_end (after a SIGTERM, the run stops here)
    # the training images scored by the final model, unaugmented and cropped as evaluation crops (the cache holds
    # them uncropped): the mistakes report's suspected wrong labels
    train_scores = None
    if args.streaming:
        if train_set.left_out:
            accelerator.print(f"warning: left out {len(train_set.left_out)} unreadable images of the stream on this "
                              f"process, e.g. {train_set.left_out[0]}")
        if args.find_label_issues:
            accelerator.print("no suspected wrong labels: a streamed training split is not read a second time to "
                              "score it (evaluate.py --split on a held-out split checks labels)")
    elif args.find_label_issues:
        # the cached training set is the decoded images themselves (augmented on the device): scored as it is
        scoring_set = train_set if isinstance(train_set, InMemoryDataset) else folder_dataset(
            train_split, transform=None if cache_images else build_eval_transform(eval_spec),
            cache=training_cache(eval_spec) if cache_images else None)
        crop = partial(center_crop, output_size=[args.image_size] * 2) if cache_images else None
        train_scores = evaluate(model, accelerator.prepare(build_file_dataloader(
            scoring_set, batch_size=args.batch_size, num_workers=num_workers)), accelerator,
            transform=lambda images: eval_transform(crop(images) if crop else images))
    run.finish(evaluation, eval_set=eval_set, train_scores=train_scores,
               train_set=None if args.streaming else train_set)


if __name__ == "__main__":
    run_main(main, parse_args())

"""Train ResNet-18 (CIFAR stem: 3x3 conv, stride 1, no max-pool) on CIFAR-10.

Recipe: each residual block starts as the identity (its last BatchNorm at zero: without it the loss blew up in
the warm-up and a run's accuracy depended on the draw), random crop (pad 4) + horizontal flip done on the device,
SGD with Nesterov momentum 0.9, weight decay 5e-4, label smoothing 0.1, gradients clipped to norm 1 (what lets the
peak below hold in a short warm-up), one-cycle LR (linear warmup over 20% of the steps, then linear decay to 0)
peaking at 0.2 for a global batch of 128 and in proportion to the global batch otherwise (--lr sets it exactly),
batch 128 per process, test accuracy every epoch.
Accuracy and time: see docs/results.md (only what was measured is reported there).

Data (--data_dir): the official python batches (`cifar-10-batches-py/` or `cifar-10-python.tar.gz`),
an ImageFolder tree with `train/` and `test/` (or `val/`), or `hf:NAME_OR_PATH` (a Hugging Face dataset with
train and test splits). `--download` fetches the official batches when online.

Launch:
    accelerate launch --config_file accelerate_configs/1gpu.yaml scripts/train_cifar.py --data_dir data --download
    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/train_cifar.py --data_dir data
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/train_cifar.py --data_dir data --epochs 1

Checkpoints: output_dir/checkpoints/ after every epoch (and every --checkpoint_every steps, and on SIGTERM);
continue a stopped run exactly, mid-epoch included, with the same command plus `--resume latest`.
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
from common.checkpoint import resolve_args  # noqa: E402
from common.cifar import CIFAR10_MEAN, CIFAR10_STD, build_cifar10  # noqa: E402
from common.data import MicroBatches, build_dataloader, hold_out, preprocess  # noqa: E402
from common.distributed import build_accelerator  # noqa: E402
from common.errors import run_main  # noqa: E402
from common.evaluation import evaluate, report_evaluation  # noqa: E402
from common.flags import ArgumentParser, add_common_args, args_to_dict, number, probability  # noqa: E402
from common.hf import add_hf_args, hf_options  # noqa: E402
from common.models import build_ema, build_model, check_batch_norm, check_model_name, describe_model  # noqa: E402
from common.optim import build_lr_scheduler, fused_on_cpu, scale_lr  # noqa: E402
from common.outputs import prepare_output_dir  # noqa: E402
from common.reporting import describe_launch  # noqa: E402
from common.run import TrainingRun, count_steps  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18_cifar",
                        help="resnet18_cifar, or any timm model name (default: %(default)s)")
    parser.add_argument("--identity_start", action=argparse.BooleanOptionalAction, default=True,
                        help="each residual block starts as the identity, its last BatchNorm at 0: without it "
                             "this recipe's warm-up blew up (--no-identity_start: at 1, as the published fast recipe "
                             "starts at its 4x lower LR per image; default: on)")
    parser.add_argument("--momentum", type=number(float, min=0, max=1, min_open=True, max_open=True), default=0.9,
                        help="SGD Nesterov momentum (default: %(default)s)")
    parser.add_argument("--cutout", type=number(int, min=0, max=32), default=0,
                        help="erase a square of this side around a random point of every training image, on "
                             "the device (16 is the Cutout paper's CIFAR-10 value; default: off)")
    parser.add_argument("--padding_mode", choices=["constant", "reflect"], default="constant",
                        help="what fills the 4 pixels around a training image that its random crop may take in: "
                             "constant (zeros) or reflect (the image mirrored, as the fast ResNet-18 recipe "
                             "translates; default: %(default)s)")
    parser.add_argument("--random_erasing", type=probability, default=0.0,
                        help="share of training images with a random rectangle erased, on the device "
                             "(default: %(default)s)")
    parser.add_argument("--val_fraction", type=number(float, min=0, max=1, max_open=True), default=0.0,
                        help="choose best/ on this stratified share of the training set and score the test set once, "
                             "at the end, with best/ (default: 0, the standard protocol: best/ chosen on the test set)")
    add_common_args(parser)
    add_hf_args(parser)
    parser.set_defaults(output_dir="outputs/cifar", epochs=30, batch_size=128, weight_decay=5e-4,
                        label_smoothing=0.1, schedule="onecycle", max_grad_norm=1.0)
    return parser.parse_args(argv)


def main(args):
    args, checkpoint = resolve_args(args, parse_args=parse_args)  # --resume: the checkpoint's arguments
    check_model_name(args.model, image_size=32)  # before the images are read
    accelerator = build_accelerator(mixed_precision=args.mixed_precision, compile=args.compile,
                                    grad_accum=args.grad_accum, report_to=(args.report_to, args.output_dir),
                                    dist_timeout=args.dist_timeout)
    output_dir = prepare_output_dir(args.output_dir, overwrite=args.overwrite, resume=args.resume,
                                    inputs=[args.data_dir], accelerator=accelerator)
    set_seed(args.seed)

    # data: uint8 tensors in memory; crop, flip, Cutout/erasing and normalise happen on the device
    train_set, test_set = build_cifar10(args.data_dir, download=args.download, accelerator=accelerator,
                                        hf_options=hf_options(args))
    # --val_fraction: best/ is chosen on a held-out share of the training set, the test set is scored at the end
    train_set, eval_set = (hold_out(train_set, fraction=args.val_fraction, seed=args.seed) if args.val_fraction
                           else (train_set, test_set))
    # the same micro-batches and global steps on any process count (a run resumes on another one)
    train_dataloader = build_dataloader(train_set, batch_sampler=MicroBatches(
        len(train_set), batch_size=args.batch_size, seed=args.seed, accelerator=accelerator))
    eval_dataloader = build_dataloader(eval_set, batch_size=args.batch_size)
    test_dataloader = build_dataloader(test_set, batch_size=args.batch_size) if args.val_fraction else None
    train_transform = partial(preprocess, normalize=(CIFAR10_MEAN, CIFAR10_STD), padding=4,
                              padding_mode=args.padding_mode, flip=True,
                              erase={"cutout": args.cutout, "erasing": args.random_erasing})
    eval_transform = partial(preprocess, normalize=(CIFAR10_MEAN, CIFAR10_STD))

    # model and optimisation
    model_info = describe_model(args.model, train_set.classes, image_size=(32, 32),
                                normalize=(CIFAR10_MEAN, CIFAR10_STD), dataset="cifar10",
                                arguments=args_to_dict(args))  # into best/ and every checkpoint
    model = build_model(args.model, **model_info["model_kwargs"], channels_last=args.channels_last,
                        image_size=32, identity_start=args.identity_start)
    check_batch_norm(model, model_info, batch_size=args.batch_size)
    # the recipe's LR is 0.2 at a global batch of 128; without --lr it follows the global batch in proportion
    global_batch = args.batch_size * accelerator.num_processes * args.grad_accum
    lr, lr_rule = scale_lr(args.lr, base_lr=0.2, base_batch=128, global_batch=global_batch, rule="linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=True,
                                weight_decay=args.weight_decay, **fused_on_cpu(accelerator.device))
    model, optimizer, eval_dataloader, test_dataloader = accelerator.prepare(
        model, optimizer, eval_dataloader, test_dataloader)
    total_steps = count_steps(train_dataloader, epochs=args.epochs, max_steps=args.max_steps)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=args.schedule, total_steps=total_steps,
                                      warmup_fraction=args.warmup_fraction)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # --ema_decay: an average of the weights, evaluated beside them each epoch
    ema = build_ema(model, accelerator, decay=args.ema_decay) if args.ema_decay else None

    # the run's bookkeeping: where it starts, totals, checkpoints, metrics.jsonl, best/
    run = TrainingRun(accelerator, output_dir, model_info=model_info, total_steps=total_steps,
                      checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints)
    run.start(checkpoint, model=model, lr_scheduler=lr_scheduler)  # resume, or set an --overwrite's old run aside
    accelerator.init_trackers("train_cifar", config=args_to_dict(args))
    accelerator.print(f"{test_set.source or 'CIFAR-10'}: {len(train_set)} train / {len(eval_set)} {'validation' if test_dataloader else 'test'} "
                      f"images{f' / {len(test_set)} test' if test_dataloader else ''}, {total_steps} optimizer steps, "
                      f"{lr_rule}; "
                      f"{describe_launch(accelerator, batch_size=args.batch_size, grad_accum=args.grad_accum)}")

    for epoch in run.epochs(args.epochs):
        model.train()
        for batch in run.batches(train_dataloader):
            images, labels = train_transform(batch["image"]), batch["label"]
            with accelerator.accumulate(model):
                loss = loss_fn(model(images), labels)
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
    # the training images scored by the final model, unaugmented: the mistakes report's suspected wrong labels
    train_scores = evaluate(model, accelerator.prepare(build_dataloader(train_set, batch_size=args.batch_size)),
                            accelerator, transform=eval_transform) if args.find_label_issues else None
    if test_dataloader:  # --val_fraction: the test set, scored once with best/, as scripts/evaluate.py scores
        test = evaluate(run.load_best(model), test_dataloader, accelerator, transform=eval_transform, tta=args.tta)
        report_evaluation(accelerator, test, output_dir=output_dir / "test", dataset=test_set)
    run.finish(evaluation, eval_set=eval_set, train_scores=train_scores, train_set=train_set)


if __name__ == "__main__":
    run_main(main, parse_args())

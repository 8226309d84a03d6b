"""The LR schedule: per optimizer step, so that it is the same whatever the accumulation and process count."""

import math
from functools import partial

import torch


def _schedule_factor(step, *, schedule, total_steps, warmup_steps, min_lr_ratio):
    if schedule == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "onecycle":  # linear warmup, then linear decay to zero
        return 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def build_lr_scheduler(optimizer, *, schedule, total_steps, warmup_fraction=0.0, min_lr_ratio=0.0):
    """`onecycle` (linear up, linear down), `cosine` (warmup, then down to `min_lr_ratio` x the peak) or `constant`.
    Stepped by the script when gradients sync, not through `accelerator.prepare` (which steps it once per process)."""
    warmup_steps = int(warmup_fraction * total_steps)
    factor = partial(_schedule_factor, schedule=schedule, total_steps=total_steps, warmup_steps=warmup_steps,
                     min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def scale_lr(lr, *, base_lr, base_batch, global_batch, rule):
    """(the run's peak LR, a line saying where it comes from): `lr` as given, else the recipe's `base_lr` (tuned at
    `base_batch`) scaled to `global_batch` as timm does: `rule` "linear" (SGD) or "sqrt" (Adam/AdamW)."""
    if lr is not None:
        return lr, f"lr {lr:g} (--lr, as given)"
    ratio = global_batch / base_batch
    lr = base_lr * (ratio if rule == "linear" else math.sqrt(ratio))
    scaled = f"{global_batch} / {base_batch}" if rule == "linear" else f"sqrt({global_batch} / {base_batch})"
    return lr, f"lr {lr:.4g} = {base_lr:g} x {scaled} (the recipe's LR at a global batch of {base_batch}, {rule} rule)"

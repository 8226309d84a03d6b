"""The optimizer's kernel, and the LR schedule: per optimizer step, so that it is the same whatever the accumulation
and process count."""

import math
from functools import partial

import torch


def _after_warmup(decay):
    """A schedule that warms up linearly, then follows `decay(progress, min_lr_ratio)`, progress from 0 to 1."""
    def factor(step, *, total_steps, warmup_steps, min_lr_ratio):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return decay(min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)), min_lr_ratio)

    return factor


# the factor of the peak LR at each optimizer step, by name (--schedule offers these)
SCHEDULES = {
    "onecycle": _after_warmup(lambda progress, floor: 1.0 - progress),  # linear decay to zero
    "cosine": _after_warmup(lambda progress, floor: floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))),
    "constant": lambda step, **_: 1.0,  # no warmup either
}


def fused_on_cpu(device):
    """The optimizer's keyword arguments for `device`: PyTorch's fused kernel on a CPU, one pass over all the weights
    where its default there loops over them one tensor at a time (a step of Adam on ResNet-18 2-3x as fast, of SGD
    1.6-2.4x: BENCHMARKS.md, "The fused optimizer on a CPU"); PyTorch's own default (foreach) elsewhere."""
    return {"fused": True} if device.type == "cpu" else {}


def build_lr_scheduler(optimizer, *, schedule, total_steps, warmup_fraction=0.0, min_lr_ratio=0.0):
    """One of SCHEDULES (`min_lr_ratio`: cosine's floor, times the peak), stepped by the script when gradients sync,
    not through `accelerator.prepare` (which steps it once per process)."""
    factor = partial(SCHEDULES[schedule], total_steps=total_steps, warmup_steps=int(warmup_fraction * total_steps),
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

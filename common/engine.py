"""The inner loops: optimisation schedule, one training epoch, evaluation."""

import math
import time
from functools import partial

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def _schedule_factor(step, *, schedule, total_steps, warmup_steps):
    if schedule == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "onecycle":  # linear warmup, then linear decay to zero
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def build_lr_scheduler(optimizer, *, schedule, total_steps, warmup_fraction=0.0):
    """A per-optimizer-step schedule: `onecycle` (linear up, linear down), `cosine` (warmup, cosine) or `constant`.

    Built on the number of optimizer steps this process takes and stepped by the script only when
    gradients sync, so it is not passed through `accelerator.prepare` (which would step it once per
    process); register it with `accelerator.register_for_checkpointing` instead.
    """
    warmup_steps = int(warmup_fraction * total_steps)
    factor = partial(_schedule_factor, schedule=schedule, total_steps=total_steps, warmup_steps=warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_one_epoch(model, train_dataloader, optimizer, lr_scheduler, accelerator, *, loss_fn, transform,
                    max_grad_norm=None, max_steps=None, description="train"):
    """Train over this process's shard once (or for `max_steps` optimizer steps); returns global statistics."""
    model.train()
    device = accelerator.device
    loss_sum, samples, steps, indices = torch.zeros((), device=device), 0, 0, []
    start = time.perf_counter()
    progress = tqdm(train_dataloader, desc=description, disable=not accelerator.is_main_process,
                    dynamic_ncols=True, mininterval=2, leave=False)
    for batch in progress:
        images, labels = transform(batch["image"]), batch["label"]
        with accelerator.accumulate(model):
            loss = loss_fn(model(images), labels)
            accelerator.backward(loss)
            if accelerator.sync_gradients and max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach() * len(labels)
        samples += len(labels)
        indices.append(batch["index"])
        if accelerator.sync_gradients:
            lr_scheduler.step()
            steps += 1
            if steps % 20 == 0:  # .item() waits for the device: only now and then
                progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}",
                                     img_s=f"{samples * accelerator.num_processes / (time.perf_counter() - start):,.0f}")
            if max_steps is not None and steps >= max_steps:
                break
    progress.close()
    elapsed = time.perf_counter() - start
    # global numbers: every process took the same number of steps on a different shard
    samples_per_process = accelerator.gather(torch.tensor([samples], device=device))
    loss_total = accelerator.reduce(loss_sum, reduction="sum")
    seen = accelerator.gather(accelerator.pad_across_processes(
        torch.cat(indices).to(device) if indices else torch.zeros(0, dtype=torch.long, device=device), pad_index=-1))
    total = int(samples_per_process.sum())
    return {
        "train_loss": loss_total.item() / max(1, total),
        "train_samples": total,
        "train_unique_samples": int(seen[seen >= 0].unique().numel()),
        "train_samples_per_process": samples_per_process.tolist(),
        "steps": steps,
        "images_per_s": total / elapsed,
        "train_time_s": elapsed,
    }


@torch.inference_mode()
def evaluate(model, eval_dataloader, accelerator, *, transform):
    """Evaluate on every rank; `gather_for_metrics` per batch counts each sample exactly once.

    Returns loss (plain cross entropy), accuracy, samples, and the gathered predictions,
    probabilities and labels (numpy, in dataset order for an unshuffled loader).
    """
    model.eval()
    losses, probabilities, labels = [], [], []
    for batch in eval_dataloader:
        logits = model(transform(batch["image"])).float()
        loss = F.cross_entropy(logits, batch["label"], reduction="none")
        # gather per batch: gather_for_metrics drops the duplicated padding samples, which exist only
        # in the last batch, and only knows to do so while iterating that batch
        loss, probs, label = accelerator.gather_for_metrics((loss, logits.softmax(1), batch["label"]))
        losses.append(loss.cpu())
        probabilities.append(probs.cpu())
        labels.append(label.cpu())
    losses, probabilities, labels = torch.cat(losses), torch.cat(probabilities), torch.cat(labels)
    predictions = probabilities.argmax(1)
    return {
        "loss": losses.mean().item(),
        "accuracy": (predictions == labels).float().mean().item(),
        "samples": len(labels),
        "predictions": predictions.numpy(),
        "probabilities": probabilities.numpy(),
        "labels": labels.numpy(),
    }

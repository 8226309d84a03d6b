"""The inner loops: optimisation schedule, one training epoch, evaluation."""

import math
import time
from functools import partial

import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score
from tqdm.auto import tqdm

from .errors import Interrupted, UserError
from .distributed import catch_sigterm, stop_requested


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
    """A per-optimizer-step schedule: `onecycle` (linear up, linear down), `cosine` (warmup, then cosine down
    to `min_lr_ratio` x the peak) or `constant`.

    Built on the number of optimizer steps this process takes and stepped by the script only when
    gradients sync, so it is not passed through `accelerator.prepare` (which would step it once per
    process); its state goes into the checkpoint's trainer_state.json (common.checkpoint).
    """
    warmup_steps = int(warmup_fraction * total_steps)
    factor = partial(_schedule_factor, schedule=schedule, total_steps=total_steps, warmup_steps=warmup_steps,
                     min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_one_epoch(model, train_dataloader, optimizer, lr_scheduler, accelerator, *, progress, loss_fn, transform,
                    mixup=None, max_grad_norm=None, max_steps=None, checkpoint_every=None, save_checkpoint=None):
    """Train over this process's shard of epoch `progress["epoch"]`; returns the epoch's global statistics.

    `progress` ({"epoch", "batch", "step", ...}) says where the run stands and is updated after every batch.
    A resumed epoch (`progress["batch"]` > 0) skips the batches already trained, in the same shuffled order,
    and its statistics go on from `progress["epoch_totals"]`. Every `checkpoint_every` optimizer steps, and
    at the first step after a SIGTERM, `save_checkpoint(progress)` writes a checkpoint; after a SIGTERM the
    run then stops with `Interrupted`. Training stops at `max_steps` optimizer steps in all.
    `mixup(images, labels) -> (images, soft targets)` (timm's Mixup) goes after `transform`, on the device.
    A nan/inf loss stops the run with NonFiniteLoss at the next check (every 20 steps, before any checkpoint,
    at the end of the epoch), so no checkpoint or best model is written from a diverged model.
    """
    model.train()
    catch_sigterm()
    epoch = progress["epoch"]
    train_dataloader.set_epoch(epoch)  # the shuffle depends on (seed, epoch) only
    if progress["batch"]:
        train_dataloader = accelerator.skip_first_batches(train_dataloader, progress["batch"])
        train_dataloader.set_epoch(epoch)  # older Accelerate releases start the skipping loader at epoch 0
    totals = _start_totals(accelerator, progress.pop("epoch_totals", None))
    nonfinite_step = torch.full((), _NONE, device=accelerator.device)  # the first step with a nan/inf loss
    start, resumed_samples = time.perf_counter(), totals["samples"]

    def images_per_s():  # all processes, timed from this call: a resumed epoch's earlier part is not in it
        return (totals["samples"] - resumed_samples) * accelerator.num_processes / (time.perf_counter() - start)

    progress_bar = tqdm(train_dataloader, desc=f"epoch {epoch}", disable=not accelerator.is_main_process,
                        dynamic_ncols=True, mininterval=2, leave=False)
    for batch in progress_bar:
        images, labels = transform(batch["image"]), batch["label"]
        images, targets = mixup(images, labels) if mixup else (images, labels)
        with accelerator.accumulate(model):
            loss = loss_fn(model(images), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients and max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # recorded on the device and checked only where the host waits anyway, before anything is saved
        this_step = torch.where(loss.detach().isfinite(), _NONE, progress["step"] + 1)
        nonfinite_step = torch.minimum(nonfinite_step, this_step)
        totals["loss_sum"] += loss.detach() * len(labels)
        totals["samples"] += len(labels)
        totals["indices"].append(batch["index"])
        progress["batch"] += 1
        if not accelerator.sync_gradients:
            continue
        lr_scheduler.step()
        progress["step"] += 1
        if progress["step"] % 20 == 0:  # .item() waits for the device: only now and then
            _stop_if_nonfinite(accelerator, nonfinite_step, epoch)
            progress_bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}",
                                     img_s=f"{images_per_s():,.0f}")
        stop = stop_requested(accelerator)
        if stop or (checkpoint_every and progress["step"] % checkpoint_every == 0):
            _stop_if_nonfinite(accelerator, nonfinite_step, epoch)
            path = save_checkpoint({**progress, "epoch_totals": _global_totals(accelerator, totals)})
        if stop:
            accelerator.print(f"stopped by SIGTERM at epoch {epoch}, step {progress['step']}: saved {path}. "
                              "Run the same command with --resume latest to continue.")
            raise Interrupted(path)
        if max_steps is not None and progress["step"] >= max_steps:
            break
    progress_bar.close()
    _stop_if_nonfinite(accelerator, nonfinite_step, epoch)  # before the epoch's evaluation, best/ and checkpoint
    elapsed, rate = time.perf_counter() - start, images_per_s()
    epoch_totals = _global_totals(accelerator, totals)
    samples = sum(epoch_totals["samples_per_process"])
    return {
        "train_loss": epoch_totals["loss_sum"] / max(1, samples),
        "train_samples": samples,
        "train_unique_samples": len(epoch_totals["indices"]),
        "train_samples_per_process": epoch_totals["samples_per_process"],
        "images_per_s": rate,
        "train_time_s": elapsed,
    }


_NONE = 2**62  # "no such step"


class NonFiniteLoss(UserError):
    """The loss became nan or inf; nothing was saved after that step."""


def _stop_if_nonfinite(accelerator, nonfinite_step, epoch):
    """Raise NonFiniteLoss on every process when any of them saw a nan/inf loss (a collective: all call it)."""
    step = accelerator.gather(nonfinite_step[None]).min().item()
    if step != _NONE:
        raise NonFiniteLoss(
            f"the loss became nan or inf at optimizer step {step} (epoch {epoch}); training stopped there and saved "
            "nothing after it, so the checkpoints and best/ hold only states from before. The run diverged: start "
            "again with a lower --lr, --max_grad_norm (e.g. 1.0), or bf16 instead of fp16 (a resumed run keeps its "
            "arguments, and would diverge the same way)."
        )


def _start_totals(accelerator, saved=None):
    """This process's running loss sum, sample count and sample indices for the epoch.

    A resumed epoch starts from the checkpoint's global totals: each process takes its own sample count,
    and the main process carries the loss sum and the indices, so the final reduction counts them once.
    """
    totals = {"loss_sum": torch.zeros((), device=accelerator.device), "samples": 0, "indices": []}
    if saved:
        totals["samples"] = saved["samples_per_process"][accelerator.process_index]
        if accelerator.is_main_process:
            totals["loss_sum"] += saved["loss_sum"]
            totals["indices"].append(torch.tensor(saved["indices"], dtype=torch.long))
    return totals


def _global_totals(accelerator, totals):
    """The epoch's totals over all processes (a collective: every process calls it), as JSON-friendly numbers."""
    device = accelerator.device
    indices = torch.cat(totals["indices"]).to(device) if totals["indices"] else torch.zeros(0, dtype=torch.long, device=device)
    seen = accelerator.gather(accelerator.pad_across_processes(indices, pad_index=-1))
    return {
        "loss_sum": accelerator.reduce(totals["loss_sum"].clone(), reduction="sum").item(),
        "samples_per_process": accelerator.gather(torch.tensor([totals["samples"]], device=device)).tolist(),
        "indices": seen[seen >= 0].unique().tolist(),  # sorted; the padding of the last batches repeats a few
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
        "macro_f1": f1_score(labels, predictions, average="macro", labels=range(probabilities.shape[1]),
                             zero_division=0),
        "samples": len(labels),
        "predictions": predictions.numpy(),
        "probabilities": probabilities.numpy(),
        "labels": labels.numpy(),
    }

# %% [markdown]
# # Resumable training on a folder of files
#
# A DDP model learns from a folder of sample files read with `air_magic.data`:
# `VolumeDataset` gives every rank an equal, per-epoch shuffled share of the files,
# `DataLoader` (torchdata's `StatefulDataLoader`) loads them in worker processes.
# Every few steps the model, the optimizer and every rank's loader position are
# saved with `torch.distributed.checkpoint` (`VolumeWriter`; any fsspec URL works
# as well as a local folder).
#
# The demo trains once without interruption, then again with the last rank killed
# (SIGKILL) in the middle of an epoch, then resumes in a new call from the last
# checkpoint: the resumed call trains on exactly the batches the uninterrupted run
# trained on after that checkpoint, and ends with the same weights. Runs on every
# GPU with NCCL, or on 2 CPU ranks with gloo when there is no GPU.

# %%
import os
import tempfile

import torch

from air_magic import RankFailedError, distributed


def make_files(folder: str, files: int = 48, per_file: int = 16) -> str:
    """A folder of sample files: each holds ``per_file`` (x, y) pairs of a noisy linear task."""
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    true_w = torch.randn(8, 1, generator=gen)
    for i in range(files):
        x = torch.randn(per_file, 8, generator=gen)
        y = x @ true_w + 0.1 * torch.randn(per_file, 1, generator=gen)
        torch.save({"x": x, "y": y}, os.path.join(folder, f"shard-{i:03d}.pt"))
    return folder


# %%
@distributed()
def train(data_dir: str, ckpt_dir: str, epochs: int = 2, every: int = 2, kill_at: int | None = None):
    import signal

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from air_magic.data import DataLoader, PerRank, VolumeDataset, VolumeReader, VolumeWriter

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    def load_batch(paths):  # files -> one batch; runs in the loader's workers
        parts = [torch.load(p) for p in paths]
        return (
            [os.path.basename(p) for p in paths],
            torch.cat([p["x"] for p in parts]),
            torch.cat([p["y"] for p in parts]),
        )

    dataset = VolumeDataset(data_dir, pattern="*.pt", seed=0)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=load_batch)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1).to(device))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)

    # Resume from the newest complete checkpoint (DCP writes .metadata last), if there is one.
    progress = {"epoch": 0, "step": 0}
    saved = sorted(
        name
        for name in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else [])
        if os.path.exists(os.path.join(ckpt_dir, name, ".metadata"))
    )
    resuming = bool(saved)
    if resuming:
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state, "loader": PerRank(loader), "progress": progress}
        dcp.load(state, storage_reader=VolumeReader(os.path.join(ckpt_dir, saved[-1])))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        progress = state["progress"]

    trained = []  # (step, file names) of every batch this call trained on
    step = progress["step"]
    for epoch in range(progress["epoch"], epochs):
        if not resuming:  # a resumed epoch continues with its own order and position
            dataset.set_epoch(epoch)
        resuming = False
        for names, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            optim.zero_grad()
            loss.backward()
            optim.step()
            step += 1
            trained.append((step, names))
            if step % every == 0:
                model_state, optim_state = get_state_dict(model, optim)
                state = {
                    "model": model_state,
                    "optim": optim_state,
                    "loader": PerRank(loader),
                    "progress": {"epoch": epoch, "step": step},
                }
                dcp.save(state, storage_writer=VolumeWriter(os.path.join(ckpt_dir, f"step-{step:06d}")))
            if step == kill_at and rank == dist.get_world_size() - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-epoch, right after a checkpoint
    weight = model.module.weight.detach().cpu().flatten().tolist()
    dist.destroy_process_group()
    return {"trained": trained, "weight": weight}


# %%
def crash_and_resume(work: str, fn=train) -> int:
    """Train uninterrupted; again with the last rank killed at step 5; resume. The step it resumed at."""
    data = make_files(os.path.join(work, "data"))

    reference = fn.distributed(data, os.path.join(work, "ckpt-reference"))
    print("uninterrupted:", len(reference[0]["trained"]), "steps on each rank")

    crashed_ckpt = os.path.join(work, "ckpt-crashed")
    try:
        fn.distributed(data, crashed_ckpt, kill_at=5)
    except RankFailedError as exc:  # the call fails, naming the killed rank and its SIGKILL
        print("killed as planned:", str(exc).splitlines()[0])

    resumed = fn.distributed(data, crashed_ckpt)
    for rank, (ref, res) in enumerate(zip(reference, resumed, strict=True)):
        first = res["trained"][0][0]
        assert res["trained"] == [t for t in ref["trained"] if t[0] >= first], rank
        assert torch.allclose(torch.tensor(res["weight"]), torch.tensor(ref["weight"])), rank
    print(f"resumed at step {first}: the same batches and the same weights as the uninterrupted run")
    return first


# %%
if __name__ == "__main__":
    crash_and_resume(tempfile.mkdtemp(prefix="data-resume-"))

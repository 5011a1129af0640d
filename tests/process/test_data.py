"""air_magic.data with real ranks: even shards, per-epoch order, resume, the cache, DCP, metrics (issue 16).

The files are real files in a temp folder; a remote store is a real HTTP
server on 127.0.0.1 (fsspec's http:// through aiohttp), read through the
cache by two ranks at once. Checkpoints are real DCP checkpoints, saved on 2
gloo ranks and loaded on 2 and on 3.
"""

from __future__ import annotations

import collections
import functools
import http.server
import math
import os
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torchdata")
pytest.importorskip("fsspec")

import air_magic
from air_magic import distributed
from air_magic.data import sharding

N_FILES = 11  # divisible by neither 2 nor 3 ranks: drop_last and padding both matter


@pytest.fixture
def files(tmp_path):
    """11 small files, two of them in a sub-folder, plus one that the pattern leaves out."""
    root = tmp_path / "volume"
    (root / "part").mkdir(parents=True)
    for i in range(N_FILES):
        where = root / "part" if i >= 9 else root
        (where / f"f{i:02d}.bin").write_bytes(bytes([i]) * (100 + i))
    (root / "README.txt").write_text("not data")
    return root


def relative_listing(root) -> list[str]:
    """The listing's order: sorted relative paths of the *.bin files."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".bin"):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


def run(fn, *args, n=2, **settings):
    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    return distributed(num_accelerators=n, **settings)(fn).distributed(*args)


# -- rank functions -----------------------------------------------------------------------


def epoch_files(url, workers, context=None):
    """Per (drop_last, epoch): the relative paths this rank's DataLoader delivered, in order."""
    from air_magic.data import DataLoader, VolumeDataset

    out = {}
    for drop_last in (True, False):
        dataset = VolumeDataset(url, pattern="*.bin", seed=7, drop_last=drop_last)
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            loader = DataLoader(
                dataset, batch_size=None, num_workers=workers, multiprocessing_context=context
            )
            out[(drop_last, epoch)] = [os.path.relpath(p, url) for p in loader]
            assert len(out[(drop_last, epoch)]) == len(dataset)
    return out


def one_epoch(url, context):
    from air_magic.data import DataLoader, VolumeDataset

    loader = DataLoader(
        VolumeDataset(url, pattern="*.bin"), batch_size=None, num_workers=2, multiprocessing_context=context
    )
    return [os.path.relpath(p, url) for p in loader]


def resumes(url, state_file, stop_after):
    """An epoch in batches of 2, 2 workers: every batch, and the state after ``stop_after`` batches."""
    import torch

    from air_magic.data import DataLoader, VolumeDataset

    loader = DataLoader(VolumeDataset(url, pattern="*.bin", drop_last=False), batch_size=2, num_workers=2)
    loader.dataset.set_epoch(3)
    batches = []
    for i, batch in enumerate(loader):
        batches.append([os.path.basename(p) for p in batch])
        if i + 1 == stop_after:
            torch.save(loader.state_dict(), state_file.format(rank=os.environ["RANK"]))
    return batches


def resumed(url, state_file):
    """A new loader in a new process, from the saved state: the batches it still delivers."""
    import torch

    from air_magic.data import DataLoader, VolumeDataset

    loader = DataLoader(VolumeDataset(url, pattern="*.bin", drop_last=False), batch_size=2, num_workers=2)
    loader.load_state_dict(torch.load(state_file.format(rank=os.environ["RANK"]), weights_only=False))
    return [[os.path.basename(p) for p in batch] for batch in loader]


def _read_cached(path):
    with open(path, "rb") as f:
        return os.path.basename(path).split("-", 1)[1], f.read()


def reads_through_cache(url, cache_dir, bound):
    """Every file of two epochs, read from its cached copy; the cache's size after each fetch.

    Epoch 0 in the rank itself, epoch 1 through 2 forked DataLoader workers (fsspec's http
    filesystem, used by the rank to list, is not fork-safe: the workers need their own)."""
    from air_magic.data import DataLoader, VolumeDataset

    dataset = VolumeDataset(url, cache_dir=cache_dir, max_cache_bytes=bound, drop_last=False)
    seen, sizes = [], []
    for epoch, workers in ((0, 0), (1, 2)):
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_read_cached)
        for name, data in loader:
            seen.append((name, data))
            sizes.append(folder_bytes(cache_dir))
    return seen, max(sizes)


def folder_bytes(folder):
    """What the folder holds now (a part file may be published, or an entry evicted, meanwhile)."""
    total = 0
    for entry in os.scandir(folder):
        try:
            total += entry.stat().st_size if entry.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def saves_checkpoint(url):
    """A tensor sharded over the ranks (DTensor) and each rank's loader position, saved with DCP."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from air_magic.data import DataLoader, PerRank, VolumeDataset, VolumeWriter

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(24, dtype=torch.float32).reshape(12, 2)
    weight = distribute_tensor(full, mesh, [Shard(0)])
    loader = DataLoader(VolumeDataset(url, pattern="*.bin"), batch_size=None, num_workers=0)
    it = iter(loader)
    taken = [next(it) for _ in range(int(os.environ["RANK"]) + 1)]
    dcp.save({"weight": weight, "loader": PerRank(loader)}, storage_writer=VolumeWriter(url + "/../ckpt"))
    rest = list(it)
    dist.destroy_process_group()
    return len(taken), [os.path.basename(p) for p in rest]


def loads_checkpoint(url, with_loader):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from air_magic.data import DataLoader, PerRank, VolumeDataset, VolumeReader

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = distribute_tensor(torch.zeros(12, 2), mesh, [Shard(0)])
    state = {"weight": weight}
    loader = DataLoader(VolumeDataset(url, pattern="*.bin"), batch_size=None, num_workers=0)
    if with_loader:
        state["loader"] = PerRank(loader)
    dcp.load(state, storage_reader=VolumeReader(url + "/../ckpt"))
    local = state["weight"].to_local().clone()
    full = state["weight"].full_tensor()
    dist.destroy_process_group()
    rest = [os.path.basename(p) for p in loader] if with_loader else None
    return local.shape[0], full.tolist(), rest


def loads_for_a_while(url):
    import time

    from air_magic.data import DataLoader, VolumeDataset

    loader = DataLoader(
        VolumeDataset(url, pattern="*.bin"), batch_size=None, num_workers=0, metrics_every_s=0.05
    )
    for _ in range(3):
        for _ in loader:
            time.sleep(0.02)  # "training"
    return True


def builds_a_dataset(url):
    from air_magic.data import VolumeDataset

    VolumeDataset(url)
    import torch.distributed as dist

    dist.init_process_group("gloo")  # never reached: the dataset fails first, in every rank
    return True


# -- shards, order, padding ---------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_gets_an_even_share_in_an_order_every_rank_agrees_on(files, world, workers):
    per_rank = run(epoch_files, str(files), workers, n=world)
    listing = relative_listing(files)
    assert len(listing) == N_FILES
    for drop_last in (True, False):
        count = N_FILES // world if drop_last else math.ceil(N_FILES / world)
        orders = []
        for epoch in (0, 1):
            shares = [per_rank[rank][(drop_last, epoch)] for rank in range(world)]
            assert [len(s) for s in shares] == [count] * world  # equal: DDP runs equal steps
            # Interleaved back, the shares are the epoch's one order, as every rank computed it.
            merged = [shares[i % world][i // world] for i in range(count * world)]
            order = [listing[i] for i in sharding.epoch_order(N_FILES, 7, epoch, shuffle=True)]
            if drop_last:
                assert merged == order[: count * world] and len(set(merged)) == len(merged)
            else:  # padded by repeating the first files of the order: every file at least once
                assert merged == order + order[: count * world - N_FILES]
                assert set(merged) == set(listing)
            orders.append(order)
        assert orders[0] != orders[1]  # set_epoch: another order


def test_dataloader_workers_start_with_fork_forkserver_and_spawn_in_warm_ranks_and_spawn_in_fresh(files):
    expected = run(one_epoch, str(files), None)
    assert len(expected[0]) == len(expected[1]) == N_FILES // 2
    assert not set(expected[0]) & set(expected[1]) and set(expected[0]) | set(expected[1]) <= set(
        relative_listing(files)
    )
    # Warm ranks are forks of the starter: each start method from there. A fresh rank is a plain
    # interpreter, where only spawn (which re-runs the rank's entry) is not the usual case.
    for warm, context in [(True, "fork"), (True, "forkserver"), (True, "spawn"), (False, "spawn")]:
        assert run(one_epoch, str(files), context, warm_start=warm) == expected, (warm, context)


# -- resume -------------------------------------------------------------------------------


def test_a_new_call_resumes_mid_epoch_with_exactly_the_remaining_batches(files, tmp_path):
    state_file = str(tmp_path / "loader-{rank}.pt")
    whole = run(resumes, str(files), state_file, 2)
    rest = run(resumed, str(files), state_file)
    for rank in (0, 1):
        assert len(whole[rank]) == 3  # 6 files per rank: 3 batches of 2, whatever the workers
        assert rest[rank] == whole[rank][2:]


def _batches(loader):
    return [[os.path.basename(p) for p in batch] for batch in loader]


def test_a_rank_delivers_the_same_batches_whatever_its_number_of_workers(files):
    # Ranks on machines with other core counts pick other num_workers defaults: DDP needs the
    # same number of batches on every rank all the same.
    from air_magic.data import DataLoader, VolumeDataset

    got = {}
    for workers in (0, 1, 3):
        dataset = VolumeDataset(str(files), pattern="*.bin", drop_last=False)
        got[workers] = _batches(DataLoader(dataset, batch_size=4, num_workers=workers))
    assert [len(b) for b in got[0]] == [4, 4, 3]
    assert got[0] == got[1] == got[3]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_at_an_epochs_end_then_set_epoch_gives_the_whole_next_epoch(files, workers):
    from air_magic.data import DataLoader, VolumeDataset

    def loader():
        dataset = VolumeDataset(str(files), pattern="*.bin")
        return dataset, DataLoader(dataset, batch_size=2, num_workers=workers)

    dataset, first = loader()
    dataset.set_epoch(0)
    it = iter(first)
    for _ in range(len(dataset) // 2 + len(dataset) % 2):  # every batch, StopIteration not yet seen
        next(it)
    state = first.state_dict()
    assert list(it) == []  # (and its workers gone)
    reference_set, reference = loader()
    reference_set.set_epoch(1)
    expected = _batches(reference)
    dataset, resumed = loader()
    resumed.load_state_dict(state)
    dataset.set_epoch(1)  # the documented loop: the next epoch, then iterate
    assert _batches(resumed) == expected and len(expected) > 0


def test_persistent_workers_are_refused_with_the_reason(files):
    from air_magic.data import DataLoader, VolumeDataset

    with pytest.raises(ValueError, match="set_epoch"):
        DataLoader(VolumeDataset(str(files)), num_workers=1, persistent_workers=True)


def test_a_state_from_another_shape_is_refused_by_name(files, monkeypatch):
    from air_magic.data import VolumeDataset

    dataset = VolumeDataset(str(files), pattern="*.bin")
    state = dataset.state_dict()
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"saved with 11 files, 1 ranks.*now there are 11 files, 4 ranks"):
        VolumeDataset(str(files), pattern="*.bin").load_state_dict(state)


# -- a remote store, through the cache ----------------------------------------------------


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # fsspec reads a file's size from the start of a GET, then hangs up


@pytest.fixture
def http_store(files):
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(files))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


def test_two_ranks_read_a_remote_store_through_one_bounded_cache(files, http_store, tmp_path):
    cache = tmp_path / "cache"
    bound = 4 * 120  # four of the files: far fewer than an epoch
    results = run(reads_through_cache, http_store, str(cache), bound)
    expected = {os.path.basename(p): (files / p).read_bytes() for p in relative_listing(files)}
    expected["README.txt"] = (files / "README.txt").read_bytes()
    for seen, largest in results:
        assert largest <= bound
        for name, data in seen:
            assert data == expected[name]  # whole files only: never a half-written copy
    assert {name for seen, _ in results for name, _ in seen} == set(expected)
    assert folder_bytes(cache) <= bound
    assert not [e.name for e in os.scandir(cache) if e.name.startswith(".part-")]


def test_the_cache_serves_a_second_reader_without_downloading_again(files, http_store, tmp_path):
    from air_magic.data import VolumeDataset

    cache = tmp_path / "cache"
    first = list(VolumeDataset(http_store, pattern="*.bin", cache_dir=str(cache), shuffle=False))
    stamps = {p: os.stat(p).st_ino for p in first}
    second = list(VolumeDataset(http_store, pattern="*.bin", cache_dir=str(cache), shuffle=False))
    assert second == first and {p: os.stat(p).st_ino for p in second} == stamps


def test_a_file_used_just_now_is_not_evicted_and_a_dead_download_is_cleared(tmp_path):
    import fsspec

    from air_magic.data import cache as cache_module
    from air_magic.data.cache import FileCache
    from air_magic.data.listing import RemoteFile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("a", "b"):
        (source / name).write_bytes(name.encode() * 100)
    fs = fsspec.filesystem("file")  # a local folder standing for a remote store (never cached otherwise)
    a, b = (RemoteFile(str(source / name), name, 100, "v1") for name in ("a", "b"))
    cache = FileCache(str(tmp_path / "cache"), max_bytes=150)  # room for one file
    first = cache.fetch(fs, a)
    # A download left by a process that died: its part file's lock is free, so it is cleared.
    stale = tmp_path / "cache" / f".part-dead-100-{cache.entry_name(fs, b)}"
    stale.write_bytes(b"half")
    done = threading.Event()
    fetched = []
    thread = threading.Thread(target=lambda: (fetched.append(cache.fetch(fs, b)), done.set()))
    thread.start()
    assert not done.wait(cache_module.RECENT_S / 2)  # "a" was used just now: b waits for room
    assert os.path.exists(first)
    thread.join(timeout=30)
    assert done.is_set() and not os.path.exists(first)  # then the older one made room
    assert Path(fetched[0]).read_bytes() == b"b" * 100
    assert not stale.exists()


# -- distributed checkpoints --------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["", "local://"])  # DCP's file storage, and its fsspec storage
def test_dcp_saves_on_two_ranks_and_loads_on_two_and_on_three(files, scheme):
    url = scheme + str(files)
    saved = run(saves_checkpoint, url)
    loaded = run(loads_checkpoint, url, True)
    full = [[float(2 * i), float(2 * i + 1)] for i in range(12)]
    for rank in (0, 1):
        taken, rest = saved[rank]
        assert taken == rank + 1
        rows, tensor, resumed_rest = loaded[rank]
        assert rows == 6 and tensor == full
        assert resumed_rest == rest  # each rank got its own loader position back
    resharded = run(loads_checkpoint, url, False, n=3)
    assert [rows for rows, _, _ in resharded] == [4, 4, 4]
    assert all(tensor == full for _, tensor, _ in resharded)
    if scheme:
        return  # the check below is air_magic's own, on the metadata either storage reads: once is enough
    for ranks in (1, 3):  # the loaders' positions cannot move to another number of ranks: said so
        with pytest.raises(ValueError, match=f"saved by 2 rank\\(s\\); this call has {ranks}"):
            run(loads_checkpoint, url, True, n=ranks)


# -- metrics ------------------------------------------------------------------------------
def test_loader_timings_reach_the_calls_run_without_an_mlflow_call_per_batch(files, store):
    assert run(loads_for_a_while, str(files), tracking=True) == [True, True]
    run_id = air_magic.last_run().mlflow_run_id
    metrics = store.get_run(run_id).data.metrics
    for rank in (0, 1):
        fetch = store.get_metric_history(run_id, f"dataloader/fetch_seconds/rank_{rank}")
        between = store.get_metric_history(run_id, f"dataloader/between_next_seconds/rank_{rank}")
        assert fetch and between
        assert 0 < len(fetch) <= 3 * 5  # windows, not batches: 15 batches
        assert all(m.value >= 0.0 for m in fetch)
        assert metrics[f"dataloader/between_next_seconds/rank_{rank}"] >= 0.015  # the "training" sleep
    assert collections.Counter(k.split("/")[0] for k in metrics)["dataloader"] == 4


# -- bad input ----------------------------------------------------------------------------


def test_a_missing_url_or_an_empty_folder_is_a_clear_error(tmp_path):
    from air_magic.data import VolumeDataset

    with pytest.raises(FileNotFoundError, match="does not exist"):
        VolumeDataset(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files under"):
        VolumeDataset(str(tmp_path / "empty"))
    (tmp_path / "empty" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no files matching '\*.bin' under"):
        VolumeDataset(str(tmp_path / "empty"), pattern="*.bin")


def test_a_missing_url_fails_the_call_in_every_rank_before_any_rank_waits(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(builds_a_dataset, str(tmp_path / "nowhere"))
    info = air_magic.last_run()
    assert info is not None and info.outcome == "failed"


def test_without_the_extra_the_error_names_it(monkeypatch):
    from air_magic.data import extra

    monkeypatch.setitem(sys.modules, "torchdata", None)
    monkeypatch.delitem(sys.modules, "torchdata.stateful_dataloader", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'air_magic\[data\]'"):
        extra.require("torchdata.stateful_dataloader")


def test_fewer_files_than_ranks_with_drop_last_is_refused_not_an_empty_epoch():
    with pytest.raises(ValueError, match="no rank gets a file"):
        sharding.rank_share(list(range(2)), 0, 3, drop_last=True)
    assert sharding.rank_share(list(range(2)), 2, 3, drop_last=False) == [0]


def test_a_loader_state_resumes_with_the_saved_workers_when_left_to_the_default(files, monkeypatch):
    from air_magic.data import DataLoader, VolumeDataset

    def loader(workers):
        return DataLoader(VolumeDataset(str(files), pattern="*.bin"), batch_size=None, num_workers=workers)

    first = loader(2)
    it = iter(first)
    taken = [next(it) for _ in range(3)]
    state = first.state_dict()
    rest = list(it)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")  # another machine: its default share is 0 workers
    resumed = loader(None)
    resumed.load_state_dict(state)
    assert resumed.num_workers == 2 and list(resumed) == rest and len(taken) + len(rest) == N_FILES
    with pytest.raises(ValueError, match="saved by a loader with num_workers=2; this one has num_workers=1"):
        loader(1).load_state_dict(state)


def test_a_file_larger_than_the_cache_is_refused_by_its_name(files, tmp_path):
    import fsspec

    from air_magic.data.cache import FileCache
    from air_magic.data.listing import RemoteFile

    big = files / "part" / "f10.bin"
    cache = FileCache(str(tmp_path / "cache"), max_bytes=50)
    said = r"f10\.bin \(110 bytes\) does not fit in the cache .*max_cache_bytes=50"
    with pytest.raises(ValueError, match=said):
        cache.fetch(fsspec.filesystem("file"), RemoteFile(str(big), "f10.bin", 110, "v1"))

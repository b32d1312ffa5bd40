"""Resumable, optionally distributed embedding of a dataset into shards on disk.

The items to embed (dataset indices) are cut into shards of `shard_size`. Shard s is written
as `shard_{s:05d}.npy` (float32 unit rows) and then `shard_{s:05d}.json` (the dataset indices
embedded and the items skipped); the JSON is the completion marker, so a build interrupted at
any point re-embeds only unfinished shards. Unreadable items (the dataset raises, or returns
a tensor of the wrong shape / with NaN) are skipped, counted and listed, never fatal.

Distributed: under torchrun (RANK / WORLD_SIZE set) rank r embeds the shards s with
s % WORLD_SIZE == r into the same cache directory (a shared filesystem); after a barrier rank
0 reads every shard in order, so the result is identical to a single-process run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from index.manifest import atomic_write, atomic_write_text
from training.distributed import leave_process_group, torchrun_env

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


@dataclass
class EmbedResult:
    """Embeddings of the items that could be read, in dataset-index order."""

    embeddings: np.ndarray  # (M, D) float32 unit rows
    rows: np.ndarray  # (M,) int64 dataset indices of those rows
    skipped: list[dict] = field(default_factory=list)  # {"index", "id", "error"}
    seconds: float = 0.0
    resumed_shards: int = 0  # shards found complete on disk and reused


def cache_key(checkpoint_sha256: str, fingerprint: str, indices: np.ndarray, shard_size: int) -> str:
    """Identifies one embedding job: same weights, same data, same items, same sharding."""
    h = hashlib.sha256()
    h.update(f"{checkpoint_sha256}:{fingerprint}:{shard_size}:".encode())
    h.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return h.hexdigest()[:20]


def _shard_name(s: int) -> str:
    return f"shard_{s:05d}"


def shard_count(n: int, shard_size: int) -> int:
    return (n + shard_size - 1) // shard_size


def prepare_cache(cache_dir: str | os.PathLike, key: str, indices: np.ndarray, shard_size: int) -> int:
    """Create (or validate and keep) the shard directory; returns the number of complete shards.

    A directory left by a different job (config mismatch) is wiped. Call on one process only.
    """
    cache_dir = Path(cache_dir)
    config = {"key": key, "count": int(len(indices)), "shard_size": int(shard_size)}
    cfg_path = cache_dir / CONFIG_FILE
    if cache_dir.is_dir():
        try:
            old = json.loads(cfg_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            old = None
        if old != config:
            if old is not None:
                logger.warning("embedding cache %s belongs to another job; starting over", cache_dir)
            # remove only what this module writes: the directory may be a caller's
            for path in [
                *cache_dir.glob("shard_*.npy"),
                *cache_dir.glob("shard_*.json"),
                cache_dir / "indices.npy",
                cfg_path,
            ]:
                path.unlink(missing_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        atomic_write_text(cfg_path, json.dumps(config) + "\n")
        np.save(cache_dir / "indices.npy", np.asarray(indices, dtype=np.int64))
    done = sum(_shard_done(cache_dir, s) for s in range(shard_count(len(indices), shard_size)))
    if done:
        logger.info("embedding cache %s: resuming, %d shard(s) already complete", cache_dir, done)
    return done


def _shard_done(cache_dir: Path, s: int) -> bool:
    meta = cache_dir / f"{_shard_name(s)}.json"
    return meta.is_file() and (cache_dir / f"{_shard_name(s)}.npy").is_file()


class SafeItems(Dataset):
    """Wraps a dataset so that an unreadable item becomes (index, None, error) instead of raising."""

    def __init__(self, dataset, indices: np.ndarray, image_size: int):
        self.dataset, self.indices, self.image_size = dataset, indices, image_size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, positions: list[int]):
        """Batched fetch (DataLoader uses it when present) -> (indices, tensor of the readable
        items or None, error per item). One vectorised `tensors` call when the dataset has one
        and every item reads, else item by item so one bad file is skipped alone."""
        idx = [int(self.indices[p]) for p in positions]
        tensors = getattr(self.dataset, "tensors", None)
        if tensors is not None:
            try:
                batch = tensors(idx)
                size = (len(idx), 3, self.image_size, self.image_size)
                if tuple(batch.shape) == size:
                    return idx, batch.to(torch.float32), [""] * len(idx)
            except Exception:  # noqa: BLE001 - fall back to per-item reads to find the bad one
                pass
        items = [self[p] for p in positions]
        good = [x for _, x, _ in items if x is not None]
        return idx, (torch.stack(good) if good else None), [e for _, _, e in items]

    def __getitem__(self, pos: int):
        i = int(self.indices[pos])
        try:
            x = self.dataset[i]
            if not isinstance(x, torch.Tensor):
                x = torch.as_tensor(np.asarray(x))
            if tuple(x.shape) != (3, self.image_size, self.image_size):
                raise ValueError(
                    f"expected a (3, {self.image_size}, {self.image_size}) tensor, got {tuple(x.shape)}"
                )
            return i, x.to(torch.float32), ""
        except Exception as err:  # noqa: BLE001 - any decode failure means "skip this item"
            return i, None, f"{type(err).__name__}: {err}"


class CpuStreams:
    """Throughput-mode CPU inference: a batch runs as chunks on `n` single-threaded streams.

    One forward on n OpenMP threads meets at a barrier after every op, so on a shared machine one
    descheduled thread stalls them all (docs/results.md §23). Streams never wait for each other inside a
    chunk, and a slow one holds back only its own chunk. Rows are independent in eval mode (BatchNorm uses
    running stats), so the result equals one forward over the batch. Conv towers get channels-last input.
    """

    def __init__(self, encoder, n: int, chunk: int = 32):
        self.encoder, self.n, self.chunk = encoder, int(n), int(chunk)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(self.n, thread_name_prefix="embed-stream") if self.n > 1 else None
        self._threads_before = torch.get_num_threads()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pool is not None and not getattr(self._local, "single", False):
            # this stream's intra-op threads. get_num_threads first runs ATen's lazy per-thread init
            # (which copies the process-wide count), so the 1 set here sticks to this thread alone
            torch.get_num_threads()
            torch.set_num_threads(1)
            self._local.single = True
        if getattr(self.encoder, "prefers_channels_last", False):
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            return self.encoder(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> (B, D) unit embeddings."""
        if self._pool is None or x.shape[0] <= self.chunk:
            return self._forward(x)
        out = torch.cat(list(self._pool.map(self._forward, x.split(self.chunk))))
        torch.set_num_threads(
            self._threads_before
        )  # the process-wide default the streams' set_num_threads touched
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            torch.set_num_threads(self._threads_before)


def _collate(batch):
    # __getitems__ already returns the collated (indices, tensor, errors) triple
    return batch


def _item_id(dataset, i: int) -> str:
    try:
        return str(dataset.item_id(i))
    except Exception:  # noqa: BLE001 - an id is only for the report
        return str(i)


def _ranges(shards: list[int]) -> str:
    """'0-3, 8' style listing of shard numbers (a step > 1 is written as 0,2..8)."""
    if not shards:
        return "none"
    if len(shards) > 2 and len({b - a for a, b in zip(shards, shards[1:])}) == 1:
        step = shards[1] - shards[0]
        return f"{shards[0]}-{shards[-1]}" if step == 1 else f"{shards[0]},{shards[1]}..{shards[-1]}"
    return ", ".join(map(str, shards))


def embed_shards(
    encoder,
    dataset,
    cache_dir: str | os.PathLike,
    indices: np.ndarray,
    *,
    shard_size: int = 8192,
    batch_size: int = 256,
    num_workers: int = 0,
    device=None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> int:
    """Embed this rank's unfinished shards into `cache_dir`; returns how many it wrote."""
    cache_dir = Path(cache_dir)
    indices = np.asarray(indices, dtype=np.int64)
    n_shards = shard_count(len(indices), shard_size)
    assigned = [s for s in range(n_shards) if s % world_size == rank]
    mine = [s for s in assigned if not _shard_done(cache_dir, s)]
    logger.info(
        "embedding %d items in %d shard(s) of %d over %d rank(s) (shard s on rank s %% %d): rank %d: "
        "shards [%s] (%d to embed, %d already on disk)",
        len(indices),
        n_shards,
        shard_size,
        world_size,
        world_size,
        rank,
        _ranges(assigned),
        len(mine),
        len(assigned) - len(mine),
    )
    if not mine:
        return 0
    device = torch.device(device) if device is not None else next(encoder.parameters()).device
    positions = np.concatenate(
        [np.arange(s * shard_size, min((s + 1) * shard_size, len(indices))) for s in mine]
    )
    loader = DataLoader(
        SafeItems(dataset, indices[positions], encoder.image_size),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate,
        persistent_workers=False,
        pin_memory=device.type == "cuda",
    )
    was_training = encoder.training
    encoder.eval()
    forward = CpuStreams(encoder, torch.get_num_threads()) if device.type == "cpu" else encoder
    shard_iter = iter(mine)
    current = next(shard_iter)
    expected = min((current + 1) * shard_size, len(indices)) - current * shard_size
    buf_rows: list[np.ndarray] = []
    buf_emb: list[np.ndarray] = []
    buf_skip: list[dict] = []
    seen = 0
    written = 0

    def flush() -> None:
        nonlocal written
        emb = np.concatenate(buf_emb, axis=0) if buf_emb else np.zeros((0, encoder.embed_dim), np.float32)
        rows = np.concatenate(buf_rows).tolist() if buf_rows else []
        name = _shard_name(current)
        shard = np.ascontiguousarray(emb, dtype=np.float32)
        atomic_write(
            cache_dir / f"{name}.npy", lambda fh: np.save(fh, shard, allow_pickle=False), binary=True
        )
        atomic_write_text(cache_dir / f"{name}.json", json.dumps({"rows": rows, "skipped": buf_skip}) + "\n")
        written += 1

    try:
        with (
            torch.inference_mode(),
            tqdm(
                total=len(positions), desc=f"embed[{rank}]", unit="img", disable=not progress, leave=False
            ) as bar,
        ):
            for idx, tensors, errors in loader:
                idx = np.asarray(idx, dtype=np.int64)
                ok = np.array([not e for e in errors], dtype=bool)  # (B,)
                z = np.zeros((len(idx), encoder.embed_dim), np.float32)  # (B, D); rows of bad items unused
                if tensors is not None:
                    zg = forward(tensors.to(device, non_blocking=True)).float().cpu().numpy()  # (B', D)
                    zg /= np.linalg.norm(zg, axis=1, keepdims=True)  # exact unit rows in float32
                    assert zg.shape[0] == int(ok.sum()), "embedding rows out of step with batch items"
                    z[ok] = zg
                    # NaN/inf pixels (or a diverged encoder) give a non-finite row: skip that item.
                    # Checking the (B, D) output is ~100x cheaper than the (B, 3, S, S) input.
                    bad = ok & ~np.isfinite(z).all(axis=1)
                    for i in np.flatnonzero(bad):
                        ok[i] = False
                        errors[i] = "ValueError: non-finite embedding (NaN or inf in the image tensor)"
                for i in np.flatnonzero(~ok):
                    item = int(idx[i])
                    buf_skip.append({"index": item, "id": _item_id(dataset, item), "error": errors[i]})
                    logger.warning("skipping item %d (%s): %s", item, _item_id(dataset, item), errors[i])
                # Split the batch over shard boundaries (batches need not align with shards).
                start = 0
                while start < len(idx):
                    take = min(expected - seen, len(idx) - start)
                    part = slice(start, start + take)
                    keep = ok[part]
                    buf_rows.append(idx[part][keep])
                    buf_emb.append(z[part][keep])
                    seen += take
                    start += take
                    if seen == expected:
                        done = set(np.concatenate(buf_rows).tolist()) if buf_rows else set()
                        shard_lo = current * shard_size
                        shard_items = set(indices[shard_lo : shard_lo + expected].tolist())
                        # skipped entries of a batch straddling shards belong to the shard holding them
                        mine_skip = [
                            e for e in buf_skip if e["index"] in shard_items and e["index"] not in done
                        ]
                        rest_skip = [e for e in buf_skip if e not in mine_skip]
                        buf_skip = mine_skip
                        flush()
                        buf_rows, buf_emb, buf_skip, seen = [], [], rest_skip, 0
                        current = next(shard_iter, None)
                        if current is not None:
                            expected = min((current + 1) * shard_size, len(indices)) - current * shard_size
                bar.update(len(idx))
    finally:
        encoder.train(was_training)
        if isinstance(forward, CpuStreams):
            forward.close()
    assert current is None, f"shard {current} was not completed"
    return written


def collect_shards(
    cache_dir: str | os.PathLike, indices: np.ndarray, shard_size: int, dim: int
) -> EmbedResult:
    """Read every complete shard in order into one EmbedResult (rank 0 after the barrier)."""
    cache_dir = Path(cache_dir)
    embs, rows, skipped = [], [], []
    for s in range(shard_count(len(indices), shard_size)):
        name = _shard_name(s)
        if not _shard_done(cache_dir, s):
            raise RuntimeError(f"embedding shard {cache_dir / name} is missing; a rank did not finish")
        meta = json.loads((cache_dir / f"{name}.json").read_text())
        emb = np.load(cache_dir / f"{name}.npy", allow_pickle=False)
        if emb.shape != (len(meta["rows"]), dim):
            raise RuntimeError(
                f"{cache_dir / name}.npy has shape {emb.shape}, expected ({len(meta['rows'])}, {dim})"
            )
        embs.append(emb)
        rows.extend(meta["rows"])
        skipped.extend(meta["skipped"])
    embeddings = np.concatenate(embs, axis=0) if embs else np.zeros((0, dim), np.float32)
    return EmbedResult(np.ascontiguousarray(embeddings, np.float32), np.asarray(rows, np.int64), skipped)


def embed_dataset(
    encoder,
    dataset,
    cache_dir: str | os.PathLike,
    *,
    key: str = "",
    indices: np.ndarray | None = None,
    shard_size: int = 8192,
    batch_size: int = 256,
    num_workers: int = 0,
    device=None,
    progress: bool = True,
) -> EmbedResult:
    """Single-process, resumable embedding of `dataset[indices]` (all items by default)."""
    if shard_size < 1 or batch_size < 1 or num_workers < 0:
        raise ValueError(
            f"need shard_size >= 1, batch_size >= 1, num_workers >= 0; got "
            f"{shard_size}, {batch_size}, {num_workers}"
        )
    t0 = time.perf_counter()
    indices = np.arange(len(dataset), dtype=np.int64) if indices is None else np.asarray(indices, np.int64)
    resumed = prepare_cache(cache_dir, key, indices, shard_size)
    embed_shards(
        encoder,
        dataset,
        cache_dir,
        indices,
        shard_size=shard_size,
        batch_size=batch_size,
        num_workers=num_workers,
        device=device,
        progress=progress,
    )
    result = collect_shards(cache_dir, indices, shard_size, encoder.embed_dim)
    result.seconds = time.perf_counter() - t0
    result.resumed_shards = resumed
    return result


# ----------------------------------------------------------------------------- distributed


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment; (0, 1, 0) otherwise
    (`training.distributed.torchrun_env`, the one reader of those variables)."""
    return torchrun_env()


@contextlib.contextmanager
def distributed():
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on GPU).

    Yields (rank, world_size, device); on success tears the group down if it created it.
    """
    rank, world, local = dist_env()
    if world <= 1:
        yield 0, 1, None
        return
    import torch.distributed as dist

    created = False
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        created = True
    # on an error nothing below runs: no teardown handshake, since a peer may be inside a collective and a
    # barrier here would hang
    yield dist.get_rank(), dist.get_world_size(), device
    if created:
        # leave together: rank 0 collects the shards after the last barrier, and a rank that exits while
        # gloo's worker still frees a collective aborts (SIGABRT); training.distributed says why
        leave_process_group()


def barrier() -> None:
    """torch.distributed barrier when a group is up; no-op otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast(obj, src: int = 0):
    """Broadcast a picklable object from `src` to every rank (identity without a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]

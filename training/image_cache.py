"""Decode once: the memory-mapped image cache of file-backed datasets (folders of image files).

The first time a file list is used at a resolution R, every file is decoded once by
``training.images.load_square`` (limits from the header, JPEG draft, reduce-then-resize, EXIF,
transparency onto white) in parallel worker processes, into one ``(N, R, R, 3)`` uint8 array.
Training, index builds, evaluation, calibration, the quality gate and the neighbour
precompute then read rows of that array through ``np.load(mmap_mode="r")``: no decode, no
copy of the whole array, pages shared by every process on the machine.

Layout under the cache root (``$SOFTSEARCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/softsearch``,
else ``~/.cache/softsearch``; a config's ``cache_dir`` overrides both)::

    images/<key>/images.npy      (N, R, R, 3) uint8, row i = file i of the list
    images/<key>/index.json      what was cached: files, resolution, limits, skipped files + reasons
    images/<key>.lock            builders take it (flock) so one process decodes, the others wait
    digests/<hash of dir>.json   sha256 of each file, memoised on (size, mtime_ns, inode)

``key`` hashes the file names and contents (sha256 of each file), R, the limits and the decode
version, so a changed folder (or a changed policy) gets a new cache and old ones are never
read again. A cache is built in ``images/<key>.tmp-<pid>/`` and renamed into place when
complete: a reader sees a whole cache or none, also when several processes race.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from training.images import DECODE_VERSION, ImageError, ImageLimits, load_square

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "ImageCache",
    "default_cache_root",
    "file_digests",
    "content_key",
    "open_or_build",
    "summarise_skipped",
]

CACHE_ENV = "SOFTSEARCH_CACHE_DIR"
IMAGES_FILE = "images.npy"
INDEX_FILE = "index.json"
_CHUNK = 32  # files per worker task
_INLINE_BELOW = 64  # smaller lists are decoded in the calling process (no pool start-up)


def default_cache_root() -> Path:
    """$SOFTSEARCH_CACHE_DIR, else $XDG_CACHE_HOME/softsearch, else ~/.cache/softsearch."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "softsearch"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(
    base: Path, rel: list[str], cache_root: Path | None = None, progress: bool = True
) -> list[str]:
    """sha256 hex of each file ``base/rel[i]`` ("unreadable" when it cannot be read).

    Memoised per directory on (size, mtime_ns, inode), so fingerprinting a folder again costs
    one ``stat`` per file; a file whose stat changed is hashed again.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    memo_path = root / "digests" / (hashlib.sha256(str(base).encode()).hexdigest()[:32] + ".json")
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    out: list[str] = []
    fresh: dict[str, list] = {}
    todo = []
    for r in rel:
        try:
            st = os.stat(base / r)
        except OSError:
            out.append("unreadable")
            continue
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        known = memo.get(r)
        if isinstance(known, list) and known[:3] == stamp:
            out.append(known[3])
        else:
            out.append("")
            todo.append((len(out) - 1, r, stamp))
    for pos, r, stamp in tqdm(
        todo, desc="hashing files", unit="file", leave=False, disable=not progress or len(todo) < 1000
    ):
        try:
            digest = _sha256_file(base / r)
        except OSError:
            out[pos] = "unreadable"
            continue
        out[pos] = digest
        fresh[r] = stamp + [digest]
    if fresh:
        memo.update(fresh)
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(memo_path, json.dumps(memo, separators=(",", ":")))
        except OSError as err:  # a read-only cache only costs hashing again next time
            logger.info("cannot write the file digest memo %s: %s", memo_path, err)
    return out


def content_key(rel: list[str], digests: list[str]) -> str:
    """sha256 hex over the (name, content sha256) pairs of a file list, in order."""
    h = hashlib.sha256()
    for r, d in zip(rel, digests, strict=True):
        h.update(r.encode() + b"\0" + d.encode() + b"\0")
    return h.hexdigest()


@dataclass
class ImageCache:
    """An opened cache: ``images[row]`` is file `row` decoded to (R, R, 3) uint8 (memory-mapped)."""

    path: Path
    images: np.ndarray  # (N, R, R, 3) uint8, read-only memmap
    ok: np.ndarray  # (N,) bool: the file decoded
    skipped: list[dict] = field(default_factory=list)  # {"row", "file", "reason", "error"}
    info: dict = field(default_factory=dict)
    built: bool = False  # this call decoded the files (False: an existing cache was opened)

    @property
    def resolution(self) -> int:
        return int(self.images.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.images.size)


def _decode_chunk(npy_path: str, jobs: list[tuple[int, str]], side: int, limits: ImageLimits) -> list[tuple]:
    """Worker: decode files into their rows of the cache array; -> [(row, reason, error)] failures."""
    arr = np.lib.format.open_memmap(npy_path, mode="r+")
    failures = []
    for row, path in jobs:
        try:
            arr[row] = load_square(path, side, limits)
        except ImageError as err:
            failures.append((row, err.code, err.message))
        except Exception as err:  # noqa: BLE001 - one file must never end a build; report it as unreadable
            failures.append((row, "corrupt_image", f"{path}: {type(err).__name__}: {err}"))
    arr.flush()
    del arr
    return failures


def _pool_context():
    """fork while this process runs no other thread (tqdm's idle monitor aside): instant, and no
    lock can be held by a thread the child lacks; spawn otherwise (workers re-import the package)."""
    others = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread() and type(t).__name__ != "TMonitor"
    ]
    return multiprocessing.get_context("spawn" if others or os.name != "posix" else "fork")


def _decode_all(
    npy_path: Path, paths: list[Path], side: int, limits: ImageLimits, workers: int, desc: str, progress: bool
) -> list[tuple]:
    jobs = [(i, str(p)) for i, p in enumerate(paths)]
    chunks = [jobs[i : i + _CHUNK] for i in range(0, len(jobs), _CHUNK)]
    failures: list[tuple] = []
    with tqdm(total=len(jobs), desc=desc, unit="img", disable=not progress, leave=False) as bar:
        if workers <= 1 or len(jobs) < _INLINE_BELOW:
            for chunk in chunks:
                failures.extend(_decode_chunk(str(npy_path), chunk, side, limits))
                bar.update(len(chunk))
        else:
            with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context()) as pool:
                futures = {
                    pool.submit(_decode_chunk, str(npy_path), chunk, side, limits): len(chunk)
                    for chunk in chunks
                }
                for fut in as_completed(futures):
                    failures.extend(fut.result())
                    bar.update(futures[fut])
    return sorted(failures)


def summarise_skipped(skipped: list[dict]) -> str:
    """'2 image_too_large, 1 not_an_image' for a list of skipped records."""
    counts = Counter(s.get("reason", "error") for s in skipped)
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))


def _open(path: Path, n: int, side: int) -> ImageCache | None:
    """Open a complete cache directory, or None when it is missing or does not match."""
    try:
        info = json.loads((path / INDEX_FILE).read_text())
        images = np.load(path / IMAGES_FILE, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if images.shape != (n, side, side, 3) or images.dtype != np.uint8 or info.get("count") != n:
        logger.warning("image cache %s does not match its index (shape %s); rebuilding", path, images.shape)
        return None
    ok = np.ones(n, dtype=bool)
    skipped = info.get("skipped", [])
    ok[[int(s["row"]) for s in skipped]] = False
    return ImageCache(path, images, ok, skipped, info)


@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except OSError as err:  # e.g. a filesystem without locks: the rename below still keeps readers safe
            logger.info("no lock on %s (%s); building without it", lock_path, err)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def open_or_build(
    paths: list[Path],
    names: list[str],
    digests: list[str],
    side: int,
    limits: ImageLimits,
    *,
    cache_root: Path | None = None,
    workers: int | None = None,
    progress: bool = True,
    label: str = "images",
) -> ImageCache:
    """The cache of `paths` (display names `names`, content `digests`) at resolution `side`.

    Opens it when it exists; otherwise decodes every file once (``workers`` processes, default
    the CPU count) under the key's lock, writes it atomically and opens it.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    n = len(paths)
    spec = {
        "decode_version": DECODE_VERSION,
        "resolution": int(side),
        "max_pixels": int(limits.max_pixels),
        "max_bytes": int(limits.max_bytes),
        "content": content_key(names, digests),
        "count": n,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32] + f"-r{side}"
    final = root / "images" / key
    cache = _open(final, n, side)
    if cache is not None:
        return cache
    with _locked(root / "images" / f"{key}.lock"):
        cache = _open(final, n, side)  # another process may have finished it while we waited
        if cache is not None:
            return cache
        for stale in final.parent.glob(f"{key}.tmp-*"):  # left by a builder that died (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        tmp = final.parent / f"{key}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            t0 = time.perf_counter()
            npy = tmp / IMAGES_FILE
            blank = np.lib.format.open_memmap(npy, mode="w+", dtype=np.uint8, shape=(n, side, side, 3))
            del blank  # a sparse file; workers fill the rows
            cpus = os.cpu_count() or 1
            nworkers = max(1, min(int(workers) if workers else cpus, -(-n // _CHUNK)))
            failures = _decode_all(npy, paths, side, limits, nworkers, f"decoding {label}", progress)
            if failures:  # rows of skipped files are white, not zeros
                arr = np.lib.format.open_memmap(npy, mode="r+")
                arr[[row for row, _, _ in failures]] = 255
                arr.flush()
                del arr
            seconds = time.perf_counter() - t0
            skipped = [
                {"row": row, "file": names[row], "reason": code, "error": msg} for row, code, msg in failures
            ]
            info = {
                **spec,
                "skipped": skipped,
                "seconds": seconds,
                "workers": nworkers,
                "images_per_s": n / seconds if seconds > 0 else None,
                "label": label,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            with open(npy, "rb+") as fh:
                os.fsync(fh.fileno())
            _atomic_write_text(tmp / INDEX_FILE, json.dumps(info, indent=1) + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    cache = _open(final, n, side)
    if cache is None:  # pragma: no cover - we just wrote it
        raise RuntimeError(f"image cache {final} could not be read back")
    cache.built = True
    rate = f"{n / seconds:.0f} images/s" if seconds > 0 else "instant"
    logger.info(
        "cached %d %s at %dx%d in %.1f s (%s, %d worker(s)) -> %s",
        n,
        label,
        side,
        side,
        seconds,
        rate,
        nworkers,
        final,
    )
    return cache

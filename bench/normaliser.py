"""Bounded vs exact softmax normaliser (search/serving/normaliser.py) on clustered embeddings, d = 128.

For each N (default 1e6 and 1e7): clustered unit vectors (bench/index_kinds.clustered: 256 centres,
cosine ~0.7 to the centre) are written in chunks to a .npy memory map under --workdir (1e7 x 128
float32 = 5.1 GB; deleted at the end), an IVF-PQ index (IVF4096,PQ16, nprobe 16: ~24 bytes per
item, the index a collection past RAM is served with) is trained and filled chunk by chunk, and the
per-list statistics are built once. Queries are fresh draws from the same generator.

* accuracy, over --queries queries per tau: |log Z^ - log Z| (median, max) against the exact value
  (one float32 streaming pass computing every tau at once, float64 sums); whether the deterministic
  bound contains it (all queries); coverage of the sampled interval at its stated level (with the
  99 % binomial range for that many queries); how often the exact fallback ran; the error of the
  top-10 probabilities p = exp(s/tau - log Z^) of the hits the product returns (the index's top 10
  rescored exactly) and whether they lie in the bound's probability range.
* time per query, the full Searcher path of each method, interleaved call by call on the same
  queries: exact = index search (k = 10) + `log_normaliser` over all N (the baseline: what serving
  does without this module); bounded = index search (k = 100 top rows) + `bounded_log_normaliser`.
  At batch 1 and at batch 32 (exact amortises its scan over the batch). Each method runs with the
  memory map's pages released once read and kept mapped; rows give the three `serve --mapped-pages`
  settings: auto (the default: exact releases, bounded keeps), release, keep.
* past RAM: a fresh child process per method first evicts the embedding file from the page cache
  (posix_fadvise DONTNEED), then loads the index file, memory-maps the embeddings (bounded: loads
  the statistics and advises MADV_RANDOM, as serving does), answers queries (bounded
  --rss-queries, exact 1: a second would find the file cached) and reports the storage bytes read
  per query (/proc/self/io read_bytes), the time per query from that cold start, and how much
  VmRSS (memory-map pages included), RssFile and VmHWM grew over the process right after its
  imports (torch and faiss alone are ~1 GiB there, the same for both).

    .venv/bin/python bench/normaliser.py                      # N = 1e6 and 1e7 (~30 min on 2 cores)
    .venv/bin/python bench/normaliser.py --sizes 1000000      # N = 1e6 only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
from scipy.stats import binom
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import RESULTS_DIR, row, write_results  # noqa: E402
from index_kinds import clustered  # noqa: E402

from search.serving.normaliser import (  # noqa: E402
    ListStats,
    NormaliserConfig,
    advise_random,
    bounded_log_normaliser,
    log_normaliser,
)

D = 128
CHUNK = 500_000


def _fmt(n: int) -> str:
    return f"1e{len(str(n)) - 1}" if str(n).strip("0") == "1" else str(n)


def _status() -> dict:
    """VmRSS / RssFile / RssAnon / VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssFile", "RssAnon", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


def make_data(path: Path, n: int, seed: int = 0) -> np.ndarray:
    """Clustered unit rows written chunk by chunk into a .npy memory map (never all in RAM)."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, D))
    for i, start in enumerate(tqdm(range(0, n, CHUNK), desc=f"data N={_fmt(n)}", unit="chunk")):
        m = min(CHUNK, n - start)
        out[start : start + m] = clustered(m, D, seed=seed * 100_003 + i)
    out.flush()
    del out
    return np.load(path, mmap_mode="r")


def make_index(emb: np.ndarray, nlist: int, m: int, nprobe: int) -> tuple[faiss.Index, float]:
    """IVF-PQ trained on 64 * nlist rows, filled chunk by chunk from the memory map."""
    t0 = time.perf_counter()
    n = emb.shape[0]
    index = faiss.index_factory(D, f"IVF{nlist},PQ{m}x8np", faiss.METRIC_INNER_PRODUCT)
    sample = np.sort(np.random.default_rng(1).choice(n, size=min(n, 64 * nlist), replace=False))
    index.train(np.ascontiguousarray(emb[sample]))
    for start in tqdm(range(0, n, CHUNK), desc="index add", unit="chunk"):
        index.add(np.ascontiguousarray(emb[start : start + CHUNK]))
    faiss.extract_index_ivf(index).nprobe = nprobe
    return index, time.perf_counter() - t0


def exact_reference(q: np.ndarray, emb: np.ndarray, taus: list[float], block: int = 32768) -> np.ndarray:
    """(len(taus), Q) exact log Z: one float32 similarity block per pass, float64 logsumexp per tau."""
    m = np.full((len(taus), len(q)), -np.inf)
    acc = np.zeros((len(taus), len(q)))
    for start in tqdm(range(0, emb.shape[0], block), desc="exact reference", unit="block"):
        s = (q @ np.asarray(emb[start : start + block]).T).astype(np.float64)  # (Q, B)
        for t, tau in enumerate(taus):
            logits = s / tau
            new = np.maximum(m[t], logits.max(1))
            acc[t] = acc[t] * np.exp(m[t] - new) + np.exp(logits - new[:, None]).sum(1)
            m[t] = new
    return m + np.log(acc)


def search(index: faiss.Index, q: np.ndarray, k: int) -> np.ndarray:
    return index.search(q, k)[1]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (page-cache misses, mmap faults included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def child(args) -> int:
    """Child mode: evict the embedding file from the page cache (the collection is 'past RAM'), load
    index + memory map (+ statistics), answer queries with one method; print RSS, storage reads, time."""
    work = Path(args.workdir)
    faiss.omp_set_num_threads(1)
    fd = os.open(work / "emb.npy", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drops the clean cached pages nobody maps
    os.close(fd)
    base = _status()
    index = faiss.read_index(str(work / "index.faiss"))
    faiss.extract_index_ivf(index).nprobe = args.nprobe
    emb = np.load(work / "emb.npy", mmap_mode="r")
    q = np.load(work / "queries.npy")[: args.child_queries]
    taus = np.full(len(q), args.taus[0])
    if args.child != "exact":
        stats = ListStats.load(work / "stats.npz")
        advise_random(emb)  # as Normaliser.for_version does when serving bounded
        # serving default (--mapped-pages auto: bounded keeps its pages mapped) or --mapped-pages release
        cfg = NormaliserConfig("bounded", release_pages=True if args.child == "bounded-release" else None)
    read0, t0 = _read_bytes(), time.perf_counter()
    for i in range(len(q)):
        if args.child == "exact":
            search(index, q[i : i + 1], 10)
            log_normaliser(
                q[i : i + 1], emb, taus[i : i + 1], release=NormaliserConfig("exact").releases("exact")
            )
        else:
            top = search(index, q[i : i + 1], cfg.top_rows)
            bounded_log_normaliser(q[i : i + 1], emb, stats, taus[i : i + 1], cfg, top)
    seconds, read = time.perf_counter() - t0, _read_bytes() - read0
    print(
        json.dumps(
            {
                **_status(),
                "base_rss": base["VmRSS"],
                "base_file": base["RssFile"],
                "read_per_query": read / len(q),
                "seconds_per_query": seconds / len(q),
            }
        )
    )
    return 0


def child_rss(args, method: str, queries: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--workdir",
        args.workdir,
        "--nprobe",
        str(args.nprobe),
        "--child-queries",
        str(queries),
        "--taus",
        str(args.taus[0]),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {method} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_size(n: int, args, rows: list[dict]) -> None:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tag = f"N={_fmt(n)}"
    cfg = NormaliserConfig("bounded")
    emb = make_data(work / "emb.npy", n)
    q_all = clustered(args.queries, D, seed=999_983)  # fresh queries
    np.save(work / "queries.npy", q_all)
    index, build_s = make_index(emb, args.nlist, args.pq_m, args.nprobe)
    faiss.write_index(index, str(work / "index.faiss"))
    stats = ListStats.build(emb, index, progress=True)
    stats.save(work / "stats.npz")
    rows.append(row(f"{tag} IVF{args.nlist},PQ{args.pq_m} build (train + add)", build_s, "s", None))
    rows.append(row(f"{tag} normaliser statistics build (once per index version)", stats.seconds, "s", None))
    rows.append(
        row(f"{tag} normaliser statistics size", stats.nbytes / 2**20, "MiB", emb.nbytes / 2**20)
    )  # baseline: the float32 embeddings exact keeps resident

    # ---- accuracy
    ref = exact_reference(q_all, emb, args.taus)  # (T, Q)
    top_all = search(index, q_all, cfg.top_rows)
    for t, tau in enumerate(args.taus):
        taus = np.full(len(q_all), tau)
        got = bounded_log_normaliser(q_all, emb, stats, taus, cfg, top_all)
        err = got.value - ref[t]
        inside = (got.lower <= ref[t]) & (ref[t] <= got.upper)
        sampled = ~got.exact_mask
        cov = ((got.interval_lower <= ref[t]) & (ref[t] <= got.interval_upper))[sampled]
        lo, hi = binom.ppf([0.005, 0.995], max(len(cov), 1), cfg.level) / max(len(cov), 1)
        # the product's hits: the index's top 10 rescored exactly, p = exp(s / tau - log Z)
        hits = top_all[:, :10]
        assert hits.min() >= 0, "the index returned fewer than 10 hits"
        s = np.einsum(
            "qkd,qd->qk",
            np.asarray(emb[np.sort(hits.ravel())])[np.argsort(np.argsort(hits.ravel()))].reshape(
                hits.shape + (D,)
            ),
            q_all,
        ).astype(np.float64)
        p_exact = np.exp(s / tau - ref[t][:, None])
        p_est = np.exp(s / tau - got.value[:, None])
        p_in = (np.exp(s / tau - got.upper[:, None]) <= p_exact * (1 + 1e-12)) & (
            p_exact <= np.exp(s / tau - got.lower[:, None]) * (1 + 1e-12)
        )
        rel = np.abs(p_est / p_exact - 1)
        case = f"{tag} tau={tau} bounded"
        rows += [
            row(f"{case} |dlogZ| median ({len(q_all)} queries)", float(np.median(np.abs(err))), "nats", None),
            row(f"{case} |dlogZ| max", float(np.abs(err).max()), "nats", None),
            row(f"{case} deterministic bound contains exact", float(inside.mean()), "fraction", 1.0),
            row(
                f"{case} deterministic bound width median",
                float(np.median(got.upper - got.lower)),
                "nats",
                None,
            ),
            row(
                f"{case} {cfg.level:.0%} interval coverage ({len(cov)} sampled; 99% binomial range "
                f"{lo:.3f}-{hi:.3f})",
                float(cov.mean()) if len(cov) else float("nan"),
                "fraction",
                cfg.level,
            ),
            row(
                f"{case} interval width median",
                float(np.nanmedian(got.interval_upper - got.interval_lower)),
                "nats",
                None,
            ),
            row(f"{case} exact fallback", float(got.exact_mask.mean()), "fraction", None),
            row(f"{case} top-10 probability relative error median", float(np.median(rel)), "fraction", None),
            row(f"{case} top-10 probability relative error max", float(rel.max()), "fraction", None),
            row(
                f"{case} top-10 probability abs error max", float(np.abs(p_est - p_exact).max()), "prob", None
            ),
            row(f"{case} top-10 exact probability inside the bound", float(p_in.mean()), "fraction", 1.0),
            row(f"{case} rows read per query (mean)", float(got.rows.mean()), "rows", float(n)),
            # each row read at random is one 4 KiB page of the memory map (1e7 rows: 8 per page, so
            # distinct pages ~ rows); exact streams the whole file
            row(
                f"{case} embedding pages read per query (<= rows x 4 KiB)",
                float(got.rows.mean()) * 4096 / 2**20,
                "MiB",
                emb.nbytes / 2**20,
            ),
        ]
        print(
            f"{case}: median |d| {np.median(np.abs(err)):.4f}, max {np.abs(err).max():.4f}, contains "
            f"{inside.mean():.3f}, coverage {cov.mean() if len(cov) else float('nan'):.3f}, "
            f"fallback {got.exact_mask.mean():.3f}",
            flush=True,
        )

    # ---- time per query, interleaved: exact (baseline) vs bounded, full Searcher path, each with the
    # memory map's pages released once read and kept mapped; rows for the three --mapped-pages settings
    # (auto, the serving default: exact releases, bounded keeps; release; keep)
    tq = q_all[: args.timing_queries]
    settings = {
        "auto (serving default)": ("release", "keep"),
        "release": ("release", "release"),
        "keep": ("keep", "keep"),
    }
    for tau, batch in ((tau, batch) for tau in args.taus for batch in args.batches):
        t = {(m, how): 0.0 for m in ("exact", "bounded") for how in ("release", "keep")}
        count = 0
        for start in tqdm(range(0, len(tq), batch), desc=f"timing batch {batch}", unit="call"):
            x = np.ascontiguousarray(tq[start : start + batch])
            taus = np.full(len(x), tau)
            for how in ("release", "keep") if (start // batch) % 2 == 0 else ("keep", "release"):
                rel = how == "release"
                t["exact", how] += timed(
                    lambda: (search(index, x, 10), log_normaliser(x, emb, taus, release=rel))
                )
                t["bounded", how] += timed(
                    lambda: bounded_log_normaliser(
                        x, emb, stats, taus, cfg, search(index, x, cfg.top_rows), release=rel
                    )
                )
            count += len(x)
        ms = {key: 1e3 * v / count for key, v in t.items()}
        for setting, (exact_how, bounded_how) in settings.items():
            rows.append(
                row(
                    f"{tag} tau={tau} time per query batch {batch} ({count} queries), bounded vs exact, "
                    f"--mapped-pages {setting}",
                    ms["bounded", bounded_how],
                    "ms",
                    ms["exact", exact_how],
                )
            )
        print(
            f"{tag} tau={tau} batch {batch}: "
            + "; ".join(
                f"{how}: bounded {ms['bounded', how]:.2f} ms, exact {ms['exact', how]:.2f} ms"
                for how in ("release", "keep")
            )
            + f"; default {ms['exact', 'release'] / ms['bounded', 'keep']:.1f}x",
            flush=True,
        )

    # ---- resident memory, fresh processes
    emb = index = stats = (
        None  # release the map and the index before the next size (the lambdas above closed over them)
    )
    rss_e = child_rss(args, "exact", 1)  # a second exact query would find the file cached again
    rss_b = child_rss(args, "bounded", args.rss_queries)
    rss_br = child_rss(args, "bounded-release", args.rss_queries)
    rows.append(
        row(
            f"{tag} cold file: storage read per query, bounded ({args.rss_queries} q) vs exact (1 q)",
            rss_b["read_per_query"] / 2**20,
            "MiB",
            rss_e["read_per_query"] / 2**20,
        )
    )
    rows.append(
        row(
            f"{tag} cold file: time per query, bounded vs exact",
            1e3 * rss_b["seconds_per_query"],
            "ms",
            1e3 * rss_e["seconds_per_query"],
        )
    )
    # RSS added by serving (index + memory map + statistics + work), over the process after its imports
    for key, what in (
        ("VmRSS", "serving RSS added after queries"),
        ("RssFile", "of which file-backed (memory map)"),
        ("VmHWM", "peak RSS added"),
    ):
        base_e = rss_e["base_rss"] if key != "RssFile" else rss_e["base_file"]
        base_b = rss_b["base_rss"] if key != "RssFile" else rss_b["base_file"]
        rows.append(
            row(
                f"{tag} {what}, bounded vs exact",
                (rss_b[key] - base_b) / 2**20,
                "MiB",
                (rss_e[key] - base_e) / 2**20,
            )
        )
        base_br = rss_br["base_rss"] if key != "RssFile" else rss_br["base_file"]
        rows.append(
            row(
                f"{tag} {what}, bounded --mapped-pages release vs bounded (default, pages kept)",
                (rss_br[key] - base_br) / 2**20,
                "MiB",
                (rss_b[key] - base_b) / 2**20,
            )
        )
    print(f"{tag} RSS: bounded {rss_b}, bounded release {rss_br}, exact {rss_e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--taus", type=float, nargs="+", default=[0.1, 0.05])
    p.add_argument(
        "--queries", type=int, default=1000, help="accuracy queries per size (exact reference for each)"
    )
    p.add_argument("--timing-queries", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rss-queries", type=int, default=20, help="queries each memory-measuring child answers")
    p.add_argument("--nlist", type=int, default=4096)
    p.add_argument("--pq-m", type=int, default=16)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/softsearch-bench-normaliser")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--name", default="normaliser")
    p.add_argument("--child", choices=["exact", "bounded", "bounded-release"], help=argparse.SUPPRESS)
    p.add_argument("--child-queries", type=int, default=10, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    faiss.omp_set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    load0 = os.getloadavg()
    rows: list[dict] = []
    try:
        for n in args.sizes:
            run_size(n, args, rows)
            shutil.rmtree(args.workdir, ignore_errors=True) if not args.keep else None
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    path = write_results(args.name, rows)
    data = json.loads(path.read_text())
    load1 = os.getloadavg()
    data["machine"] += (
        f"; shared machine, load average {load0[0]:.1f} at start, {load1[0]:.1f} at end "
        f"(2 cores); faiss threads {faiss.omp_get_max_threads()}"
    )
    path.write_text(json.dumps(data, indent=2) + "\n")
    assert path.parent == RESULTS_DIR
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

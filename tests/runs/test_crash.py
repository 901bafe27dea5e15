"""Crash safety of snapshots: training jobs killed with SIGKILL.

Every kill is a real ``SIGKILL`` of a real training process (``tests/support/crash_job.py``: a
``transformers.Trainer`` on a tiny float32 GPT-2, a snapshot every step), either sent by the job
to itself at a chosen point of its N-th snapshot (N ≥ 2, so one snapshot of the run is complete;
see the moments in crash_job.py: in the shard write, around the manifest, around the rename, in
the re-snapshot of an existing step) or sent by this test at a seeded random time.

Runs are chained in one output directory (each run starts training from step 0 there, so it
also re-snapshots steps that exist); after EVERY kill, on the real files:

* every directory under a final name (``step-XXXXXXXX``) loads with `Snapshot.load` (manifest,
  sha256 of every shard, shapes): no partial directory exists under a final name;
* `Snapshot.latest` returns the newest of them, which verifies, and never a hidden
  ``.step-*.tmp-*`` directory (even one that holds a complete, newer snapshot);
* the temporary directory the kill left (where the moment implies one) is really there,
  i.e. the kill hit the moment it names;
* the next run's rank 0 sees no ``.step-*.tmp-*`` entry once the callback's ``on_train_begin``
  has run (``clean_stale_tmp``), and the chain's last run, which trains to its end, leaves
  none at all.

The 2-process variant (``accelerate launch`` with ``launch/cpu_ddp.yaml``, gloo) kills ONE rank
(rank 0 or rank 1); the launcher tears the other one down, and the whole process group is
killed and waited for before anything is checked.

The unmarked test is a quick subset (6 targeted kills); ``-m slow`` runs the full seeded
campaign (30 single-process kills + 8 two-process kills). ``pytest -s`` prints the counts.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors import safe_open

from kfac_stream import Snapshot
from kfac_stream.snapshot.layout import MANIFEST, STEP_DIR_RE

import repo_paths

ROOT = str(repo_paths.ROOT)
JOB = str(repo_paths.SUPPORT / "crash_job.py")
TMP_RE = re.compile(r"^\.step-(\d{8})\.tmp-(.+)$")
MARK_RE = re.compile(r"^CRASH-JOB (\S+) (.*)$", re.M)
N_LAYERS = 8  # tiny_gpt2: 2 blocks × (c_attn, attn.c_proj, c_fc, mlp.c_proj); the default
# selection leaves out lm_head (tied to the embedding)
SEED = 6001
RUN_TIMEOUT = 120  # s: a run whose kill does not come by then fails the test
LAUNCHER_GRACE = 60  # s: then a launcher still running after one rank died is killed
# moments at which the killed snapshot's temporary directory must be left behind, and what
# it holds then: "none" no manifest, "partial" a manifest that is not valid JSON, "complete"
MID_WRITE = {"shard-start": "none", "shard-partial": "none", "shard-written": "none",
             "manifest-start": "none", "manifest-partial": "partial",
             "rename-before": "complete", "replace-stale": "complete"}


# -- processes ------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> list[int]:
    """PIDs of live (not zombie) processes in process group ``pgid``."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            alive.append(int(entry))
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class Job:
    """One launch (a plain process or ``accelerate launch``) in its own session; the whole
    process group is SIGKILLed and waited for on exit, whatever happened."""

    def __init__(self, out: str, job_args: list[str], ranks: int, log: str) -> None:
        if ranks == 1:
            cmd = [sys.executable, JOB]
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(ROOT, "launch", "cpu_ddp.yaml"),
                   "--main_process_port", str(_free_port()), JOB]
        self.log_path, self._read, self._text = log, 0, ""
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(cmd + ["--out", out, *job_args], cwd=ROOT, env=_env(),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_group()

    def text(self) -> str:
        with open(self.log_path, "rb") as f:  # incremental: polled every millisecond
            f.seek(self._read)
            more = f.read()
        self._read += len(more)
        self._text += more.decode(errors="replace")
        return self._text

    def marks(self, event: str) -> list[dict[str, str]]:
        return [dict(kv.split("=", 1) for kv in rest.split())
                for ev, rest in MARK_RE.findall(self.text()) if ev == event]

    def wait_for(self, what: str, pred, timeout: float = RUN_TIMEOUT, poll: float = 0.02):
        """Poll ``pred()`` until it is truthy; fail if the job ends first or on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = pred()
            if got:
                return got
            if self.proc.poll() is not None:
                got = pred()
                if got:
                    return got
                pytest.fail(f"job ended (rc={self.proc.returncode}) before {what}:\n"
                            f"{self.text()[-4000:]}")
            time.sleep(poll)
        pytest.fail(f"timeout ({timeout}s) waiting for {what}:\n{self.text()[-4000:]}")

    def wait(self, timeout: float = RUN_TIMEOUT) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        end = time.monotonic() + 30
        while _group_alive(pgid) and time.monotonic() < end:
            time.sleep(0.02)
        self._log.close()
        left = _group_alive(pgid)
        assert not left, f"processes {left} of the job survived SIGKILL of their group"


# -- the invariants -------------------------------------------------------------------------------

def entries(root: str) -> tuple[list[str], list[str]]:
    """(final-name directories, hidden temporary entries) under ``root``. Any other entry must
    be a plain file (e.g. the ``<snapshot>.spectra.png`` the callback may write beside a
    snapshot), never a directory."""
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    finals = [e for e in names if STEP_DIR_RE.match(e)]
    tmps = [e for e in names if TMP_RE.match(e)]
    others = sorted(set(names) - set(finals) - set(tmps))
    assert all(os.path.isfile(os.path.join(root, e)) for e in others), \
        f"unexpected directories in {root}: {others}"
    assert all(os.path.isdir(os.path.join(root, e)) for e in finals), finals
    return finals, tmps


def check_invariants(root: str, world_size: int) -> Snapshot:
    """Every final-name directory is a complete snapshot that verifies; `Snapshot.latest`
    returns the newest of them (never a temporary directory)."""
    finals, _ = entries(root)
    assert finals, f"no complete snapshot under {root}"
    names = None
    for e in finals:
        snap = Snapshot.load(os.path.join(root, e))  # raises on any partial/altered directory
        assert snap.step == int(STEP_DIR_RE.match(e).group(1))
        assert snap.manifest.world_size == world_size and len(snap) == N_LAYERS
        assert names is None or snap.layer_names == names
        names = snap.layer_names
        assert sorted(snap.manifest.shards) == [f"shard-{r:05d}-of-{world_size:05d}.safetensors"
                                               for r in range(world_size)]
    latest = Snapshot.latest(root)
    assert os.path.dirname(latest.path) == root
    assert os.path.basename(latest.path) == finals[-1], (latest.path, finals[-1])
    Snapshot.load(latest.path)
    return latest


def _readable(path: str) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        return True
    except Exception:  # safetensors raises its own error types
        return False


def check_moment(root: str, moment: str, step: int, kill_rank: int, world_size: int,
                 finals_before: set[str]) -> None:
    """The kill left what its moment implies (so it did hit that moment)."""
    finals, tmps = entries(root)
    final = f"step-{step:08d}"
    tmp = os.path.join(root, f".{final}.tmp-0")
    shard = os.path.join(tmp, f"shard-{kill_rank:05d}-of-{world_size:05d}.safetensors")
    # before os.replace(tmp, final) an existing final of the same step is renamed away
    stale_moved = moment == "replace-stale" or (moment == "rename-before"
                                                and final in finals_before)
    if moment in MID_WRITE:
        assert os.path.isdir(tmp), f"{moment}: no {tmp} left (entries {finals + tmps})"
        mpath = os.path.join(tmp, MANIFEST)
        kind = MID_WRITE[moment]
        if kind == "none":
            assert not os.path.exists(mpath), f"{moment}: {mpath} exists"
        elif kind == "partial":
            with open(mpath) as f, pytest.raises(json.JSONDecodeError):
                json.load(f)
        else:  # a complete, newer snapshot under a hidden name: latest must not return it
            assert Snapshot.load(tmp).step == step
        if moment == "shard-start":
            assert not os.path.exists(shard)
        elif moment == "shard-partial":
            assert os.path.isfile(shard) and not _readable(shard), shard
        else:
            assert _readable(shard), shard
        if stale_moved:  # _finish moved the old final aside; it is kept, complete, until the
            # new one is in place (clean_stale_tmp of the next run promotes the newer copy)
            assert final not in finals, f"{moment}: {final} exists"
            stale = os.path.join(root, f".{final}.tmp-replaced")
            assert Snapshot.load(stale).step == step
        else:  # untouched: absent if it was, the earlier run's complete one if not
            assert (final in finals) == (final in finals_before), (moment, final)
    else:
        assert moment == "rename-after"
        assert final in finals and not os.path.exists(tmp)
        assert Snapshot.latest(root).step >= step


def classify_random(root: str) -> str:
    """Where a random kill of one process landed, from what it left (the previous kill's
    leftovers were removed when this run started)."""
    tmps = [os.path.join(root, t) for t in entries(root)[1]]
    if not tmps:
        return "no temporary directory left"
    if any(os.path.exists(os.path.join(t, MANIFEST)) for t in tmps):
        return "in a write: manifest, not renamed"
    return "in a write: no manifest yet"


# -- chains of killed runs ------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.kills = collections.Counter()
        self.random_landed = collections.Counter()
        self.truncated_png: set[str] = set()
        self.hangs = 0  # 2 processes: launchers that did not end by themselves
        self.lock = threading.Lock()

    def add_hang(self) -> None:
        with self.lock:
            self.hangs += 1

    def add(self, label: str, landed: str | None = None) -> None:
        with self.lock:
            self.kills[label] += 1
            if landed:
                self.random_landed[landed] += 1

    def note_pngs(self, root: str) -> None:
        """Observation only (not a snapshot, not asserted): spectra PNGs that the callback may
        write beside snapshots, left truncated by the kill."""
        for e in os.listdir(root):
            if e.endswith(".png") and STEP_DIR_RE.match(e.split(".")[0]):
                with open(os.path.join(root, e), "rb") as f:
                    f.seek(max(0, os.path.getsize(f.name) - 12))
                    if not f.read().endswith(b"IEND\xaeB`\x82"):
                        with self.lock:
                            self.truncated_png.add(f.name)

    @property
    def total(self) -> int:
        return sum(self.kills.values())


def run_chain(base: str, name: str, plan: list[tuple], tally: Tally, ranks: int = 1,
              rng: random.Random | None = None, stop: threading.Event | None = None) -> None:
    """Run ``plan`` in one output directory, checking the invariants after every kill; then
    one run that trains to its end. Items: ``("target", moment, n, kill_rank)`` (the job kills
    itself) or ``("random", kill_rank, delay, anchor)``: this test sends SIGKILL ``delay``
    seconds after this run's 2nd snapshot (``anchor`` None) or after rank 0 starts writing its
    ``anchor``-th snapshot (a write takes ~10 ms here)."""
    out = os.path.join(base, name)
    root = os.path.join(out, "kfac")
    os.makedirs(out)
    for i, item in enumerate(plan):
        if stop is not None and stop.is_set():
            return
        finals_before = set(entries(root)[0])
        tmps_before = entries(root)[1]
        log = os.path.join(out, f"run-{i:02d}.log")
        if item[0] == "target":
            _, moment, n, kill_rank = item
            if moment == "replace-stale":  # needs an existing step ≥ 2 to re-snapshot
                have = sorted(int(e[5:]) for e in finals_before if int(e[5:]) >= 2)
                assert have, f"{name}: replace-stale needs an existing step ≥ 2"
                n = (rng or random.Random(0)).choice(have[:8])
            args = ["--kill-at", moment, "--kill-snapshot", str(n),
                    "--kill-rank", str(kill_rank)]
        else:
            _, kill_rank, delay, anchor = item
            args = []
        with Job(out, args, ranks, log) as job:
            ready = job.wait_for("ready", lambda: [m for m in job.marks("ready")
                                                   if m["rank"] == "0"])
            # on_train_begin of rank 0 removed every leftover of the killed run before
            assert json.loads(ready[0]["leftovers"]) == [], (tmps_before, ready[0])
            pids = {int(m["rank"]): int(m["pid"]) for m in
                    job.wait_for("every rank ready",
                                 lambda: len(job.marks("ready")) == ranks and job.marks("ready"))}
            if item[0] == "target":
                kill = job.wait_for(f"kill at {moment}", lambda: job.marks("kill"))[0]
                step, label = int(kill["step"]), f"{moment} (rank {kill_rank})"
                assert int(kill["n"]) == n and int(kill["rank"]) == kill_rank
            elif anchor is None:  # any time: a seeded delay after this run's 2nd snapshot
                job.wait_for("2 snapshots", lambda: [m for m in job.marks("snapshot-done")
                                                     if m["rank"] == "0" and int(m["n"]) >= 2])
                time.sleep(delay)
                os.kill(pids[kill_rank], signal.SIGKILL)
                label, step = f"random, any time (rank {kill_rank})", None
            else:  # a seeded delay (ms) after rank 0 starts writing snapshot ``anchor``
                job.wait_for(f"snapshot {anchor} starts",
                             lambda anchor=anchor: [m for m in job.marks("snapshot-start")
                                                    if m["rank"] == "0" and int(m["n"]) >= anchor],
                             poll=0.001)
                time.sleep(delay)
                os.kill(pids[kill_rank], signal.SIGKILL)
                label, step = f"random, near a write (rank {kill_rank})", None
            if ranks == 1:
                assert job.wait(RUN_TIMEOUT) == -signal.SIGKILL, job.text()[-3000:]
            else:  # the launcher normally notices the dead rank and stops the other one
                dead = pids[kill_rank]
                job.wait_for(f"rank {kill_rank} dead", lambda dead=dead: not _alive(dead),
                             timeout=30)
                rc = job.wait(LAUNCHER_GRACE)
                if rc is None:  # the survivor hangs in a collective: the group is killed
                    tally.add_hang()
                else:
                    assert rc != 0, job.text()[-3000:]
                    assert re.search(rf"exitcode\s*:\s*-9 \(pid: {dead}\)", job.text()), \
                        job.text()[-3000:]
        # the whole process group is dead here: check the files
        check_invariants(root, ranks)
        if step is not None:
            check_moment(root, moment, step, kill_rank, ranks, finals_before)
        # with 2 ranks the survivor may start the next snapshot: only 1 process is classified
        tally.add(label, classify_random(root) if step is None and ranks == 1 else None)
        tally.note_pngs(root)
    # the last run trains to its end in the same directory
    log = os.path.join(out, "run-final.log")
    with Job(out, ["--steps", "3"], ranks, log) as job:
        assert job.wait(RUN_TIMEOUT) == 0, job.text()[-4000:]
        assert [m for m in job.marks("ready") if m["rank"] == "0"][0]["leftovers"] == "[]"
        assert len(job.marks("finished")) == ranks
    check_invariants(root, ranks)
    assert entries(root)[1] == [], "temporary directories left after a complete run"


def run_parallel(base, chains: dict[str, list[tuple]], tally: Tally, rng=None) -> None:
    """Two chains at a time (the machine has 2 cores; each job uses 1 thread)."""
    stop = threading.Event()
    seeds = {name: rng.random() if rng else 0 for name in chains}  # drawn before threads

    def one(name, plan):
        try:
            run_chain(base, name, plan, tally, rng=random.Random(seeds[name]), stop=stop)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(max_workers=2) as pool:
        for fut in [pool.submit(one, *c) for c in chains.items()]:
            fut.result()


def report(title: str, tally: Tally, seconds: float) -> None:
    print(f"\n{title}: {tally.total} SIGKILLs survived in {seconds:.0f} s (seed {SEED})")
    for label, n in sorted(tally.kills.items()):
        print(f"  {label:32s} {n}")
    for landed, n in sorted(tally.random_landed.items()):
        print(f"    random kills {landed:36s} {n}")
    if tally.hangs:
        print(f"  launchers still running {LAUNCHER_GRACE} s after the kill (group killed): "
              f"{tally.hangs}")
    if tally.truncated_png:
        print(f"  (observed: {len(tally.truncated_png)} truncated <snapshot>.spectra.png beside "
              "snapshots after kills; not part of the snapshot format)")


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_targeted_kills_leave_complete_snapshots(tmp_path):
    """6 kills at the dangerous moments (one process), in 2 chains, then a complete run each."""
    tally, t0 = Tally(), time.monotonic()
    chains = {
        "a": [("target", "rename-after", 3, 0), ("target", "replace-stale", 2, 0),
              ("target", "shard-written", 2, 0)],
        "b": [("target", "shard-partial", 2, 0), ("target", "manifest-partial", 3, 0),
              ("target", "rename-before", 2, 0)],
    }
    run_parallel(str(tmp_path), chains, tally)
    report("targeted kills, 1 process", tally, time.monotonic() - t0)
    assert tally.total == 6


@pytest.mark.slow
def test_kill_campaign_one_process(tmp_path):
    """30 seeded kills: every moment twice (N-th snapshot drawn in 2..4) and 14 at random
    times (7 any time, 7 within a few ms of the start of a snapshot write), shuffled over 2
    chains that each start with a random kill."""
    rng = random.Random(SEED)
    moments = ["shard-start", "shard-partial", "shard-written", "manifest-start",
               "manifest-partial", "rename-before", "rename-after", "replace-stale"]
    targeted = [("target", m, rng.randint(2, 4), 0) for m in moments * 2]
    randoms = [("random", 0, rng.uniform(0.0, 1.5), None) for _ in range(7)] + \
        [("random", 0, rng.uniform(0.0, 0.008), rng.randint(2, 4)) for _ in range(7)]
    plan = targeted + randoms[1:7] + randoms[8:]
    rng.shuffle(plan)
    chains = {"c1": [randoms[0], *plan[:14]], "c2": [randoms[7], *plan[14:]]}
    tally, t0 = Tally(), time.monotonic()
    run_parallel(str(tmp_path), chains, tally, rng)
    report("kill campaign, 1 process", tally, time.monotonic() - t0)
    assert tally.total == 30
    assert all(tally.kills[f"{m} (rank 0)"] == 2 for m in moments)


@pytest.mark.slow
def test_kill_one_rank_of_two(tmp_path):
    """2 processes (accelerate launch, DDP over gloo): one rank is killed (6 targeted kills on
    rank 1 or rank 0, 2 external ones at seeded random times: rank 1 any time, rank 0 within
    a few ms of the start of a write); the shared directory keeps the invariants."""
    rng = random.Random(SEED + 1)
    plan = [("random", 1, rng.uniform(0.0, 1.0), None),
            ("target", "shard-partial", 2, 1), ("target", "shard-written", 3, 1),
            ("target", "shard-start", 2, 0), ("target", "manifest-partial", 3, 0),
            ("target", "rename-before", 2, 0), ("target", "rename-after", 3, 0),
            ("random", 0, rng.uniform(0.0, 0.008), 3)]
    tally, t0 = Tally(), time.monotonic()
    run_chain(str(tmp_path), "ddp", plan, tally, ranks=2, rng=rng)
    report("kills of one rank, 2 processes", tally, time.monotonic() - t0)
    assert tally.total == 8


def test_kill_while_replacing_the_only_snapshot_loses_nothing(tmp_path):
    """A step that already has the only snapshot is written again and the writer is killed
    after moving the old directory aside: both hidden copies are complete, and the next run's
    cleanup puts the newer one back under the final name (regression: the old code deleted the
    old copy first and the cleanup then deleted the new one)."""
    from kfac_stream.snapshot.writer import clean_stale_tmp

    out, root = str(tmp_path / "run"), str(tmp_path / "run" / "kfac")
    with Job(out, ["--steps", "1"], 1, str(tmp_path / "first.log")) as job:
        assert job.proc.wait(timeout=300) == 0
    with Job(out, ["--kill-at", "replace-stale", "--kill-snapshot", "1"], 1,
             str(tmp_path / "second.log")) as job:
        assert job.proc.wait(timeout=300) == -signal.SIGKILL
    finals, tmps = entries(root)
    assert finals == [] and sorted(tmps) == [".step-00000001.tmp-0",
                                             ".step-00000001.tmp-replaced"]
    clean_stale_tmp(root)
    assert entries(root) == (["step-00000001"], [])
    assert Snapshot.latest(root).step == 1

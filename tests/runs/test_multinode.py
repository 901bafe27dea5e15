"""Two simulated nodes on one machine, through the real launcher.

Each "node" is its own ``accelerate launch`` (its own torchrun agent) with
``--num_machines 2 --machine_rank 0|1 --num_processes 2``, one process per node, rendezvous on
loopback at a free port, one shared output directory, DDP over gloo on CPU. Both processes
are node-local rank 0 (``LOCAL_RANK=0``) and global ranks 0 and 1, so anything that confused
the two would write a snapshot twice or not at all.

The chain (``tests/support/dist_job.py``, 4 steps, a snapshot every step, a Trainer checkpoint every
2 steps, snapshots on the training thread so the kill lands at a known step):

1. ``killed``: rank 0 (node 0, the one that verifies shards, writes the manifest and renames)
   SIGKILLs itself right after writing its shard of the step-3 snapshot. Its node's launcher
   fails; the other node's process hits a gloo error in the snapshot protocol, logs it and
   its launcher ends too (if it lingers, the test ends it as SLURM's ``--kill-on-bad-exit``
   would). Left on disk: snapshots 1 and 2, a hidden ``.step-00000003.tmp-*`` directory, no
   ``step-00000003``.
2. ``resumed``: both nodes again, ``resume_from_checkpoint=checkpoint-2``: each rank restores
   its own tracker state from the shared checkpoint, the stale temporary directory is
   removed, snapshots 3 and 4 are written.
3. ``ref``: one plain process over the same global batches (batch 4 = 2 ranks × 2).

``EXACT_TOL`` as in tests/runs/test_distributed.py (fp32 storage, token_fraction 1, ema_decay 1;
DDP's all-reduce order vs one process's sum: measured ≤ 2.5e-7).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors import safe_open
from test_distributed import EXACT_TOL, _free_port, factors, info, rel

from kfac_stream import Snapshot

import repo_paths

pytestmark = pytest.mark.slow

ROOT = str(repo_paths.ROOT)
JOB = str(repo_paths.SUPPORT / "dist_job.py")
ARGS = ["--pad-rows", "2,3", "--steps", "4", "--snapshot-every", "1", "--sync-snapshots"]
NODE_ARGS = [*ARGS, "--save-steps", "2"]
RUN_TIMEOUT = 300  # s per launch (~15-30 s each on 2 loaded cores)
#: After one node's launcher failed, how long the other may take to notice (gloo reports the
#: lost peer at once; torchelastic's exit barrier would wait 300 s) before the test ends it.
GRACE = 60


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", KFAC_TEST_MEDIA="0",  # no spectra PNGs
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def node_command(machine_rank: int, port: int, out: str, extra: list[str]) -> list[str]:
    """The command one node runs (the one docs/multinode.md shows)."""
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", os.path.join(ROOT, "launch", "cpu_ddp.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            JOB, "--out", out, *extra]


def node_local(directory: str, cmd: list[str]) -> list[str]:
    """``cmd`` in a private mount namespace where ``directory`` is an empty tmpfs: that
    machine's own disk, which no other process sees. Afterwards what it holds is listed into
    ``<directory>.node-local-listing`` (beside it, on the shared filesystem)."""
    script = ('mount --make-rprivate / && mkdir -p "$0" && mount -t tmpfs node-local "$0" '
              '&& "$@"; rc=$?; ls -A "$0" > "$0.node-local-listing"; exit $rc')
    return ["unshare", "--mount", "sh", "-c", script, directory, *cmd]


def node_local_unavailable(base: str) -> str | None:
    """Why `node_local` cannot run here (None if it can): it needs ``unshare --mount`` and
    ``mount`` rights (root, or a user namespace)."""
    probe = os.path.join(base, "probe")
    try:
        proc = subprocess.run(node_local(probe, ["true"]), capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --mount failed: {e}"
    if proc.returncode != 0:
        return f"unshare --mount / mount -t tmpfs failed: {proc.stderr.strip()[-300:]}"
    return None


def launch_two_nodes(out: str, tag: str, extra: list[str],
                     node1_local: str | None = None) -> list[int]:
    """Start both nodes, wait; returns their launchers' exit codes ([node 0, node 1]).
    ``node1_local``: a directory that node 1 sees as its own empty disk (`node_local`)."""
    port = _free_port()
    procs, logs = [], []
    for r in (0, 1):
        logs.append(open(os.path.join(out, f"{tag}-node-{r}.log"), "wb"))
        cmd = node_command(r, port, out, extra)
        if r == 1 and node1_local:
            cmd = node_local(node1_local, cmd)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(),
                                      stdout=logs[-1], stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + RUN_TIMEOUT
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE):
            for p in procs:  # the scheduler's job: end the rest of a failed job
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    for f in logs:
        f.close()
    return [p.returncode for p in procs]


def _log(out: str, name: str) -> str:
    with open(os.path.join(out, name), errors="replace") as f:
        return f.read()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = tmp_path_factory.mktemp("multinode")
    out, ref = str(base / "nodes"), str(base / "ref")
    os.makedirs(out)
    os.makedirs(ref)
    t0 = time.monotonic()
    rcs_killed = launch_two_nodes(out, "killed", [*NODE_ARGS, "--kill-in-snapshot", "0:3"])
    root = os.path.join(out, "kfac")
    after_kill = {
        "rcs": rcs_killed,
        "entries": sorted(os.listdir(root)),
        "latest": Snapshot.latest(root).step,
        "loads": {e: Snapshot.load(os.path.join(root, e)).step
                  for e in os.listdir(root) if e.startswith("step-") and not e.endswith(".png")},
    }
    t1 = time.monotonic()
    # the resumed run writes its snapshots with gather_shards, node 1's snapshot directory
    # on a disk of its own (the checkpoints stay shared: each rank restores its state there)
    no_local = node_local_unavailable(str(base))
    rcs_resumed = launch_two_nodes(
        out, "resumed", [*NODE_ARGS, "--resume", os.path.join(out, "checkpoint-2"),
                         "--gather-shards"], node1_local=None if no_local else root)
    t2 = time.monotonic()
    proc = subprocess.run([sys.executable, JOB, "--out", ref, "--batch", "4", *ARGS], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    print(f"\ntwo nodes: killed run {t1 - t0:.0f} s, resumed run {t2 - t1:.0f} s, "
          f"one process {time.monotonic() - t2:.0f} s")
    return {"out": out, "ref": ref, "after_kill": after_kill, "rcs_resumed": rcs_resumed,
            "no_local": no_local}


def test_kill_during_snapshot_leaves_no_corrupt_snapshot(chain):
    out, seen = chain["out"], chain["after_kill"]
    assert "KILL rank 0" in _log(out, "killed-node-0.log")
    assert seen["rcs"][0] != 0  # node 0's launcher reports its killed process
    print(f"after the kill: {seen['entries']} (launchers {seen['rcs']})")
    # the reader's view: the newest complete snapshot is step 2, and every snapshot under a
    # final name loads (sha256 of every shard checked); step 3 exists only as a hidden
    # temporary directory, which Snapshot.latest never reads
    assert seen["latest"] == 2 and seen["loads"] == {"step-00000001": 1, "step-00000002": 2}
    assert "step-00000003" not in seen["entries"]
    assert any(e.startswith(".step-00000003.tmp") for e in seen["entries"])


def test_resumed_two_nodes_equal_one_process(chain):
    out, ref = chain["out"], chain["ref"]
    assert chain["rcs_resumed"] == [0, 0]
    for r in (0, 1):
        assert "restored 8 factors, 2 updates" in _log(out, f"resumed-node-{r}.log")
    got, want = factors(out), factors(ref)
    assert got.keys() == want.keys() and len(want) == 16
    errs = {k: rel(got[k], want[k]) for k in want}
    abs_err = max(float((got[k].double() - want[k].double()).abs().max()) for k in want)
    print(f"two nodes (killed at the step-3 snapshot, resumed from checkpoint-2) vs one "
          f"process: max relative error {max(errs.values()):.2e} (max abs {abs_err:.2e})")
    assert max(errs.values()) <= EXACT_TOL, errs
    root = os.path.join(out, "kfac")
    assert not [e for e in os.listdir(root) if e.startswith(".")]  # the stale tmp is gone
    for step in (1, 2, 3, 4):  # before and after the kill
        two = Snapshot.load(os.path.join(root, f"step-{step:08d}"))
        one = Snapshot.load(os.path.join(ref, "kfac", f"step-{step:08d}"))
        assert two.manifest.world_size == 2 and one.manifest.world_size == 1
        assert two.manifest.counts.tokens_seen == one.manifest.counts.tokens_seen
        worst = max(max(rel(two[n].A, one[n].A), rel(two[n].G, one[n].G))
                    for n in one.layer_names)
        print(f"snapshot of step {step}: max relative error {worst:.2e}")
        assert worst <= EXACT_TOL


def test_each_snapshot_written_once_by_global_rank_zero(chain):
    out = chain["out"]
    ranks = [info(out, r) for r in (0, 1)]
    # two nodes, each with its node-local rank 0: torchrun's LOCAL_RANK and GROUP_RANK
    assert [(r["rank"], r["local_rank"], r["node"]) for r in ranks] == [(0, "0", "0"),
                                                                        (1, "0", "1")]
    written = {}
    for tag in ("killed", "resumed"):
        for node in (0, 1):
            for line in _log(out, f"{tag}-node-{node}.log").splitlines():
                if "kfac_stream: snapshot /" in line:
                    written.setdefault(line.rsplit("/", 1)[1], []).append((tag, node))
    assert written == {"step-00000001": [("killed", 0)], "step-00000002": [("killed", 0)],
                       "step-00000003": [("resumed", 0)], "step-00000004": [("resumed", 0)]}
    for step in (1, 2, 3, 4):
        path = os.path.join(out, "kfac", f"step-{step:08d}")
        assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000-of-00002.safetensors",
                                            "shard-00001-of-00002.safetensors"]


def test_each_node_holds_only_its_ranks_shards(chain):
    """Per node (= per rank here): the factors in its process's store, the tracker state it
    wrote into the shared checkpoint, and the snapshot shard it wrote are exactly the factors
    its rank owns; together they are all 16, each once, about half the bytes each."""
    out = chain["out"]
    ranks = [info(out, r) for r in (0, 1)]
    owner = ranks[0]["owner"]
    assert owner == ranks[1]["owner"] and sorted(set(owner.values())) == [0, 1]
    total = sum(r["stored_bytes"] for r in ranks)
    largest = max(int(t.numel() * t.element_size()) for t in factors(out).values())
    state_dir = os.path.join(out, "checkpoint-4", "kfac_stream")
    snap = os.path.join(out, "kfac", "step-00000004")
    for r, rank in enumerate(ranks):
        mine = sorted(k for k, o in owner.items() if o == r)
        with safe_open(os.path.join(out, f"rank-{r}.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == mine  # the process's store
        with safe_open(os.path.join(state_dir, f"state-rank-{r:05d}-of-00002.safetensors"),
                       framework="pt") as f:
            assert sorted(k.removeprefix("factor.") for k in f.keys()
                          if k.startswith("factor.")) == mine
        with safe_open(os.path.join(snap, f"shard-{r:05d}-of-00002.safetensors"),
                       framework="pt") as f:
            assert sorted(k for k in f.keys() if k.endswith((".A", ".G"))) == mine
        print(f"node {r}: {len(mine)} factors, {rank['stored_bytes']} of {total} bytes")
        assert abs(rank["stored_bytes"] - total / 2) <= largest
    with open(os.path.join(out, "kfac", "step-00000004", "manifest.json")) as f:
        assert json.load(f)["world_size"] == 2


def test_node_local_snapshot_directory_with_gathered_shards(chain):
    """The resumed run: node 1's snapshot directory is a private tmpfs (its own disk) and
    ``gather_shards=True``: rank 0 received rank 1's shard bytes and wrote both shards of
    snapshots 3 and 4 on its own disk (verified against the sender's sha256 by
    Snapshot.load above), and node 1's disk stayed empty."""
    if chain["no_local"]:
        pytest.skip(f"no private mount namespace here to give node 1 a disk of its own: "
                    f"{chain['no_local']}")
    out = chain["out"]
    with open(os.path.join(out, "kfac.node-local-listing")) as f:
        listing = f.read().split()
    print(f"node 1's own snapshot directory after the run: {listing}")
    assert listing == []  # while the shared directory holds steps 1-4: node 1 saw its own
    for step in (3, 4):
        snap = Snapshot.load(os.path.join(out, "kfac", f"step-{step:08d}"))
        assert sorted(v.rank for v in snap.manifest.shards.values()) == [0, 1]


def test_node_local_snapshot_directory_without_gather_fails_clearly(tmp_path):
    """Without ``gather_shards`` a node-local snapshot directory cannot work (rank 0 creates
    the temporary directory on its own disk): every snapshot is abandoned on all ranks with
    an error that says what to set, nothing appears under a final name, training goes on."""
    why = node_local_unavailable(str(tmp_path))
    if why:
        pytest.skip(f"no private mount namespace here to give node 1 a disk of its own: {why}")
    out = str(tmp_path / "nodes")
    os.makedirs(out)
    rcs = launch_two_nodes(out, "local", ["--pad-rows", "2,3", "--steps", "2",
                                          "--snapshot-every", "1", "--sync-snapshots"],
                           node1_local=os.path.join(out, "kfac"))
    assert rcs == [0, 0]
    logs = _log(out, "local-node-0.log") + _log(out, "local-node-1.log")
    for r in (0, 1):
        assert info(out, r)["counters"]["snapshot_failures"] == 2  # steps 1 and 2
    hint = "does not exist on this rank's machine"
    assert logs.count(hint) == 4 and "gather_shards=True" in logs, logs[-3000:]
    assert sorted(os.listdir(os.path.join(out, "kfac"))) == []

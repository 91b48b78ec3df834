#!/usr/bin/env python3
"""A throw-away Slurm on this machine: munged, slurmctld and two emulated nodes.

    python scripts/slurm_cluster.py start   # prints: export SLURM_CONF=/tmp/convergent-slurm/slurm.conf
    python scripts/slurm_cluster.py status  # sinfo
    python scripts/slurm_cluster.py stop    # stops every daemon it started, removes nothing else

It installs nothing (``sudo bash scripts/system-deps.sh`` does, on Debian): it needs
``munged``, ``slurmctld`` and ``slurmd`` on PATH and root (the daemons run as root). It
writes a minimal ``slurm.conf`` (select/cons_tres, proctrack/linuxproc, task/affinity,
jobcomp/filetxt, no slurmdbd) and its own munge key into one directory, starts munged on
a private socket, slurmctld, and one ``slurmd -N nK`` per node on its own port (both nodes
declare this machine's cores), and waits until ``sinfo`` shows every node idle. Each node
also declares ``gpus`` emulated GPUs (``Gres=gpu:2``): gres.conf points them at character
devices made in the fixture's directory (with /dev/null's numbers: Slurm 22.05 drops a GPU
without a device file), so ``--gres=gpu:1`` jobs are scheduled and counted as on a GPU
cluster (``squeue -o %b``) and see ``CUDA_VISIBLE_DEVICES``; there is no GPU. The node
names resolve through lines added once to /etc/hosts (127.0.1.K), which ``stop`` leaves
in place for the next start. Nothing outside 127.0.0.0/8 is used.
The pytest fixture in tests/slurm/conftest.py drives the same class.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path("/tmp/convergent-slurm")
HOSTS_TAG = "# convergent slurm fixture"
DAEMONS = ("munged", "slurmctld", "slurmd")


def unavailable_reason() -> str | None:
    """Why a fixture cannot start here, or None if it can."""
    missing = [d for d in (*DAEMONS, "sinfo", "sbatch", "squeue") if shutil.which(d) is None]
    if missing:
        return (f"Slurm not installed ({', '.join(missing)} not on PATH; "
                "sudo bash scripts/system-deps.sh installs slurm-wlm and munge)")
    if os.geteuid() != 0:
        return "the Slurm fixture starts slurmctld/slurmd/munged and needs root"
    return None


class SlurmFixture:
    """Daemons of a two-node Slurm cluster rooted in ``root`` (see module doc)."""

    def __init__(self, root: Path = DEFAULT_DIR, nodes: tuple[str, ...] = ("n1", "n2"),
                 cpus: int | None = None, memory_mb: int = 4000, port: int = 16817,
                 gpus: int = 2) -> None:
        self.root = Path(root)
        self.nodes = nodes
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.port = port
        self.gpus = gpus  # emulated GPUs (gres/gpu) per node; 0: none
        self.conf = self.root / "slurm.conf"
        self.jobcomp = self.root / "jobcomp.txt"

    # -- configuration ------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm's client commands (sbatch, squeue, ...)."""
        return {"SLURM_CONF": str(self.conf)}

    def node_addr(self, i: int) -> str:
        return f"127.0.1.{i + 1}"

    def write_config(self) -> None:
        r = self.root
        for sub in ("state", "spool", "logs"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (r / "spool" / n).mkdir(exist_ok=True)
        host = socket.gethostname()
        lines = [
            "ClusterName=convergent",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r / 'munge.sock'}",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd'}.%n.pid",
            f"SlurmctldLogFile={r / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'logs'}/slurmd.%n.log",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp}",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            *(["GresTypes=gpu"] if self.gpus else []),
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=60",
            "KillWait=10",
            "MinJobAge=30",
            "JobRequeue=1",
        ]
        for i, n in enumerate(self.nodes):
            lines.append(
                f"NodeName={n} NodeHostname={host} NodeAddr={self.node_addr(i)} "
                f"Port={self.port + 4 + i} CPUs={self.cpus} RealMemory={self.memory_mb} "
                + (f"Gres=gpu:{self.gpus} " if self.gpus else "") + "State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        self.write_gres()

    def write_gres(self) -> None:
        """gres.conf (beside slurm.conf, where slurmd looks): each emulated GPU is a
        character device node made here with /dev/null's numbers (nothing opens it)."""
        gres = self.root / "gres.conf"
        if not self.gpus:
            gres.unlink(missing_ok=True)
            return
        dev = self.root / "dev"
        dev.mkdir(exist_ok=True)
        for k in range(self.gpus):
            node = dev / f"gpu{k}"
            if not node.exists():
                os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        gres.write_text(f"Name=gpu File={dev}/gpu[0-{self.gpus - 1}]\n")

    def add_hosts(self, hosts_file: Path = Path("/etc/hosts")) -> None:
        """Make the node names resolvable (idempotent: one tagged line per missing name)."""
        try:
            text = hosts_file.read_text()
        except OSError:
            text = ""
        known = {w for line in text.splitlines() for w in line.split("#")[0].split()[1:]}
        add = [f"{self.node_addr(i)} {n} {HOSTS_TAG}" for i, n in enumerate(self.nodes)
               if n not in known]
        if add:
            with hosts_file.open("a") as fh:
                if text and not text.endswith("\n"):
                    fh.write("\n")
                fh.write("\n".join(add) + "\n")

    # -- daemons ------------------------------------------------------------------------
    def _run(self, cmd: list[str]) -> None:
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **self.env})
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): "
                               f"{(out.stderr or out.stdout).strip()}")

    def start(self, timeout_s: float = 60.0) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.stop()  # leftovers of an earlier start in this directory
        self.root.mkdir(parents=True, exist_ok=True)
        state = self.root / "state"
        if state.exists():
            shutil.rmtree(state)  # a fresh cluster: job ids and queue from scratch
        self.write_config()
        self.add_hosts()
        key = self.root / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        r = self.root
        self._run(["munged", f"--socket={r / 'munge.sock'}", f"--key-file={key}",
                   f"--log-file={r / 'logs' / 'munged.log'}", f"--pid-file={r / 'munged.pid'}",
                   f"--seed-file={r / 'munged.seed'}", "--force"])
        self._run(["slurmctld", "-f", str(self.conf)])
        for n in self.nodes:
            self._run(["slurmd", "-f", str(self.conf), "-N", n])
        self.wait_idle(timeout_s)

    def sinfo(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                             text=True, env={**os.environ, **self.env}, timeout=30)
        return out.stdout

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.sinfo()
            states = dict(line.split()[:2] for line in text.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s:.0f} s: {text.strip()!r}; "
                           f"logs in {self.root / 'logs'}")

    def _pids(self) -> list[int]:
        pids = []
        for f in [self.root / "munged.pid", self.root / "slurmctld.pid",
                  *[self.root / f"slurmd.{n}.pid" for n in self.nodes]]:
            try:
                pids.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        return pids

    def stop(self, timeout_s: float = 20.0) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (by their pid files)."""
        if self.conf.exists() and (self.root / "slurmctld.pid").exists():
            subprocess.run(["scancel", "--full", "--user=root"], capture_output=True,
                           env={**os.environ, **self.env}, timeout=30)
        order = [*[self.root / f"slurmd.{n}.pid" for n in self.nodes],
                 self.root / "slurmctld.pid", self.root / "munged.pid"]
        for f in order:
            try:
                pid = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            _terminate(pid, timeout_s)
            f.unlink(missing_ok=True)
        for sock in (self.root / "munge.sock", self.root / "munge.sock.lock"):
            sock.unlink(missing_ok=True)

    def running(self) -> bool:
        return any(_alive(p) for p in self._pids())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate(pid: int, timeout_s: float) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        with_reap(pid)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def with_reap(pid: int) -> None:
    """Reap ``pid`` if it is our zombie child (daemons fork away, so usually a no-op)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="config, state and logs")
    ap.add_argument("--cpus", type=int, default=None, help="CPUs per node (default: all)")
    ap.add_argument("--gpus", type=int, default=2, help="emulated GPUs (gres/gpu) per node")
    args = ap.parse_args(argv)
    fx = SlurmFixture(args.dir, cpus=args.cpus, gpus=args.gpus)
    if args.action == "start":
        try:
            fx.start()
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"export SLURM_CONF={fx.conf}")
    elif args.action == "stop":
        fx.stop()
    else:
        if not fx.running():
            print("not running")
            return 1
        print(f"SLURM_CONF={fx.conf}\n{fx.sinfo().rstrip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

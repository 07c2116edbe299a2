"""Lab figures: `gpufleet lab up`, the first `site.yml`, and no-op re-converges, for 1, 3 and 6 hosts, with
the Ansible settings that matter for a no-op run side by side (pipelining, forks, fact caching).

    python bench/lab_bench.py [--hosts 1,3,6] [--variants-at 3] [--skip-variants]

Each size gets its own lab (name ``bench<N>``, state in a temporary directory), which is taken down after.
Prints one table; nothing here is a test. Needs root, podman and the caches `make test` fills.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet_harness.lab import lab as fleetlab
from gpufleet_harness.lab.spec import DEFAULT_HOSTS, HostSpec, LabSpec

REPO = Path(__file__).resolve().parents[1]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)", re.MULTILINE)
EXTRA_HOSTS = (
    # the fabric manager role runs on Debian 12 (its DGX stays there, as the lab's does)
    HostSpec("dgx-a100-b", "dgx-a100", ("nvswitch",), containerd="1.6"),
    HostSpec("pcie-2x-t4-b", "pcie-2x-t4"),
    # Not node-40-gpus or hgx-h100: their fixtures have Secure Boot on, which host prep rightly refuses.
    HostSpec("esxi-vm-2x-v100-b", "esxi-vm-2x-v100", ("esxi_guests",)),
)
# Settings for the no-op re-converge, against the project's defaults (ansible.cfg: pipelining on, forks 10).
VARIANTS = {
    "defaults (pipelining, forks 10)": {},
    "pipelining off": {"ANSIBLE_PIPELINING": "False"},
    "forks 1": {"ANSIBLE_FORKS": "1"},
    "fact cache (jsonfile, smart)": {"ANSIBLE_GATHERING": "smart", "ANSIBLE_CACHE_PLUGIN": "jsonfile"},
}


def hosts_for(count: int) -> tuple[HostSpec, ...]:
    pool = (*DEFAULT_HOSTS, *EXTRA_HOSTS)
    if count > len(pool):
        raise SystemExit(f"at most {len(pool)} hosts")
    return pool[:count]


def converge(spec: LabSpec, env: dict[str, str], log: Path) -> tuple[float, int]:
    started = time.monotonic()
    run = subprocess.run([str(PLAYBOOK), "-i", str(spec.inventory_dir), "site.yml"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    seconds = time.monotonic() - started
    log.write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise SystemExit(f"site.yml failed (rc {run.returncode}), log {log}")
    return seconds, sum(int(m.group(3)) for m in RECAP.finditer(run.stdout))


def measure(count: int, variants: bool, keep_logs: Path) -> list[tuple[str, float, str]]:
    base = Path(tempfile.mkdtemp(prefix=f"gpufleet-bench-lab{count}-"))
    inventory = base / "inventory"
    shutil.copytree(REPO / "inventory/lab/group_vars", inventory / "group_vars")
    spec = LabSpec(name=f"bench{count}", state_dir=base / "state", inventory_dir=inventory,
                   hosts=hosts_for(count))  # fmt: skip
    rows: list[tuple[str, float, str]] = []  # (what, seconds, note)

    def row(what: str, seconds: float, note: str) -> None:
        rows.append((what, seconds, f"{note} (load {os.getloadavg()[0]:.1f})".strip()))

    env = dict(os.environ, ANSIBLE_NOCOLOR="1", PATH=f"{PLAYBOOK.parent}:{os.environ.get('PATH', '')}")
    try:
        started = time.monotonic()
        fleetlab.up(spec, progress=lambda msg: None)
        row("lab up", time.monotonic() - started, "")
        seconds, changed = converge(spec, env, keep_logs / f"lab{count}-first.log")
        row("site.yml, first converge + validation", seconds, f"{changed} changes")
        for name, settings in VARIANTS.items() if variants else list(VARIANTS.items())[:1]:
            cache = base / "facts"
            run_env = dict(env, **settings)
            if "ANSIBLE_CACHE_PLUGIN" in settings:
                run_env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(cache)
                converge(spec, run_env, keep_logs / f"lab{count}-warm-cache.log")  # fills the cache
            seconds, changed = converge(spec, run_env, keep_logs / f"lab{count}-noop-{len(rows)}.log")
            note = f"{changed} changes, {seconds / count:.1f} s/host"
            row(f"no-op re-converge: {name}", seconds, note)
    finally:
        fleetlab.down(spec, progress=lambda msg: None)
        shutil.rmtree(base, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="1,3,6", help="lab sizes, comma-separated")
    parser.add_argument("--skip-variants", action="store_true", help="only the default settings")
    parser.add_argument(
        "--variants-at", default="", metavar="N,...", help="sizes measured with every setting (default: all)"
    )
    args = parser.parse_args()
    variants_at = {int(c) for c in args.variants_at.split(",") if c}
    logs = Path(tempfile.mkdtemp(prefix="gpufleet-bench-lab-logs-"))
    print(f"{'hosts':>5}  {'what':<52} {'seconds':>8}  note", flush=True)
    for count in [int(c) for c in args.hosts.split(",")]:
        variants = not args.skip_variants and (not variants_at or count in variants_at)
        for what, seconds, note in measure(count, variants, logs):
            print(f"{count:>5}  {what:<52} {seconds:>8.1f}  {note}", flush=True)
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

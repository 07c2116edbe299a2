"""End state of nvidia_mig after a real restart of the host: the boot unit re-created the layout the
restart dropped, before the kubelet (stand-in) started, with Debian's real pynvml."""

import json

GI_PER_GPU = 4  # all-balanced on H100 80GB: 2x 1g.10gb, 1x 2g.20gb, 1x 3g.40gb
GPUS = 8


def journal(host, unit):
    """The unit's output in the current boot, one JSON event per line where it logged one."""
    lines = host.check_output(f"journalctl -b -u {unit} -o cat --no-pager").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_debian_pynvml_and_pyyaml_are_installed(host):
    assert host.package("python3-pynvml").is_installed
    assert host.package("python3-yaml").is_installed


def test_boot_unit_is_enabled_and_ran_successfully_this_boot(host):
    unit = host.service("gpufleet-mig")
    assert unit.is_enabled
    show = host.check_output("systemctl show gpufleet-mig -p ActiveState -p SubState -p ExecMainStatus")
    assert set(show.splitlines()) == {"ExecMainStatus=0", "ActiveState=active", "SubState=exited"}


def test_restart_dropped_the_instances_and_the_unit_recreated_them(host):
    dropped = host.check_output("journalctl -b -u gpufleet-sim-driver-load -o cat --no-pager")
    assert f"driver loaded: {GPUS * GI_PER_GPU} GPU instance(s) gone, MIG modes kept" in dropped
    events = journal(host, "gpufleet-mig")
    assert events[-1] == {"event": "applied", "layout": "all-balanced", "changed": True}
    gpus = [e for e in events if e["event"] == "gpu"]
    assert len(gpus) == GPUS
    assert all(e["actions"] == [f"create {GI_PER_GPU} GPU instance(s)"] for e in gpus)
    mig = host.file("/etc/gpufleet-sim/mig").content_string.splitlines()
    assert sum(1 for line in mig if line.startswith("gi ")) == GPUS * GI_PER_GPU
    modes = sorted(line for line in mig if line.startswith("mode "))
    assert modes == sorted(f"mode {i} 1 1" for i in range(GPUS))


def test_kubelet_started_after_the_unit_and_saw_every_mig_device(host):
    after = host.check_output("systemctl show kubelet.service -p After")
    assert "gpufleet-mig.service" in after.split("=", 1)[1].split()
    seen = json.loads(host.file("/var/log/kubelet-standin.json").content_string)
    assert seen["boot"] == host.check_output("cut -d' ' -f22 /proc/1/stat")  # written in this boot
    assert seen["mig_devices"] == GPUS * GI_PER_GPU


def test_applier_run_again_changes_nothing(host):
    out = host.check_output(
        "LD_LIBRARY_PATH=/etc/gpufleet-sim/lib /usr/bin/python3"
        " /usr/local/lib/gpufleet/mig/gpufleet_mig_apply.py"
        " --config /etc/gpufleet/mig/config.yaml --layout-file /etc/gpufleet/mig/layout"
    )
    last = json.loads(out.splitlines()[-1])
    assert last == {"event": "applied", "layout": "all-balanced", "changed": False}

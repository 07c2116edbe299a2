"""Stand-ins for packages from NVIDIA's own repositories, which the build machines cannot reach.

Names, versions and dependency shapes follow NVIDIA's container-toolkit and CUDA repositories; the
programs are small scripts that behave plausibly on a GPU-less host. Debian's own NVIDIA packages
(driver, nvidia-smi, NVML) are real and come from Debian's non-free archive, not from here.
"""

from __future__ import annotations

from gpufleet_harness.testhosts.debs import DebPackage, FileEntry

TOOLKIT_VERSIONS = ("1.17.7-1", "1.17.8-1")
# Fabric manager builds in the fake CUDA repository: one equal to Debian bookworm's 535 driver, one older
# (for version-mismatch tests).
FABRICMANAGER_VERSIONS = ("535.216.03-1", "535.261.03-1")
CUDA_TOOLKIT = {
    "cuda-toolkit-12-2": "12.2.2-1",
    "cuda-nvcc-12-2": "12.2.140-1",
    "cuda-cudart-12-2": "12.2.140-1",
}

_STANDIN = (
    "gpufleet test stand-in: built by gpufleet_harness.testhosts for GPU-less hosts; not NVIDIA's program."
)

# Like NVIDIA's runtime: on `create` of a container whose environment asks for GPUs
# (NVIDIA_VISIBLE_DEVICES `all` or a list of indices, GPU UUIDs or MIG UUIDs), add the driver's userspace and
# device nodes to the OCI spec, then hand the call to runc. A MIG UUID stands for its parent GPU's device
# node, found through NVML as the real toolkit finds it (the MIG capability nodes come from the device
# plugin's Allocate). The "driver" here is the GPU simulator's machine when the host
# has one (GPUFLEET_SIM_ROOT, default /etc/gpufleet-sim): mounted read-only, NVML pointed at it, its
# nvidia-smi at /usr/bin/nvidia-smi and /dev/nvidia* of the visible GPUs. Without a simulated machine (or
# without GPUs asked for) only runc runs.
_RUNTIME_SHIM = f"""#!/usr/bin/python3
# {_STANDIN}
import ctypes, json, os, shutil, sys, time

SIM = os.environ.get("GPUFLEET_SIM_ROOT", "/etc/gpufleet-sim")
LOG = os.environ.get("GPUFLEET_RUNTIME_LOG", "/var/log/nvidia-container-runtime.log")


def log(msg):
    try:
        with open(LOG, "a") as fh:
            fh.write(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + " " + msg + "\\n")
    except OSError:
        pass


def bundle(args):
    for i, arg in enumerate(args):
        if arg.startswith("--bundle="):
            return arg.split("=", 1)[1]
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
    return "." if "create" in args else None


# The parent GPU index of each MIG UUID, through the simulated NVML (nvmlDeviceGetHandleByUUID, then
# nvmlDeviceGetDeviceHandleFromMigDeviceHandle); a UUID NVML does not know is left out.
def mig_parents(uuids):
    os.environ["GPUFLEET_SIM_ROOT"] = SIM
    try:
        nvml = ctypes.CDLL(os.path.join(SIM, "lib", "libnvidia-ml.so.1"))
    except OSError as err:
        log("no NVML for MIG devices: %s" % err)
        return {{}}
    if nvml.nvmlInit_v2() != 0:
        return {{}}
    found = {{}}
    try:
        for uuid in uuids:
            mig, parent, index = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint()
            if (nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(mig)) == 0
                    and nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, ctypes.byref(parent)) == 0
                    and nvml.nvmlDeviceGetIndex(parent, ctypes.byref(index)) == 0):
                found[uuid] = index.value
            else:
                log("MIG device %s: not found" % uuid)
    finally:
        nvml.nvmlShutdown()
    return found


def visible(env, gpus):
    wanted = env.get("NVIDIA_VISIBLE_DEVICES")
    if wanted in (None, "", "none", "void"):
        return []
    if wanted == "all":
        return gpus
    items = [item.strip() for item in wanted.split(",") if item.strip()]
    parents = mig_parents([item for item in items if item.startswith("MIG-")])
    chosen = []
    for item in items:
        for index, gpu in enumerate(gpus):
            if (item in (str(index), gpu.get("uuid")) or parents.get(item) == index) and gpu not in chosen:
                chosen.append(gpu)
    return chosen


def device(path, major, minor):
    node = {{"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 438, "uid": 0, "gid": 0}}
    return node, {{"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}}


def inject(config_path):
    with open(config_path) as fh:
        spec = json.load(fh)
    process = spec.setdefault("process", {{}})
    env = dict(e.split("=", 1) for e in process.get("env", []) if "=" in e)
    try:
        with open(os.path.join(SIM, "machine.json")) as fh:
            machine = json.load(fh)
    except (OSError, ValueError):
        return False
    gpus = visible(env, machine.get("gpus") or [])
    if not gpus:
        return False
    spec.setdefault("mounts", []).extend([
        {{"destination": SIM, "type": "bind", "source": SIM, "options": ["rbind", "ro", "nosuid"]}},
        {{"destination": "/usr/bin/nvidia-smi", "type": "bind",
         "source": os.path.join(SIM, "bin", "nvidia-smi"), "options": ["rbind", "ro"]}},
    ])
    # The simulated driver's workloads (GPU burners register there) are the container's writable channel to
    # the driver, as /dev/nvidia* are to a real one: a writable mount inside the read-only root.
    workloads = os.path.join(SIM, "workloads")
    if os.path.isdir(workloads):
        spec["mounts"].append({{"destination": workloads, "type": "bind", "source": workloads,
                               "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]}})
    process["env"] = [e for e in process.get("env", []) if not e.startswith(("GPUFLEET_SIM_ROOT=",
                      "GPUFLEET_HOST_ROOT=", "LD_LIBRARY_PATH="))] + [
        "GPUFLEET_SIM_ROOT=" + SIM, "GPUFLEET_HOST_ROOT=" + SIM + "/host", "LD_LIBRARY_PATH=" + SIM + "/lib"]
    linux = spec.setdefault("linux", {{}})
    devices = linux.setdefault("devices", [])
    allowed = linux.setdefault("resources", {{}}).setdefault("devices", [])
    nodes = [("/dev/nvidia%d" % g["minor"], 195, g["minor"]) for g in gpus]
    nodes += [("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", 510, 0), ("/dev/nvidia-uvm-tools", 510, 1)]
    for path, major, minor in nodes:
        if os.path.exists(path) and not any(d.get("path") == path for d in devices):
            dev, allow = device(path, major, minor)
            devices.append(dev)
            allowed.append(allow)
    tmp = config_path + ".nvidia"
    with open(tmp, "w") as fh:
        json.dump(spec, fh)
    os.replace(tmp, config_path)
    log("injected %d GPU(s) from %s" % (len(gpus), SIM))
    return True


def main(args):
    log("nvidia-container-runtime " + " ".join(args))
    if "create" in args:
        where = bundle(args)
        if where and os.path.isfile(os.path.join(where, "config.json")):
            inject(os.path.join(where, "config.json"))
    for runc in ("runc", "/usr/sbin/runc", "/usr/bin/runc"):
        path = shutil.which(runc)
        if path:
            os.execv(path, [path] + args)
    sys.stderr.write("nvidia-container-runtime: no runc found\\n")
    return 1


sys.exit(main(sys.argv[1:]))
"""

_CTK = """#!/bin/sh
# {standin}
case "$1" in
  --version|-v) echo "NVIDIA Container Toolkit CLI version {upstream}"; echo "commit: gpufleet-standin"; exit 0 ;;
  runtime) echo "nvidia-ctk runtime: not implemented by the stand-in; gpufleet writes runtime config itself" >&2; exit 2 ;;
  *) echo "nvidia-ctk (stand-in) $*" >&2; exit 2 ;;
esac
"""  # noqa: E501 - script text

_CLI = """#!/bin/sh
# {standin}
case "$1" in
  --version) echo "cli-version: {upstream}"; echo "lib-version: {upstream}"; exit 0 ;;
  info|list) echo "nvidia-container-cli: initialization error: nvml error: driver not loaded" >&2; exit 1 ;;
  *) echo "nvidia-container-cli (stand-in) $*" >&2; exit 1 ;;
esac
"""

_RUNTIME_CONFIG = """# {standin}
disable-require = false

[nvidia-container-cli]
environment = []
ldconfig = "@/sbin/ldconfig"
load-kmods = true

[nvidia-container-runtime]
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]
"""

# The stand-in fabric manager decides like the real one: no NVSwitch -> NV_WARN_NOTHING_TO_DO and exit 1;
# driver not loaded or at another version -> exit 1 naming both versions; otherwise run until stopped.
# A test host "has" NVSwitches when /dev/nvidia-nvswitch* nodes exist or when the GPU simulator's
# machine description (GPUFLEET_SIM_ROOT, default /etc/gpufleet-sim, file machine.json) lists some;
# the driver version comes from /proc/driver/nvidia/version, else from that machine description.
_FABRICMANAGER = """#!/usr/bin/python3
# {standin}
import glob, json, os, re, signal, sys, time

VERSION = "{upstream}"
LOG = os.environ.get("GPUFLEET_FABRICMANAGER_LOG", "/var/log/fabricmanager.log")


def log(msg, err=False):
    line = "[{{}}] [{{}}] {{}}".format(time.strftime("%b %d %Y %H:%M:%S"), "ERROR" if err else "INFO", msg)
    print(line, file=sys.stderr if err else sys.stdout, flush=True)
    try:
        with open(LOG, "a") as fh:
            fh.write(line + "\\n")
    except OSError:
        pass


def machine():
    path = os.path.join(os.environ.get("GPUFLEET_SIM_ROOT", "/etc/gpufleet-sim"), "machine.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {{}}


def driver_version(desc):
    try:
        with open("/proc/driver/nvidia/version") as fh:
            found = re.search(r"Kernel Module\\s+(\\S+)", fh.read())
            if found:
                return found.group(1)
    except OSError:
        pass
    return desc.get("driver_version")


def main(argv):
    if "--version" in argv or "-v" in argv:
        print("Fabric Manager version is : " + VERSION)
        return 0
    desc = machine()
    switches = len(desc.get("nvswitches") or []) + len(glob.glob("/dev/nvidia-nvswitch[0-9]*"))
    log("Fabric Manager version " + VERSION + " is running with the following configuration options")
    if switches == 0:
        log("request to query NVSwitch device information from NVSwitch driver failed with "
            "error:NV_WARN_NOTHING_TO_DO", err=True)
        return 1
    driver = driver_version(desc)
    if not driver:
        log("NVIDIA driver is not loaded: cannot start fabric manager", err=True)
        return 1
    if driver != VERSION:
        log("fabric manager version " + VERSION + " does not match the NVIDIA driver version " + driver
            + ": install the fabric manager build that matches the driver", err=True)
        return 1
    log("Successfully configured all the available NVSwitches ({{}}) for driver {{}}".format(switches, driver))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


sys.exit(main(sys.argv[1:]))
"""  # noqa: E501 - script text

_FABRICMANAGER_UNIT = """# {standin}
[Unit]
Description=NVIDIA fabric manager service

[Service]
User=root
PrivateTmp=false
Type=simple
TimeoutStartSec=240
ExecStart=/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg
LimitCORE=infinity

[Install]
WantedBy=multi-user.target
"""

_FABRICMANAGER_CFG = """# {standin}
LOG_LEVEL=4
LOG_FILE_NAME=/var/log/fabricmanager.log
FABRIC_MODE=0
FABRIC_MODE_RESTART=0
STATE_FILE_NAME=/tmp/fabricmanager.state
FM_CMD_BIND_INTERFACE=127.0.0.1
FM_CMD_PORT_NUMBER=6666
"""

_NVCC = """#!/bin/sh
# {standin}
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release {release}, V{upstream}"
"""


def _fmt(template: str, version: str, **extra: str) -> str:
    return template.format(standin=_STANDIN, upstream=version.split("-")[0], **extra)


def _script(template: str, version: str, **extra: str) -> FileEntry:
    return FileEntry(_fmt(template, version, **extra), mode=0o755)


def container_toolkit_packages(version: str) -> list[DebPackage]:
    """The four packages of one NVIDIA container toolkit release."""
    return [
        DebPackage(
            "libnvidia-container1",
            version,
            "NVIDIA container runtime library (gpufleet stand-in)",
            section="libs",
            files={"/usr/share/doc/libnvidia-container1/README.gpufleet": FileEntry(_STANDIN + "\n")},
        ),
        DebPackage(
            "libnvidia-container-tools",
            version,
            "NVIDIA container runtime library, CLI (gpufleet stand-in)",
            depends=(f"libnvidia-container1 (>= {version})", "libnvidia-container1 (<< 2.0.0)"),
            files={"/usr/bin/nvidia-container-cli": _script(_CLI, version)},
        ),
        DebPackage(
            "nvidia-container-toolkit-base",
            version,
            "NVIDIA Container Toolkit base (gpufleet stand-in)",
            files={
                "/usr/bin/nvidia-container-runtime": FileEntry(_RUNTIME_SHIM, mode=0o755),
                "/usr/bin/nvidia-ctk": _script(_CTK, version),
                "/etc/nvidia-container-runtime/config.toml": FileEntry(
                    _fmt(_RUNTIME_CONFIG, version), conffile=True
                ),
            },
        ),
        DebPackage(
            "nvidia-container-toolkit",
            version,
            "NVIDIA Container Toolkit (gpufleet stand-in)",
            depends=(
                f"nvidia-container-toolkit-base (= {version})",
                f"libnvidia-container-tools (>= {version})",
                "libnvidia-container-tools (<< 2.0.0)",
            ),
            files={
                "/usr/bin/nvidia-container-runtime-hook": FileEntry(
                    f"#!/bin/sh\n# {_STANDIN}\nexit 0\n", mode=0o755
                )
            },
        ),
    ]


def fabricmanager_package(version: str, branch: str = "535") -> DebPackage:
    """NVIDIA fabric manager for one driver release, named per branch as in NVIDIA's CUDA repository."""
    return DebPackage(
        f"nvidia-fabricmanager-{branch}",
        version,
        "Fabric Manager for NVSwitch based systems (gpufleet stand-in)",
        section="multiverse/devel",
        conflicts=("nvidia-fabricmanager",),
        provides=("nvidia-fabricmanager",),
        files={
            "/usr/bin/nv-fabricmanager": _script(_FABRICMANAGER, version),
            "/lib/systemd/system/nvidia-fabricmanager.service": FileEntry(_fmt(_FABRICMANAGER_UNIT, version)),
            "/usr/share/nvidia/nvswitch/fabricmanager.cfg": FileEntry(_fmt(_FABRICMANAGER_CFG, version)),
        },
    )


def cuda_toolkit_packages() -> list[DebPackage]:
    """A CUDA 12.2 toolkit meta package with its compiler and runtime pieces (no driver dependency)."""
    nvcc = CUDA_TOOLKIT["cuda-nvcc-12-2"]
    cudart = CUDA_TOOLKIT["cuda-cudart-12-2"]
    return [
        DebPackage(
            "cuda-nvcc-12-2",
            nvcc,
            "CUDA nvcc (gpufleet stand-in)",
            files={"/usr/local/cuda-12.2/bin/nvcc": _script(_NVCC, nvcc, release="12.2")},
        ),
        DebPackage(
            "cuda-cudart-12-2",
            cudart,
            "CUDA Runtime native Libraries (gpufleet stand-in)",
            files={"/usr/local/cuda-12.2/README.gpufleet": FileEntry(_STANDIN + "\n")},
        ),
        DebPackage(
            "cuda-toolkit-12-2",
            CUDA_TOOLKIT["cuda-toolkit-12-2"],
            "CUDA Toolkit 12.2 meta-package (gpufleet stand-in)",
            depends=(f"cuda-nvcc-12-2 (>= {nvcc})", f"cuda-cudart-12-2 (>= {cudart})"),
        ),
    ]


def cuda_meta_packages() -> list[DebPackage]:
    """The trap: `cuda-12-2` pulls the runtime meta package, which pulls `cuda-drivers` (a newer driver)."""
    return [
        DebPackage(
            "cuda-12-2",
            "12.2.2-1",
            "CUDA 12.2 meta-package (gpufleet stand-in)",
            depends=("cuda-toolkit-12-2 (>= 12.2.2)", "cuda-runtime-12-2 (>= 12.2.2)"),
        ),
        DebPackage(
            "cuda-runtime-12-2",
            "12.2.2-1",
            "CUDA Runtime 12.2 meta-package (gpufleet stand-in)",
            depends=("cuda-drivers (>= 535.104.05)",),
        ),
        DebPackage(
            "cuda-drivers",
            "545.23.08-1",
            "CUDA Driver meta-package (gpufleet stand-in)",
            files={"/usr/share/doc/cuda-drivers/README.gpufleet": FileEntry(_STANDIN + "\n")},
        ),
    ]


def container_toolkit_repo() -> list[DebPackage]:
    """Everything the fake ``libnvidia-container`` repository serves."""
    return [pkg for version in TOOLKIT_VERSIONS for pkg in container_toolkit_packages(version)]


def cuda_repo() -> list[DebPackage]:
    """Everything the fake CUDA repository serves: fabric managers, a CUDA toolkit, CUDA meta packages."""
    return (
        [fabricmanager_package(v) for v in FABRICMANAGER_VERSIONS]
        + cuda_toolkit_packages()
        + cuda_meta_packages()
    )


# NVIDIA's .run installer stand-in: accepts the flags the nvidia_driver role passes, installs the programs
# the role looks for (nvidia-installer --version, nvidia-uninstall, nvidia-smi, nvidia-persistenced) and logs
# its command line to /var/log/nvidia-installer.log. No kernel module: nvidia-smi exits 9 like the real one
# without a loaded driver.
_RUNFILE = """#!/bin/sh
# {standin}
set -e
VERSION={upstream}
LOG=/var/log/nvidia-installer.log
echo "$(date -u +%FT%TZ) NVIDIA-Linux-x86_64-$VERSION.run $*" >> "$LOG"
silent=no
for flag in "$@"; do
  case "$flag" in
    --silent) silent=yes ;;
    --dkms|--no-x-check|--no-nouveau-check|--no-opengl-files|--no-questions|--accept-license) ;;
    *) echo "ERROR: unknown option '$flag'" >&2; exit 1 ;;
  esac
done
[ "$silent" = yes ] || {{ echo "ERROR: the stand-in installer only runs with --silent" >&2; exit 1; }}
mkdir -p /usr/bin
printf '#!/bin/sh\\necho "nvidia-installer:  version %s (gpufleet stand-in)"\\n' "$VERSION" > /usr/bin/nvidia-installer
printf '#!/bin/sh\\necho "NVIDIA-SMI has failed because it couldn'"'"'t communicate with the NVIDIA driver." >&2\\nexit 9\\n' > /usr/bin/nvidia-smi
printf '#!/bin/sh\\necho "nvidia-persistenced failed to initialize. Check syslog for more details." >&2\\nexit 1\\n' > /usr/bin/nvidia-persistenced
cat > /usr/bin/nvidia-uninstall <<EOS
#!/bin/sh
rm -f /usr/bin/nvidia-installer /usr/bin/nvidia-smi /usr/bin/nvidia-persistenced /usr/bin/nvidia-uninstall
echo "\\$(date -u +%FT%TZ) nvidia-uninstall $VERSION \\$*" >> $LOG
EOS
chmod 755 /usr/bin/nvidia-installer /usr/bin/nvidia-smi /usr/bin/nvidia-persistenced /usr/bin/nvidia-uninstall
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: $VERSION) is now complete."
"""  # noqa: E501 - script text

RUNFILE_VERSION = "535.261.03"


def runfile(version: str = RUNFILE_VERSION) -> tuple[str, str]:
    """Path (as NVIDIA's download site lays it out) and text of a stand-in driver runfile."""
    return (f"tesla/{version}/NVIDIA-Linux-x86_64-{version}.run", _fmt(_RUNFILE, version))

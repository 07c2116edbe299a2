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

# Like NVIDIA's nvidia-ctk 1.17: `cdi generate` discovers the GPUs through NVML (the simulator's, at
# GPUFLEET_SIM_ROOT) and writes a CDI specification laid out as nvidia-ctk lays one out (read from NVIDIA's
# documentation and source, v1.17.8: pkg/nvcdi, cmd/nvidia-ctk/cdi/generate; not copied): cdiVersion 0.5.0,
# kind nvidia.com/gpu, one device per GPU under each naming strategy (index and UUID by default) with its
# /dev/nvidiaN, MIG devices as <gpu>:<mig> and MIG-<uuid> with their parent's node and capability nodes,
# `all`, and common edits: NVIDIA_VISIBLE_DEVICES=void, the control device nodes that exist, the "driver"
# mounted read-only, and nvidia-cdi-hook's createContainer hooks. The driver here is the simulator's
# machine: its root (NVML, nvidia-smi) stands for the driver's libraries and binaries. Without NVML it
# fails as nvidia-ctk does. `cdi list` prints the device names of the specs in /etc/cdi and /var/run/cdi.
_CTK = """#!/usr/bin/python3
# {standin}
import ctypes, glob, json, os, re, sys

VERSION = "{upstream}"
SIM = os.environ.get("GPUFLEET_SIM_ROOT", "/etc/gpufleet-sim")
HOOK = "/usr/bin/nvidia-cdi-hook"
MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "bind"]
CONTROL = ["/dev/nvidia-modeset", "/dev/nvidia-uvm-tools", "/dev/nvidia-uvm", "/dev/nvidiactl"]
SPEC_DIRS = ["/etc/cdi", "/var/run/cdi"]
NVML_ERRORS = {{1: "ERROR_UNINITIALIZED", 2: "ERROR_INVALID_ARGUMENT", 3: "ERROR_NOT_SUPPORTED",
               9: "ERROR_DRIVER_NOT_LOADED", 12: "ERROR_LIBRARY_NOT_FOUND", 999: "ERROR_UNKNOWN"}}


def fail(msg):
    sys.stderr.write('level=error msg="' + msg + '"\\n')
    sys.exit(1)


class Nvml:
    def __init__(self):
        os.environ["GPUFLEET_SIM_ROOT"] = SIM
        try:
            self.lib = ctypes.CDLL(os.path.join(SIM, "lib", "libnvidia-ml.so.1"))
        except OSError:
            fail("failed to generate CDI spec: failed to create device CDI specs: failed to initialize NVML: "
                 "ERROR_LIBRARY_NOT_FOUND")
        self.call("nvmlInit_v2")

    def call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            fail("failed to generate CDI spec: " + name + ": " + NVML_ERRORS.get(rc, "ERROR_UNKNOWN"))

    def ok(self, name, *args):
        return getattr(self.lib, name)(*args) == 0

    def text(self, name, handle):
        buf = ctypes.create_string_buffer(96)
        self.call(name, handle, buf, ctypes.c_uint(96))
        return buf.value.decode()

    def uint(self, name, handle):
        value = ctypes.c_uint()
        self.call(name, handle, ctypes.byref(value))
        return value.value


def mig_minors():
    # the driver's table of MIG capability minors: the host's, else the simulated machine's host view
    for path in ("/proc/driver/nvidia-caps/mig-minors", SIM + "/host/proc/driver/nvidia-caps/mig-minors"):
        try:
            with open(path) as fh:
                return dict((l.rsplit(" ", 1)[0], int(l.rsplit(" ", 1)[1])) for l in fh if " " in l.strip())
        except (OSError, ValueError):
            continue
    return {{}}


DEV_ROOT = "/"


def host(path):
    return os.path.join(DEV_ROOT, path.lstrip("/"))


def node(path):
    # as nvidia-ctk: hostPath only where it differs from the container's path (--dev-root)
    found = host(path)
    return {{"path": path}} if found == path else {{"path": path, "hostPath": found}}


def discover(strategies):
    nvml = Nvml()
    count = ctypes.c_uint()
    nvml.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    minors = mig_minors()
    devices, every = [], []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        nvml.call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        uuid, minor = nvml.text("nvmlDeviceGetUUID", handle), nvml.uint("nvmlDeviceGetMinorNumber", handle)
        path = "/dev/nvidia%d" % minor
        if not os.path.exists(host(path)):
            continue
        every.append(node(path))
        for strategy in strategies:
            name = str(index) if strategy == "index" else uuid
            devices.append({{"name": name, "containerEdits": {{"deviceNodes": [node(path)]}}}})
        current, pending = ctypes.c_uint(), ctypes.c_uint()
        if not (nvml.ok("nvmlDeviceGetMigMode", handle, ctypes.byref(current), ctypes.byref(pending))
                and current.value == 1):
            continue
        for slot in range(nvml.uint("nvmlDeviceGetMaxMigDeviceCount", handle)):
            mig = ctypes.c_void_p()
            if not nvml.ok("nvmlDeviceGetMigDeviceHandleByIndex", handle, ctypes.c_uint(slot), ctypes.byref(mig)):
                continue
            gi, ci = nvml.uint("nvmlDeviceGetGpuInstanceId", mig), nvml.uint("nvmlDeviceGetComputeInstanceId", mig)
            nodes = [node(path)]
            for cap in ("gpu%d/gi%d/access" % (minor, gi), "gpu%d/gi%d/ci%d/access" % (minor, gi, ci)):
                if cap in minors:
                    nodes.append(node("/dev/nvidia-caps/nvidia-cap%d" % minors[cap]))
            mig_uuid = nvml.text("nvmlDeviceGetUUID", mig)
            for strategy in strategies:
                name = "%d:%d" % (index, slot) if strategy == "index" else mig_uuid
                devices.append({{"name": name, "containerEdits": {{"deviceNodes": nodes}}}})
    nvml.ok("nvmlShutdown")
    devices.append({{"name": "all", "containerEdits": {{"deviceNodes": every}}}})
    return devices


def hook(*args):
    return {{"hookName": "createContainer", "path": HOOK, "args": ["nvidia-cdi-hook"] + list(args),
            "env": ["NVIDIA_CTK_DEBUG=false"]}}


def spec(vendor, cls, strategies):
    common = {{
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [node(p) for p in CONTROL if os.path.exists(host(p))],
        "hooks": [hook("create-symlinks", "--link", SIM + "/bin/nvidia-smi::/usr/bin/nvidia-smi"),
                  hook("update-ldcache", "--folder", SIM + "/lib")],
        "mounts": [{{"hostPath": SIM, "containerPath": SIM, "options": MOUNT_OPTIONS}},
                   {{"hostPath": SIM + "/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi",
                    "options": MOUNT_OPTIONS}}],
    }}
    return {{"cdiVersion": "0.5.0", "kind": vendor + "/" + cls, "devices": discover(strategies),
            "containerEdits": common}}


# what a YAML reader would not take for a string when plain: numbers (also base 60), booleans, null
NUMERIC = re.compile(r"^[-+]?(\\d[\\d_]*)?(\\.\\d*)?([eE][-+]?\\d+)?$|^[-+]?\\d[\\d_]*(:[0-5]?\\d)+$")
WORDS = ("true", "false", "null", "~", "yes", "no", "on", "off", "y", "n")


def scalar(value):
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if (not text or NUMERIC.match(text) or text.lower() in WORDS or text[0] in "?:,[]{{}}#&*!|>'\\"%@`"
            or text.startswith("- ") or ": " in text or " #" in text or text != text.strip()):
        return json.dumps(text)
    return text


def emit_map(doc, column, base, out, first=""):
    # block YAML as nvidia-ctk writes it (yaml.v3, indent 4): a key's block starts 4 columns in from the
    # enclosing block, and a list item's block from its dash
    for key, item in doc.items():
        lead = (first or " " * column) if key == next(iter(doc)) else " " * column
        if isinstance(item, dict) and item:
            out.append(lead + key + ":")
            emit_map(item, base + 4, base + 4, out)
        elif isinstance(item, list) and item:
            out.append(lead + key + ":")
            emit_seq(item, base + 4, out)
        elif isinstance(item, (dict, list)):
            out.append(lead + key + ": " + ("{{}}" if isinstance(item, dict) else "[]"))
        else:
            out.append(lead + key + ": " + scalar(item))


def emit_seq(items, dash, out):
    for item in items:
        if isinstance(item, dict):
            emit_map(item, dash + 2, dash, out, first=" " * dash + "- ")
        else:
            out.append(" " * dash + "- " + scalar(item))


def option(args, name, default=None):
    values = []
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == name and i + 1 < len(args):
            values.append(args[i + 1])
    return values or ([] if default is None else default)


def generate(args):
    global DEV_ROOT
    DEV_ROOT = (option(args, "--dev-root") or option(args, "--driver-root") or ["/"])[-1]
    output = (option(args, "--output") or [""])[-1]
    fmt = (option(args, "--format") or ["json" if output.endswith(".json") else "yaml"])[-1]
    strategies = option(args, "--device-name-strategy", ["index", "uuid"])
    for strategy in strategies:
        if strategy not in ("index", "uuid"):
            fail("invalid device name strategy: " + strategy)
    doc = spec((option(args, "--vendor") or ["nvidia.com"])[-1], (option(args, "--class") or ["gpu"])[-1], strategies)
    if fmt == "json":
        text = json.dumps(doc) + "\\n"
    else:
        lines = ["---"]
        emit_map(doc, 0, 0, lines)
        text = "\\n".join(lines) + "\\n"
    if not output:
        sys.stdout.write(text)
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, output)
    sys.stderr.write('level=info msg="Generated CDI spec with version 0.5.0"\\n')
    return 0


def list_devices():
    names = []
    for directory in SPEC_DIRS:
        for path in sorted(glob.glob(directory + "/*.yaml") + glob.glob(directory + "/*.json")):
            kind, in_devices = None, False
            with open(path) as fh:
                for line in fh:
                    if line.startswith("kind:"):
                        kind = line.split(":", 1)[1].strip()
                    in_devices = line.startswith("devices:") or (in_devices and line.startswith(" "))
                    found = re.match(r"^    - name: (.*)$", line) if in_devices else None
                    if found and kind:
                        names.append(kind + "=" + json.loads(found.group(1)) if found.group(1).startswith('"')
                                     else kind + "=" + found.group(1))
    sys.stderr.write('level=info msg="Found %d CDI devices"\\n' % len(names))
    for name in names:
        print(name)
    return 0


def main(args):
    if args[:1] in (["--version"], ["-v"]):
        print("NVIDIA Container Toolkit CLI version " + VERSION)
        print("commit: gpufleet-standin")
        return 0
    if args[:2] == ["cdi", "generate"]:
        return generate(args[2:])
    if args[:2] == ["cdi", "list"]:
        return list_devices()
    if args[:1] == ["runtime"]:
        sys.stderr.write("nvidia-ctk runtime: not implemented by the stand-in; gpufleet writes runtime config itself\\n")
        return 2
    sys.stderr.write("nvidia-ctk (stand-in) " + " ".join(args) + "\\n")
    return 2


sys.exit(main(sys.argv[1:]))
"""  # noqa: E501 - script text

# nvidia-cdi-hook (nvidia-container-toolkit-base, 1.17): the hooks the CDI specification names. The stand-in
# records each call (subcommand, arguments, the container's id from the OCI state on stdin) and changes
# nothing: there is no driver library to link or cache.
_CDI_HOOK = """#!/bin/sh
# {standin}
state=$(cat)
echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $* id=$(echo "$state" | sed -n 's/.*"id": *"\\([^"]*\\)".*/\\1/p')" \\
  >> /var/log/nvidia-cdi-hook.log 2>/dev/null
exit 0
"""

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
                "/usr/bin/nvidia-cdi-hook": _script(_CDI_HOOK, version),
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

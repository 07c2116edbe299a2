"""`gpufleet-extender serve | scheduler-config | version` (also `python -m gpufleet.extender`).

`register(subparsers)` contributes the same commands under `gpufleet extender …` when the top-level CLI
lists this module.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from gpufleet import __version__
from gpufleet.extender.schedconfig import API_VERSIONS, SchedulerConfigError, SchedulerConfigOptions, render
from gpufleet.extender.settings import ENV_PREFIX, Settings, SettingsError, load_settings
from gpufleet.logs import log_event, setup_logging


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the scheduler extender HTTP(S) server",
        description=f"Settings come from defaults < --config FILE < {ENV_PREFIX}<NAME> < flags.",
    )
    serve.add_argument("--config", metavar="FILE", help="YAML settings file (version: v1)")
    defaults = Settings()
    for f in fields(Settings):
        serve.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} (default: {getattr(defaults, f.name)!s})",
        )
    serve.set_defaults(func=cmd_serve)


def _add_scheduler_config(sub: Any) -> None:
    gen = sub.add_parser(
        "scheduler-config", help="print a KubeSchedulerConfiguration that uses this extender"
    )
    gen.add_argument(
        "--url", required=True, help="extender URL: scheme://host:port/prefix (becomes urlPrefix)"
    )
    gen.add_argument(
        "--api-version",
        choices=sorted(API_VERSIONS),
        default="v1",
        help="v1 (Kubernetes >= 1.25) or v1beta1 (1.19-1.21)",
    )
    gen.add_argument("--weight", type=int, default=5, help="multiplier for the extender's 0-10 scores")
    gen.add_argument(
        "--no-node-cache",
        dest="node_cache_capable",
        action="store_false",
        help="send full Node objects instead of names",
    )
    gen.add_argument("--ignorable", action="store_true", help="schedule anyway when the extender fails")
    gen.add_argument("--http-timeout", default="10s", help="Go duration per call (default 10s)")
    gen.add_argument("--no-bind", dest="bind", action="store_false", help="leave binding to the scheduler")
    gen.add_argument(
        "--mem-checked-by-scheduler",
        dest="mem_ignored_by_scheduler",
        action="store_false",
        help="let the scheduler also check gpu-mem node totals",
    )
    gen.add_argument(
        "--no-whole-gpus",
        dest="manage_whole_gpus",
        action="store_false",
        help="do not route nvidia.com/gpu pods through the extender",
    )
    gen.add_argument("--ca-file", default="", help="CA that signed the extender's certificate")
    gen.add_argument("--cert-file", default="", help="client certificate for the extender's client CA")
    gen.add_argument("--key-file", default="", help="client key")
    gen.add_argument("--server-name", default="", help="TLS server name to verify")
    gen.add_argument("--insecure", action="store_true", help="skip verifying the extender's certificate")
    gen.add_argument("--kubeconfig", default="", help="clientConnection.kubeconfig")
    gen.add_argument(
        "--leader-elect", dest="leader_elect", action=argparse.BooleanOptionalAction, default=None
    )
    gen.add_argument("--scheduler-name", default="", help="add a profile with this schedulerName")
    gen.add_argument("--healthz-bind-address", default="", help="v1beta1 only, e.g. 127.0.0.1:10251")
    gen.add_argument("--metrics-bind-address", default="", help="v1beta1 only")
    gen.add_argument("-o", "--output", default="-", help="file to write (default stdout)")
    gen.set_defaults(func=cmd_scheduler_config)


def register(subparsers: Any) -> None:
    """Add `extender serve|scheduler-config|version` to the top-level `gpufleet` CLI."""
    parser = subparsers.add_parser("extender", help="the GPU scheduler extender")
    sub = parser.add_subparsers(dest="extender_command", metavar="COMMAND")
    _add_serve(sub)
    _add_scheduler_config(sub)
    sub.add_parser("version", help="print the version").set_defaults(func=cmd_version)


def build_parser() -> argparse.ArgumentParser:
    """The standalone `gpufleet-extender` parser."""
    parser = argparse.ArgumentParser(prog="gpufleet-extender", description="gpufleet GPU scheduler extender")
    parser.add_argument("--version", action="version", version=f"gpufleet-extender {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_scheduler_config(sub)
    sub.add_parser("version", help="print the version").set_defaults(func=cmd_version)
    return parser


def cmd_version(args: argparse.Namespace) -> int:
    """Print the version."""
    print(f"gpufleet-extender {__version__}")
    return 0


def cmd_scheduler_config(args: argparse.Namespace) -> int:
    """Write the scheduler configuration."""
    names = {f.name for f in fields(SchedulerConfigOptions)}
    opts = SchedulerConfigOptions(**{k: v for k, v in vars(args).items() if k in names})
    try:
        text = render(opts)
    except SchedulerConfigError as exc:
        print(f"gpufleet-extender: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT."""
    from gpufleet.extender.kube import KubeCluster
    from gpufleet.extender.server import make_server
    from gpufleet.extender.service import Extender

    flags = {f.name: getattr(args, f.name, None) for f in fields(Settings)}
    try:
        settings = load_settings(args.config, flags=flags)
    except SettingsError as exc:
        print(f"gpufleet-extender: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        cluster = KubeCluster.from_config(settings.kubeconfig, settings.api_timeout)
    except Exception as exc:
        print(f"gpufleet-extender: cannot configure the Kubernetes client: {exc}", file=sys.stderr)
        return 2
    extender = Extender(settings, cluster)
    try:
        server = make_server(extender, settings)
    except (OSError, ValueError) as exc:
        print(
            f"gpufleet-extender: cannot listen on {settings.listen_address}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        return 2
    # No automatic collection while the first lists arrive: they allocate hundreds of thousands of objects,
    # which would set off repeated full collections over a growing heap (about a second of CPU at 5,000
    # nodes). The cache holds no cycles: one collection now, while the heap holds little more than the
    # imports, and once synced the freeze (no collection then, see `freeze_heap`) and collection as usual.
    gc.collect()
    gc.disable()
    extender.start()

    def freeze_when_synced() -> None:
        # Collection resumes after two minutes without a sync all the same (a retrying watch makes cycles).
        synced = extender.wait_synced(timeout=120)
        if synced:
            extender.freeze_heap(collect=False)
        gc.enable()
        if not synced and extender.wait_synced(timeout=3600):
            synced = True
            extender.freeze_heap()
        if synced:
            log_event("synced", totals=extender.state.totals())

    threading.Thread(target=freeze_when_synced, name="extender-freeze", daemon=True).start()

    def stop(signum: int, _frame: Any) -> None:
        log_event("stopping", signal=signal.Signals(signum).name)
        # shutdown() waits for serve_forever to return, so it cannot run on the serving thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log_event(
        "serving",
        url=server.url,
        settings=json.dumps({f.name: str(getattr(settings, f.name)) for f in fields(Settings)}),
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
        extender.stop()
        log_event("stopped", logging.INFO)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gpufleet-extender` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)

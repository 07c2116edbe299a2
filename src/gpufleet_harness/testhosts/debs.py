"""Build small binary .deb packages with dpkg-deb from a Python description."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class FileEntry:
    """One file a package installs: its text and mode; ``conffile`` marks files under /etc."""

    text: str
    mode: int = 0o644
    conffile: bool = False


@dataclass(frozen=True)
class DebPackage:
    """A binary package: control fields, files and maintainer scripts."""

    name: str
    version: str
    description: str
    depends: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    section: str = "utils"
    architecture: str = "amd64"
    files: dict[str, FileEntry] = field(default_factory=dict)
    scripts: dict[str, str] = field(default_factory=dict)  # postinst, prerm, postrm ...

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_{self.architecture}.deb"

    def control(self) -> str:
        lines = [
            f"Package: {self.name}",
            f"Version: {self.version}",
            f"Architecture: {self.architecture}",
            "Maintainer: gpufleet test fixtures <fixtures@gpufleet.invalid>",
            f"Section: {self.section}",
            "Priority: optional",
        ]
        for key, values in (
            ("Depends", self.depends),
            ("Conflicts", self.conflicts),
            ("Provides", self.provides),
        ):
            if values:
                lines.append(f"{key}: {', '.join(values)}")
        summary, _, body = self.description.partition("\n")
        lines.append(f"Description: {summary}")
        lines.extend(f" {line}" if line.strip() else " ." for line in body.strip().splitlines())
        return "\n".join(lines) + "\n"


def build_deb(package: DebPackage, out_dir: Path) -> Path:
    """Build ``package`` into ``out_dir`` and return the .deb path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        debian = root / "DEBIAN"
        debian.mkdir()
        (debian / "control").write_text(package.control())
        conffiles = [path for path, entry in package.files.items() if entry.conffile]
        if conffiles:
            (debian / "conffiles").write_text("".join(f"{p}\n" for p in conffiles))
        for name, text in package.scripts.items():
            script = debian / name
            script.write_text(text)
            script.chmod(0o755)
        for path, entry in package.files.items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(entry.text)
            target.chmod(entry.mode)
        for directory in [root, *root.rglob("*")]:
            if directory.is_dir() and directory.name != "DEBIAN":
                directory.chmod(0o755)
        output = out_dir / package.filename
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(output)],
            check=True,
            capture_output=True,
            text=True,
        )
    return output

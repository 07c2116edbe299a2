# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Writing a file so that no reader ever sees half of it: the one atomic write of gpufleet.

Shared with the collection: plugins/module_utils/files.py is a link to this file (standard library only,
no imports of gpufleet), so Ansible modules ship it to the hosts they run on.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def atomic_write(
    path: str | os.PathLike[str],
    data: str | bytes,
    mode: int = 0o644,
    move: Callable[[str, str], object] = os.replace,
) -> None:
    """Write ``data`` (text or bytes) to ``path``: a temporary file in the same directory, ``mode`` set, then
    ``move(tmp, path)``, an atomic rename (modules pass ``AnsibleModule.atomic_move``, which also keeps
    the SELinux context). Missing directories are created (0755); the temporary file never outlives a
    failure."""
    directory = os.path.dirname(os.fspath(path)) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, 0o755)
    fd, tmp = tempfile.mkstemp(prefix=".gpufleet-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        move(tmp, os.fspath(path))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

"""Getting a working Horovod into an environment: the patched 0.28.1 built for its torch.

launch/install.sh (a fresh .venv), the Dockerfile and `hvd-cpu install-horovod` (an
environment of the user's own) all go through `install`; `hvd-cpu doctor` reads
`installed_record` to say whether the Horovod there is this build, for this torch.
"""

from hvd_cpu.horovod_build.build import (
    HOROVOD_VERSION,
    default_cache,
    install,
    installed_record,
    plan,
)
from hvd_cpu.horovod_build.toolchain import InstallError

__all__ = [
    "HOROVOD_VERSION",
    "InstallError",
    "default_cache",
    "install",
    "installed_record",
    "plan",
]

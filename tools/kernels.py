"""A Jupyter kernel manager that talks to its kernel over Unix sockets (IPC) instead of TCP.

The course's build runs every notebook in a fresh kernel (papermill). Over TCP each kernel opens five
ports on 127.0.0.1 and ipykernel warns that the channel is not encrypted; over IPC the channels are
socket files in the kernel's runtime folder, readable by this user only, and there is no warning.
"""

from __future__ import annotations

from jupyter_client.manager import KernelManager
from traitlets import CaselessStrEnum


class IPCKernelManager(KernelManager):
    """``KernelManager`` with ``transport="ipc"`` by default."""

    transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

"""Where the operator reaches one serving pod: its IP on the serving port."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class PodEndpoint:
    pod: str  # the Pod's name: the key of its window, its metric series and its status entry
    ip: str
    port: int  # the serving container's port

    def __post_init__(self) -> None:
        if not self.pod:
            raise ValueError("pod: must be a Pod name, not empty")
        try:
            ipaddress.ip_address(self.ip)
        except ValueError:
            raise ValueError(f"ip: {self.ip!r} is not an IP address") from None
        if not 0 < self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")

    def url(self, path: str) -> str:
        host = f"[{self.ip}]" if ipaddress.ip_address(self.ip).version == 6 else self.ip
        return f"http://{host}:{self.port}{path}"

"""Two hosts as network namespaces, joined by a veth pair shaped with `tc tbf`.

Layout (all addresses live only inside namespaces this module creates):

    root ns --mgmt veth-- host A ==== data veth (tbf RATE) ==== host B --mgmt veth-- root ns

The data link carries kv_share and peer traffic; the management links let the
driver in the root namespace reach each host's API. netem is not in this
kernel, so there is no latency or loss emulation: only the rate is shaped.
Everything is torn down on exit, on error and on Ctrl-C; only names carrying
this lab's unique tag are ever touched.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from dataclasses import dataclass, field

LINK_MBIT = {"1gbit": 1000.0, "10gbit": 10000.0}


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf rate and a burst worth 1 ms at that rate (never below 128 KiB: GSO segments are up to 64 KiB).
    A switch port never sends above line rate: a larger bucket let a 2.4 MB delta through a 2 Gb/s link
    in under a millisecond after idle, so transfers looked faster than the link. With 1 ms, a 60 MB
    stream still gets 97% of the rate (measured)."""
    burst = max(128 << 10, int(rate_mbit * 1e6 / 8 / 1000))
    return ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "20ms"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def can_use_netns() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root (run as root; unprivileged `unshare -Urn` is not wired in)"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
        subprocess.run(["tc", "-V"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return False, f"iproute2 (ip, tc) is not usable: {e}"
    return True, ""


@dataclass
class Host:
    name: str
    ns: str
    data_ip: str
    mgmt_ip: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


@dataclass
class TwoHostLab:
    rate: str  # "1gbit" | "10gbit" | "none"
    scale: float = 1.0  # the shaped rate is LINK_MBIT[rate] * scale
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: list[Host] = field(default_factory=list)
    _made_ns: list[str] = field(default_factory=list)
    _made_links: list[str] = field(default_factory=list)

    def __enter__(self) -> TwoHostLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        t = self.tag
        a, b = Host("host-a", f"kvm{t}a", "10.77.0.1", "10.78.1.2"), Host("host-b", f"kvm{t}b", "10.77.0.2", "10.78.2.2")
        for h in (a, b):
            _ip("netns", "add", h.ns)
            self._made_ns.append(h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
        # data link A <-> B
        _ip("link", "add", f"kd{t}a", "netns", a.ns, "type", "veth", "peer", "name", f"kd{t}b", "netns", b.ns)
        for h, dev in ((a, f"kd{t}a"), (b, f"kd{t}b")):
            _ip("-n", h.ns, "addr", "add", f"{h.data_ip}/30", "dev", dev)
            _ip("-n", h.ns, "link", "set", dev, "up")
            if self.rate in LINK_MBIT:
                subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                *tbf_args(self.rate_mbit)], check=True, capture_output=True)
        # management links root <-> each host
        for i, h in enumerate((a, b), start=1):
            root_dev, ns_dev = f"km{t}{i}", f"km{t}{i}n"
            _ip("link", "add", root_dev, "type", "veth", "peer", "name", ns_dev, "netns", h.ns)
            self._made_links.append(root_dev)
            _ip("addr", "add", f"10.78.{i}.1/30", "dev", root_dev)
            _ip("link", "set", root_dev, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.mgmt_ip}/30", "dev", ns_dev)
            _ip("-n", h.ns, "link", "set", ns_dev, "up")
        self.hosts = [a, b]

    @property
    def rate_mbit(self) -> float:
        return LINK_MBIT.get(self.rate, 0.0) * self.scale

    def data_dev(self, host: Host) -> str:
        return f"kd{self.tag}{'a' if host is self.hosts[0] else 'b'}"

    def qdisc_sent(self) -> dict[str, tuple[int, int]]:
        """Host name -> (bytes, packets) its data-link tbf has sent, as `tc -s qdisc` counts them
        (GSO super-packets count as the frames they become, each with its own headers)."""
        out = {}
        for h in self.hosts:
            text = subprocess.run(["ip", "netns", "exec", h.ns, "tc", "-s", "qdisc", "show", "dev", self.data_dev(h)],
                                  capture_output=True, text=True).stdout
            m = re.search(r"Sent (\d+) bytes (\d+) pkt", text)
            out[h.name] = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        return out

    def describe(self) -> str:
        """What the data link is, in words."""
        if self.rate not in LINK_MBIT:
            return "veth, unshaped"
        args = tbf_args(self.rate_mbit)
        burst = int(args[3])
        queue = int(self.rate_mbit * 1e6 / 8 * 0.020) + burst
        return (f"veth shaped by tc tbf to {self.rate_mbit:g} Mb/s each way ({self.rate} x {self.scale:g}), burst "
                f"{burst >> 10} KiB, queue up to {queue >> 10} KiB (20 ms at line rate, a switch port's buffer); no delay or loss")

    def close(self) -> None:
        for dev in self._made_links:
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
        for ns in self._made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made_links.clear()
        self._made_ns.clear()

    def namespaces(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(f"kvm{self.tag}")]

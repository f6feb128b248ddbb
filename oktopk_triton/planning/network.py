"""Networks the cost model prices: per-GPU bandwidth and per-message latency, the presets
and the ``BANDWIDTH,LATENCY`` spec the command line reads (:func:`parse_net`)."""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Network:
    """Per-GPU bandwidth (bytes/s, each direction) and per-message latency (s)."""
    bandwidth: float
    latency: float
    name: str = ""

    def describe(self) -> str:
        return (f"{self.name + ': ' if self.name else ''}{self.bandwidth * 8 / 1e9:g} Gb/s "
                f"({self.bandwidth / 1e9:.3g} GB/s) per GPU, {self.latency * 1e6:g} us per message")


# name -> (spec, what it stands for). Latencies: per message as NCCL sees it, software included.
NET_PRESETS = {
    "10Gbps": ("10Gbps,50us", "10 GbE, TCP sockets"),
    "25Gbps": ("25Gbps,25us", "25 GbE, TCP sockets"),
    "100Gbps": ("100Gbps,5us", "100 Gb/s InfiniBand EDR / RoCE, GPUDirect RDMA"),
    "400Gbps": ("400Gbps,3us", "400 Gb/s InfiniBand NDR, GPUDirect RDMA"),
}
_BW_UNITS = {"gbps": 1e9 / 8, "gb/s": 1e9, "mbps": 1e6 / 8, "mb/s": 1e6, "tbps": 1e12 / 8,
             "tb/s": 1e12, "kb/s": 1e3, "b/s": 1.0}
_LAT_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_net(text: str) -> Network:
    """``100Gbps,5us`` | ``3GB/s,50us`` | a preset name (``10Gbps`` ... ``400Gbps``).

    ``Gbps``/``Mbps``/``Tbps`` are bits per second, ``GB/s``/``MB/s`` bytes per second (case
    sensitive on the b/B: ``Gb/s`` is read as bits, like ``Gbps``)."""
    t = text.strip()
    if t in NET_PRESETS:
        return dataclasses.replace(parse_net(NET_PRESETS[t][0]), name=t)
    parts = [p.strip() for p in t.split(",")]
    if len(parts) != 2:
        raise ValueError(f"network {text!r}: expected BANDWIDTH,LATENCY (e.g. 100Gbps,5us) or one "
                         f"of {sorted(NET_PRESETS)}")
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)", parts[0])
    if not m:
        raise ValueError(f"network {text!r}: bad bandwidth {parts[0]!r}")
    unit = m.group(2)
    key = unit.lower()
    if key.endswith("/s") and unit[-3] == "b":       # Gb/s: bits
        key = key[:-2] + "ps"
    if key not in _BW_UNITS:
        raise ValueError(f"network {text!r}: unknown bandwidth unit {unit!r} (Gbps, Mbps, Tbps, "
                         "GB/s, MB/s)")
    bw = float(m.group(1)) * _BW_UNITS[key]
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([a-zµ]+)", parts[1].lower())
    if not m or m.group(2) not in _LAT_UNITS:
        raise ValueError(f"network {text!r}: bad latency {parts[1]!r} (e.g. 5us, 0.05ms)")
    lat = float(m.group(1)) * _LAT_UNITS[m.group(2)]
    if bw <= 0 or lat < 0:
        raise ValueError(f"network {text!r}: bandwidth must be > 0 and latency >= 0")
    return Network(bw, lat, t)

"""Peak meters for host memory, over ``gym_lightning.metrics.memory`` (the package's own readings of the resident
set and its lifetime peak): a sampling thread for the peak inside a region, and the fields of /proc/self/status that
split the resident set (``RssAnon``: private memory; ``RssFile``: mapped file pages, such as a checkpoint read back).

The resident set moves faster than any sampling: a peak from a thread is a lower bound, exact only when the
process's lifetime peak (``peak_rss``, ``getrusage``) grew inside the region, which ``PeakSampler.peak_bytes`` checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from gym_lightning.metrics.memory import host_rss_bytes, peak_host_rss_bytes

RSS = "rss"  # the resident set as gym_lightning reads it (psutil: VmRSS)


def rss() -> int:
    """This process's resident set now (bytes)."""
    return host_rss_bytes()


def peak_rss() -> int:
    """This process's largest resident set so far (bytes; ``getrusage``); 0 where the platform has none."""
    return peak_host_rss_bytes() or 0


def status_bytes(*fields: str) -> dict[str, int]:
    """``fields`` of /proc/self/status (``RssAnon``, ``RssFile``, ``VmRSS``...) in bytes; ``rss`` is ``rss()``."""
    values = {RSS: rss()} if RSS in fields else {}
    wanted = set(fields) - {RSS}
    if wanted:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in wanted:
                values[key] = int(value.split()[0]) * 1024
    return values


class PeakSampler:
    """The peak of each of ``fields`` (``status_bytes``) while running, read by a thread every ``interval`` s.

    ``with PeakSampler() as meter: ...`` measures a region; ``start()`` once and ``restart()`` at each phase measures
    phases one after the other (the peak counts from the restart). ``peak`` and ``base`` hold bytes per field;
    ``observer``, if given, sees every sample's readings (on the sampling thread: a diagnostic that looks at what is
    resident at a peak).
    """

    def __init__(
        self,
        fields: tuple[str, ...] = (RSS,),
        interval: float = 0.002,
        observer: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.fields, self.interval, self.observer = fields, interval, observer
        self.base = status_bytes(*fields)
        self.peak = dict(self.base)
        self._lifetime_peak = peak_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        readings = status_bytes(*self.fields)
        if self.observer is not None:
            self.observer(readings)
        for key, value in readings.items():
            self.peak[key] = max(self.peak[key], value)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def restart(self) -> None:
        """A new region from now: ``base`` and ``peak`` are the readings now."""
        self.base = status_bytes(*self.fields)
        self.peak = dict(self.base)
        self._lifetime_peak = peak_rss()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peak_bytes(self) -> int:
        """The resident set's peak in the region: the sampled one, or the process's lifetime peak where that grew
        in the region (then it was reached there, and is exact)."""
        self._sample()
        peak = self.peak.get(RSS, rss())
        lifetime = peak_rss()
        return max(peak, lifetime) if lifetime > self._lifetime_peak else peak

    def above_base(self) -> dict[str, int]:
        """Each field's peak above its reading at the start of the region (bytes)."""
        return {key: self.peak[key] - self.base[key] for key in self.peak}

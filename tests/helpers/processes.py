"""Processes read from /proc: what a pool's workers left behind."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids(cmdline_marker: bytes) -> set[int]:
    """Live children of this process whose command line contains `cmdline_marker`."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and cmdline_marker in cmdline:
            pids.add(int(entry.name))
    return pids


def marked_pids(marker: str) -> set[int]:
    """Live processes named `marker` or whose command line holds it: the processes a test's
    sandboxed code started (a sandbox sees them under other pids), found by the test's own
    unique marker."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            comm = (entry / "comm").read_text().strip()
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (comm == marker or marker.encode() in cmdline):
            pids.add(int(entry.name))
    return pids

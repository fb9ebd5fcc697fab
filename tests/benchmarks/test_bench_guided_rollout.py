"""The guided-rollout benchmark's pure helpers: the --logprobs list and the peak-RSS readings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

B = load("bench_guided_rollout")


def test_logprobs_list_full_and_caps():
    assert B.parse_logprobs("20", 100) == [20]
    assert B.parse_logprobs("20,256,full", 49152) == [20, 256, 49152]
    assert B.parse_logprobs(" 20 , FULL ", 49152) == [20, 49152]
    # above the vocabulary is the vocabulary, as the rollout caps it; kept once
    assert B.parse_logprobs("full,200,20", 100) == [100, 20]
    for bad in ("0", "-3", "twenty"):
        with pytest.raises(ValueError):
            B.parse_logprobs(bad, 100)


def test_logprobs_tag():
    assert B.logprobs_tag(20, 49152) == "K=20"
    assert B.logprobs_tag(49152, 49152) == "K=V (49152)"


def test_peak_rss_readings():
    now = B.rss_kb()  # Linux, as on every machine the project runs on
    assert now["VmHWM"] >= now["VmRSS"] > 0
    block = bytearray(256 * 2**20)  # a 256 MiB peak, touched, then freed
    block[::4096] = b"x" * len(block[::4096])
    del block
    peak = B.rss_kb()["VmHWM"]
    assert peak >= now["VmRSS"] + 200 * 1024
    if B.peak_rss_reset():  # the high-water mark drops back to about the resident size
        assert B.rss_kb()["VmHWM"] < peak - 200 * 1024
    assert B.rss_kb(pid=2**31 - 1) == {} and B.peak_rss_reset(pid=2**31 - 1) is False

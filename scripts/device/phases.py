"""Medians of a training log's per-step host times (the `*_ms=` fields of
`KAKEYA_LOG=kakeya_train=debug`), after the first ten steps: python3 phases.py LOG"""
import re
import statistics
import sys

rows = {}
for line in open(sys.argv[1], errors='replace'):
    for k, v in re.findall(r'(\w+_ms)=([0-9.]+)', re.sub(r'\x1b\[[0-9;]*m', '', line)):
        rows.setdefault(k, []).append(float(v))
print('   median host ms:', {k: round(statistics.median(v[10:] or v), 2) for k, v in rows.items()})

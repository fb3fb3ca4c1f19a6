#!/usr/bin/env python3
"""Opens a `kakeya capture` dataset with pyarrow and checks it against its manifest.

    python3 scripts/check_capture.py data/capture-smoke-270m

Checks: every listed shard opens; its schema is seq/pos/token (uint32), in_prompt (bool), then one
fixed_size_list<halffloat|float> column per manifest column with the manifest's width; one row
group per sequence; row counts match the manifest. Prints the schema of the first shard.
"""
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    root = Path(sys.argv[1])
    m = json.loads((root / "manifest.json").read_text())
    elem = pa.float16() if m["dtype"] == "f16" else pa.float32()
    want = [("seq", pa.uint32()), ("pos", pa.uint32()), ("token", pa.uint32()), ("in_prompt", pa.bool_())]
    want += [(c["name"], pa.list_(pa.field("item", elem, nullable=False), c["dim"])) for c in m["columns"]]
    for i, s in enumerate(m["shards"]):
        f = pq.ParquetFile(root / s["file"])
        schema = f.schema_arrow
        got = [(fld.name, fld.type) for fld in schema]
        assert [n for n, _ in got] == [n for n, _ in want], (s["file"], got[:6])
        for (n, t), (_, w) in zip(got, want):
            assert t == w, f"{s['file']}: column {n} is {t}, manifest says {w}"
        assert f.metadata.num_row_groups == len(s["sequences"]), s["file"]
        assert f.metadata.num_rows == s["rows"], s["file"]
        table = f.read_row_group(0, columns=["seq", "pos", "token"])
        assert table.column("seq")[0].as_py() == s["sequences"][0]
        if i == 0:
            print(schema)
    print(f"ok: {len(m['shards'])} shard(s), {sum(s['rows'] for s in m['shards'])} rows, {len(m['columns'])} vector columns")


if __name__ == "__main__":
    main()

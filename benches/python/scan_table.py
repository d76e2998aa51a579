#!/usr/bin/env python3
"""Times full scans of an Iceberg table, for the upkeep bench (`upkeep`,
part 2): every row of every column read into memory, RUNS times, by
pyiceberg (`table.scan().to_arrow()`) and, when the `duckdb` module is
installed and its `iceberg` extension loads, by DuckDB
(`SELECT * FROM iceberg_scan(<metadata file>)` fetched as Arrow).

    target/pyiceberg-venv/bin/python benches/python/scan_table.py \
        CATALOG_NAME SQLITE_URI WAREHOUSE NAMESPACE.TABLE RUNS

SQLITE_URI is SQLAlchemy's (`sqlite:////abs/path/catalog.db`). Each timed
run starts from loading the table through the catalog, as a new reader
would: planning (metadata, manifest list, manifests) is part of the time.
Prints one JSON object on stdout:

    {"rows": N, "pyiceberg": [secs, ...],
     "duckdb": [secs, ...] or null, "duckdb_skipped": reason or null}
"""

import json
import sys
import time

from pyiceberg.catalog.sql import SqlCatalog


def duckdb_scans(metadata_location: str, runs: int, rows: int):
    """DuckDB's times, or (None, why not)."""
    try:
        import duckdb  # noqa: PLC0415 (optional)
    except ImportError:
        return None, "the duckdb module is not installed"
    con = duckdb.connect()
    try:
        con.execute("INSTALL iceberg")
        con.execute("LOAD iceberg")
    except Exception as e:  # noqa: BLE001 (any failure means: no DuckDB figure)
        return None, f"the iceberg extension did not load: {str(e).splitlines()[0]}"
    location = metadata_location.removeprefix("file://")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        data = con.execute(f"SELECT * FROM iceberg_scan('{location}')").fetch_arrow_table()
        times.append(time.perf_counter() - start)
        if data.num_rows != rows:
            return None, f"DuckDB read {data.num_rows} rows, pyiceberg {rows}"
        del data
    return times, None


def main() -> None:
    name, uri, warehouse, table_name, runs = sys.argv[1:6]
    runs = int(runs)
    catalog = SqlCatalog(name, uri=uri, warehouse=warehouse)
    times = []
    rows = None
    metadata_location = None
    for _ in range(runs):
        start = time.perf_counter()
        table = catalog.load_table(table_name)
        data = table.scan().to_arrow()
        times.append(time.perf_counter() - start)
        rows = data.num_rows
        metadata_location = table.metadata_location
        del data
    duck, skipped = duckdb_scans(metadata_location, runs, rows)
    print(json.dumps({"rows": rows, "pyiceberg": times, "duckdb": duck, "duckdb_skipped": skipped}))


if __name__ == "__main__":
    main()

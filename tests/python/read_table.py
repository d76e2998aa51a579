"""Reads an Iceberg table with pyiceberg, independently of tinyflow's Rust
code, and prints what the tests check as one JSON object:

    python read_table.py CATALOG_NAME URI WAREHOUSE NAMESPACE.TABLE [ID_COLUMN [SUM_COLUMN]]

URI is the SQL catalog's SQLAlchemy URI (`sqlite:///.../catalog.db`,
`postgresql+psycopg2://user@host:port/db`), WAREHOUSE its warehouse; or URI
is a REST catalog server's `http://host:port` (WAREHOUSE, when not empty,
the warehouse to ask it for). The variable TINYFLOW_CATALOG_PROPERTIES, when
set, holds further catalog properties as a JSON object (`s3.endpoint`,
`s3.access-key-id`, ... for a warehouse on S3). Output keys: rows, distinct_ids, id_sum, id_min, id_max,
value_sum (the sum of SUM_COLUMN, when given), files (the data files of
the current snapshot), dump (when the variable TINYFLOW_DUMP_COLUMNS names
columns, comma-separated: every row's values of those columns, as lists, in
table order; binary values as hex strings, decimals as strings, dates and
timestamps in ISO 8601),
partitions (the distinct partition values of the data files, each
{field: value as a string}, sorted), snapshots (each
snapshot's summary, oldest first), properties (the table's).
"""

import datetime
import decimal
import json
import os
import sys
import uuid

from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.catalog.sql import SqlCatalog


def plain(v):
    """A value as JSON takes it: bytes as hex, decimals as strings, dates
    and times in ISO 8601, a map's (key, value) pairs as lists,
    recursively."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, (datetime.date, datetime.datetime, datetime.time)):
        return v.isoformat()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def main() -> None:
    name, uri, warehouse, table_name = sys.argv[1:5]
    id_column = sys.argv[5] if len(sys.argv) > 5 else "id"
    sum_column = sys.argv[6] if len(sys.argv) > 6 else None
    props = json.loads(os.environ.get("TINYFLOW_CATALOG_PROPERTIES") or "{}")
    if uri.startswith(("http://", "https://")):
        props |= {"uri": uri} | ({"warehouse": warehouse} if warehouse else {})
        catalog = RestCatalog(name, **props)
    else:
        catalog = SqlCatalog(name, uri=uri, warehouse=warehouse, **props)
    table = catalog.load_table(table_name)
    data = table.scan().to_arrow()
    ids = data.column(id_column).to_pylist() if data.num_rows else []
    numbers = [i for i in ids if isinstance(i, (int, float))]
    files = table.inspect.files().to_pylist()
    partitions = sorted(
        {
            json.dumps({k: str(v) for k, v in row["partition"].items()}, sort_keys=True)
            for row in files
        }
    )
    snapshots = sorted(table.snapshots(), key=lambda s: (s.sequence_number, s.timestamp_ms))
    dump_columns = [c for c in os.environ.get("TINYFLOW_DUMP_COLUMNS", "").split(",") if c]
    dump = None
    if dump_columns:
        columns = [data.column(c).to_pylist() for c in dump_columns]
        dump = [[plain(v) for v in row] for row in zip(*columns)]
    print(
        json.dumps(
            {
                "rows": data.num_rows,
                "distinct_ids": len(set(ids)),
                "id_sum": sum(numbers),
                "id_min": min(numbers) if numbers else None,
                "id_max": max(numbers) if numbers else None,
                "value_sum": sum(data.column(sum_column).to_pylist())
                if sum_column and data.num_rows
                else None,
                "files": len(files),
                "partitions": [json.loads(p) for p in partitions],
                "snapshots": [
                    {k: v for k, v in (s.summary.additional_properties or {}).items()}
                    | {"operation": s.summary.operation.value}
                    for s in snapshots
                ],
                "properties": dict(table.properties),
                "dump": dump,
            }
        )
    )


if __name__ == "__main__":
    main()

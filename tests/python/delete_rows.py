"""Deletes rows of an Iceberg table with pyiceberg: another engine rewriting
the table under tinyflow (for the maintenance tests, whose expiry must then
delete the data files only the older snapshots held), and prints the new
current snapshot as one JSON object:

    python delete_rows.py CATALOG_NAME URI WAREHOUSE NAMESPACE.TABLE FILTER

URI is the SQL catalog's SQLAlchemy URI (`sqlite:///.../catalog.db`);
FILTER a pyiceberg row filter, such as `part == 0`.
"""

import json
import sys

from pyiceberg.catalog.sql import SqlCatalog


def main() -> None:
    name, uri, warehouse, table_name, row_filter = sys.argv[1:6]
    catalog = SqlCatalog(name, uri=uri, warehouse=warehouse)
    table = catalog.load_table(table_name)
    table.delete(delete_filter=row_filter)
    table = catalog.load_table(table_name)
    print(json.dumps({"snapshot": table.current_snapshot().snapshot_id}))


if __name__ == "__main__":
    main()

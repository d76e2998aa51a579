//! `cargo xtask iceberg-rest start|stop|status [--port N]`: a real Iceberg
//! REST catalog server on loopback for the REST catalog tests.
//!
//! The server is Apache Iceberg's own REST catalog server
//! (`org.apache.iceberg.rest.RESTCatalogServer`, the one behind the
//! `apache/iceberg-rest-fixture` image), from the self-contained
//! `org.apache.iceberg:iceberg-open-api` jar on Maven Central (about 210 MB).
//! It serves the REST protocol over a JDBC catalog; here that catalog is a
//! sqlite file and the warehouse a local directory, both in
//! `target/iceberg-rest/run-<port>/`, so the tables it serves can be checked
//! on disk like the SQL catalog's. It is ready when `GET /v1/config`
//! answers 200; `start` prints
//! `TINYFLOW_REST_CATALOG_URL=http://127.0.0.1:<port>`. The port is
//! `--port N`, else `$TINYFLOW_REST_PORT`, else 8181. What starting and
//! stopping do is in `java.rs`.

use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::java::Spec;

pub(crate) static SPEC: Spec = Spec {
    command: "iceberg-rest",
    what: "REST catalog server",
    artifact: "org.apache.iceberg:iceberg-open-api:1.10.0",
    jar: "iceberg-open-api-1.10.0.jar",
    launch: None,
    download: "about 210 MB",
    main_class: "org.apache.iceberg.rest.RESTCatalogServer",
    default_port: 8181,
    port_env: "TINYFLOW_REST_PORT",
    url_env: "TINYFLOW_REST_CATALOG_URL",
    url_path: "",
    env: &[],
    ready: ("/v1/config", 200),
    configure,
};

fn configure(run_dir: &Path, port: u16, cmd: &mut Command) -> Result<String> {
    let warehouse = run_dir.join("warehouse");
    fs::create_dir_all(&warehouse).with_context(|| format!("creating {}", warehouse.display()))?;
    // The server turns CATALOG_* variables into catalog properties
    // (`CATALOG_REST_PORT` is `rest.port`); none of the caller's may leak in.
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CATALOG_") {
            cmd.env_remove(name);
        }
    }
    cmd.env(
        "CATALOG_URI",
        format!("jdbc:sqlite:file:{}", run_dir.join("catalog.db").display()),
    )
    .env(
        "CATALOG_WAREHOUSE",
        format!("file://{}", warehouse.display()),
    )
    .env("CATALOG_REST_PORT", port.to_string());
    Ok(format!("warehouse {}", warehouse.display()))
}

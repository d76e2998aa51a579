//! The tests' Python side, in a virtual environment in
//! `target/pyiceberg-venv`: pyiceberg (`pyiceberg[sql-sqlite,sql-postgres,pyarrow]`),
//! the independent reader the Iceberg tests check tables with, and
//! confluent-kafka with its Avro (fastavro) and Protobuf serializers, the ordinary
//! producer the Avro tests write topics with, and kubernetes-validate, which
//! checks the example Kubernetes manifests against the schemas it carries
//! (`cargo xtask k8s-validate`); about 40 s the first time, nothing when it
//! is there already.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The pinned packages: pyiceberg (0.12 reads everything iceberg-rust
/// 0.10 writes) and Confluent's Python client with its schema-registry
/// serializers; kubernetes-validate with the schemas of Kubernetes 1.25 to
/// 1.37.
const PACKAGES: &[&str] = &[
    "pyiceberg[sql-sqlite,sql-postgres,pyarrow]==0.12.0",
    "confluent-kafka[avro,protobuf,schemaregistry]==2.16.2",
    "kubernetes-validate==1.37.0",
];

/// Where the environment lives: under the shared target dir, so a clean
/// clone sets it up once and `cargo clean` removes it.
pub(crate) fn venv() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("pyiceberg-venv")
}

/// The environment's python, set up when missing. Returns its path.
pub(crate) fn setup() -> Result<PathBuf> {
    let venv = venv();
    let python = venv.join("bin/python");
    let ready = python.exists()
        && Command::new(&python)
            .args([
                "-c",
                "import pyiceberg, pyarrow, sqlalchemy, psycopg2, fastavro, confluent_kafka.schema_registry.avro, confluent_kafka.schema_registry.protobuf, kubernetes_validate",
            ])
            .status()
            .is_ok_and(|s| s.success());
    if ready {
        eprintln!("xtask: pyiceberg ready in {}", venv.display());
        return Ok(python);
    }
    let host = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    eprintln!("xtask: creating {} with {host}", venv.display());
    let status = Command::new(&host)
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .with_context(|| format!("running {host} (Python 3.10+ is needed for pyiceberg)"))?;
    if !status.success() {
        bail!(
            "{host} -m venv {} failed ({status}); on Debian/Ubuntu install python3-venv",
            venv.display()
        );
    }
    eprintln!("xtask: installing {}", PACKAGES.join(" "));
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(PACKAGES)
        .status()
        .context("running pip")?;
    if !status.success() {
        bail!("pip install {} failed ({status})", PACKAGES.join(" "));
    }
    Ok(python)
}

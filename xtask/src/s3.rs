//! `cargo xtask s3 start|stop|status [--port N]`: an S3 server on loopback
//! for the tests of Iceberg tables on S3 storage.
//!
//! The server is S3Proxy (`org.gaul:s3proxy`, Apache-2.0), which serves the
//! S3 API with AWS signature checks over a storage backend; here the backend
//! is jclouds' `filesystem` provider on `target/s3/run-<port>/data`, so what
//! a test wrote can be looked at on disk (a bucket is a directory). Its
//! self-contained jar on Maven Central is about 50 MB. `start` creates the
//! bucket [`BUCKET`] and prints `TINYFLOW_S3_ENDPOINT=http://127.0.0.1:<port>`;
//! clients sign with the access key [`ACCESS_KEY`] and secret [`SECRET_KEY`]
//! (a loopback test server: they are no secret). It is ready when an
//! unsigned `GET /` is refused with 403. The port is `--port N`, else
//! `$TINYFLOW_S3_PORT`, else 9190. What starting and stopping do is in
//! `java.rs`.

use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::java::Spec;

/// The bucket `start` creates.
pub(crate) const BUCKET: &str = "tinyflow";
/// The access key id the server accepts.
pub(crate) const ACCESS_KEY: &str = "tinyflow";
/// The secret access key of [`ACCESS_KEY`].
pub(crate) const SECRET_KEY: &str = "tinyflow-secret";

pub(crate) static SPEC: Spec = Spec {
    command: "s3",
    what: "S3 server",
    artifact: "org.gaul:s3proxy:3.0.0:jar:jar-with-dependencies",
    jar: "s3proxy-3.0.0-jar-with-dependencies.jar",
    launch: None,
    download: "about 50 MB",
    main_class: "org.gaul.s3proxy.Main",
    default_port: 9190,
    port_env: "TINYFLOW_S3_PORT",
    url_env: "TINYFLOW_S3_ENDPOINT",
    url_path: "",
    env: &[],
    ready: ("/", 403),
    configure,
};

fn configure(run_dir: &Path, port: u16, cmd: &mut Command) -> Result<String> {
    let data = run_dir.join("data");
    let bucket = data.join(BUCKET);
    fs::create_dir_all(&bucket).with_context(|| format!("creating {}", bucket.display()))?;
    let properties = run_dir.join("s3proxy.properties");
    fs::write(
        &properties,
        format!(
            "s3proxy.endpoint=http://127.0.0.1:{port}\n\
             s3proxy.authorization=aws-v2-or-v4\n\
             s3proxy.identity={ACCESS_KEY}\n\
             s3proxy.credential={SECRET_KEY}\n\
             jclouds.provider=filesystem\n\
             jclouds.filesystem.basedir={}\n",
            data.display()
        ),
    )
    .with_context(|| format!("writing {}", properties.display()))?;
    cmd.arg("--properties").arg(&properties);
    Ok(format!(
        "bucket {BUCKET} in {}, access key {ACCESS_KEY}",
        data.display()
    ))
}

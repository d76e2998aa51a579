//! `cargo xtask keycloak start|stop|status [--port N]`: Keycloak, a real
//! OpenID Connect identity provider on loopback, for the tests of
//! OAUTHBEARER with the OIDC client-credentials flow (the way managed Kafka
//! services such as Confluent Cloud or Aiven let a job log in without a
//! password of its own).
//!
//! The server is Keycloak's own distribution
//! (`org.keycloak:keycloak-quarkus-dist`, a zip of about 180 MB on Maven
//! Central), unpacked once into `target/keycloak/dist/` and run with
//! `bin/kc.sh start-dev` on an in-memory database, so every start is empty
//! but for the realm in `tools/keycloak/tinyflow-realm.json`, imported at
//! start: realm [`REALM`] with the confidential client [`CLIENT_ID`] /
//! [`CLIENT_SECRET`] (a loopback test server: no secret), whose access tokens
//! last 20 s (so a test outlives a few) and carry the audience [`AUDIENCE`]
//! the broker expects; and `tinyflow-other-audience`, with the same secret,
//! whose tokens lack it, so the broker must refuse them.
//! Keycloak 26 needs Java 21 or newer: `$TINYFLOW_KEYCLOAK_JAVA_HOME`, else
//! `$JAVA_HOME` if new enough, else the newest JDK under `/usr/lib/jvm`.
//!
//! It is ready when the realm's OpenID configuration answers 200; `start`
//! prints `TINYFLOW_OIDC_ISSUER=http://127.0.0.1:<port>/realms/tinyflow`,
//! `TINYFLOW_OIDC_CLIENT_ID=` and `TINYFLOW_OIDC_CLIENT_SECRET=`.
//! The token endpoint is `<issuer>/protocol/openid-connect/token`, the keys
//! the broker checks tokens with are at `<issuer>/protocol/openid-connect/certs`
//! (`cargo xtask kafka start --oidc-issuer <issuer>`). The port is
//! `--port N`, else `$TINYFLOW_KEYCLOAK_PORT`, else 8380. What starting and
//! stopping do is in `java.rs`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::java::Spec;

/// Keycloak's version, in one place (`concat!` takes only literals).
macro_rules! version {
    () => {
        "26.7.3"
    };
}
const VERSION: &str = version!();
/// The realm the tests' client lives in.
pub(crate) const REALM: &str = "tinyflow";
/// The client a job logs in as.
pub(crate) const CLIENT_ID: &str = "tinyflow";
/// Its secret (in `tools/keycloak/tinyflow-realm.json`).
pub(crate) const CLIENT_SECRET: &str = "tinyflow-oidc-secret";
/// The audience of its access tokens, which the broker requires.
pub(crate) const AUDIENCE: &str = "kafka";
/// The oldest Java Keycloak 26 runs on.
const JAVA_NEEDED: u32 = 21;

pub(crate) static SPEC: Spec = Spec {
    command: "keycloak",
    what: "identity provider (Keycloak)",
    artifact: concat!("org.keycloak:keycloak-quarkus-dist:", version!(), ":zip"),
    jar: concat!("keycloak-quarkus-dist-", version!(), ".zip"),
    launch: Some(launch),
    download: "about 180 MB",
    // The pid is `kc.sh`'s (which forwards SIGTERM to its java), or java's
    // after a re-augmentation (`kc.sh` execs it then): both name the
    // distribution's directory.
    main_class: concat!("keycloak-", version!(), "/"),
    default_port: 8380,
    port_env: "TINYFLOW_KEYCLOAK_PORT",
    url_env: "TINYFLOW_OIDC_ISSUER",
    url_path: "/realms/tinyflow",
    env: &[
        ("TINYFLOW_OIDC_CLIENT_ID", CLIENT_ID),
        ("TINYFLOW_OIDC_CLIENT_SECRET", CLIENT_SECRET),
    ],
    ready: ("/realms/tinyflow/.well-known/openid-configuration", 200),
    configure,
};

/// `bash <dist>/bin/kc.sh start-dev ...` with a Java Keycloak runs on; the
/// distribution is unpacked from `zip` on first use.
fn launch(zip: &Path, _run_dir: &Path) -> Result<Command> {
    let java_home = java_home()?;
    let home = unpacked(zip)?;
    let import = home.join("data/import");
    fs::create_dir_all(&import).with_context(|| format!("creating {}", import.display()))?;
    let realm = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask lies in the workspace root")?
        .join("tools/keycloak/tinyflow-realm.json");
    fs::copy(&realm, import.join("tinyflow-realm.json"))
        .with_context(|| format!("copying {} into {}", realm.display(), import.display()))?;
    let mut path = std::ffi::OsString::from(java_home.join("bin"));
    if let Some(old) = std::env::var_os("PATH") {
        path.push(":");
        path.push(old);
    }
    let mut cmd = Command::new("bash");
    cmd.arg(home.join("bin/kc.sh"))
        .args([
            "start-dev",
            "--db=dev-mem",
            "--import-realm",
            "--http-host=127.0.0.1",
        ])
        .env("JAVA_HOME", &java_home)
        .env("PATH", path)
        .env_remove("JAVA_OPTS");
    // None of the caller's Keycloak settings may leak in.
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("KC_") {
            cmd.env_remove(name);
        }
    }
    Ok(cmd)
}

fn configure(_run_dir: &Path, port: u16, cmd: &mut Command) -> Result<String> {
    cmd.arg(format!("--http-port={port}"));
    Ok(format!(
        "realm {REALM}, client {CLIENT_ID}, token audience {AUDIENCE}"
    ))
}

/// The distribution's home, unpacked beside `zip` (into `../dist`) unless it
/// is there; a half-finished unpack is never taken for a whole one.
fn unpacked(zip: &Path) -> Result<PathBuf> {
    let target = zip
        .parent()
        .and_then(Path::parent)
        .context("the zip lies in target/keycloak/libs")?;
    let dist = target.join("dist");
    let home = dist.join(format!("keycloak-{VERSION}"));
    if home.join("bin/kc.sh").is_file() {
        return Ok(home);
    }
    let partial = target.join("dist.partial");
    if partial.exists() {
        fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    eprintln!(
        "xtask keycloak: unpacking {} into {}",
        zip.display(),
        dist.display()
    );
    // Python's zipfile: python3 is needed anyway (pyiceberg), unzip may not be.
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(zip)
        .arg(&partial)
        .status()
        .context("running python3 -m zipfile")?;
    if !status.success() {
        bail!("unpacking {} failed ({status})", zip.display());
    }
    if dist.exists() {
        fs::remove_dir_all(&dist).with_context(|| format!("removing {}", dist.display()))?;
    }
    fs::rename(&partial, &dist)
        .with_context(|| format!("moving {} to {}", partial.display(), dist.display()))?;
    Ok(home)
}

/// A JDK of at least [`JAVA_NEEDED`]: `$TINYFLOW_KEYCLOAK_JAVA_HOME`, else
/// `$JAVA_HOME`, else the newest under `/usr/lib/jvm`.
fn java_home() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os("TINYFLOW_KEYCLOAK_JAVA_HOME") {
        let home = PathBuf::from(home);
        return match java_major(&home) {
            Some(v) if v >= JAVA_NEEDED => Ok(home),
            v => bail!(
                "TINYFLOW_KEYCLOAK_JAVA_HOME={} is Java {}, Keycloak {VERSION} needs {JAVA_NEEDED} or newer",
                home.display(),
                v.map_or("of unknown version".to_owned(), |v| v.to_string())
            ),
        };
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("JAVA_HOME")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Ok(entries) = fs::read_dir("/usr/lib/jvm") {
        candidates.extend(entries.flatten().map(|e| e.path()));
    }
    candidates
        .into_iter()
        .filter_map(|home| java_major(&home).map(|v| (v, home)))
        .filter(|(v, _)| *v >= JAVA_NEEDED)
        .max_by_key(|(v, _)| *v)
        .map(|(_, home)| home)
        .with_context(|| {
            format!(
                "Keycloak {VERSION} needs Java {JAVA_NEEDED} or newer, and none was found \
                 ($JAVA_HOME, /usr/lib/jvm); install one (e.g. Debian's openjdk-21-jdk-headless \
                 or a Temurin JDK) or set TINYFLOW_KEYCLOAK_JAVA_HOME"
            )
        })
}

/// The major version a JDK's `release` file names (`JAVA_VERSION="25.0.1"`).
fn java_major(home: &Path) -> Option<u32> {
    let release = fs::read_to_string(home.join("release")).ok()?;
    if !home.join("bin/java").is_file() {
        return None;
    }
    release_major(&release)
}

fn release_major(release: &str) -> Option<u32> {
    let version = release
        .lines()
        .find_map(|l| l.strip_prefix("JAVA_VERSION="))?
        .trim_matches('"');
    // "1.8.0_392" is Java 8; "17.0.15" is 17.
    let mut parts = version.split('.');
    match parts.next()?.parse().ok()? {
        1 => parts.next()?.parse().ok(),
        v => Some(v),
    }
}

#[cfg(test)]
mod tests {
    use super::release_major;

    #[test]
    fn java_versions_are_read_from_release_files() {
        assert_eq!(
            release_major("IMPLEMENTOR=\"x\"\nJAVA_VERSION=\"25.0.1\"\n"),
            Some(25)
        );
        assert_eq!(release_major("JAVA_VERSION=\"17.0.15\""), Some(17));
        assert_eq!(release_major("JAVA_VERSION=\"1.8.0_392\""), Some(8));
        assert_eq!(release_major("JAVA_VERSION=\"21\""), Some(21));
        assert_eq!(release_major("NOTHING=1"), None);
    }
}

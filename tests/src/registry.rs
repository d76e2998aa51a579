//! A schema registry for a test, and records produced into a topic by
//! Confluent's own serializers through it.
//!
//! The registry is `tests/python/registry.py`, a small Confluent-compatible
//! server (no real registry installs from the package registries here; see
//! that file). Each test starts its own on a free port, with its state in a
//! file, so it can stop it and start it again on the same port with the
//! same ids, as a real registry comes back after an outage.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running registry; stopped when dropped.
#[derive(Debug)]
pub struct SchemaRegistry {
    child: Option<Child>,
    port: u16,
    state: PathBuf,
    user: Option<String>,
    /// Serving HTTPS: the directory of its CA (`ca.pem`).
    tls: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

fn script(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name)
}

impl SchemaRegistry {
    /// A registry on a free port.
    ///
    /// # Panics
    /// When it does not start (no Python with the test packages).
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// A registry that requires HTTP basic authentication as
    /// `user` (`NAME:PASSWORD`).
    pub fn start_with_auth(user: &str) -> Self {
        Self::start_with(Some(user.to_owned()))
    }

    /// A registry serving HTTPS with a certificate of a CA of its own,
    /// whose certificate [`ca_pem`](Self::ca_pem) is.
    pub fn start_tls() -> Self {
        Self::start_inner(None, true)
    }

    /// The PEM file of the CA of an HTTPS registry.
    pub fn ca_pem(&self) -> PathBuf {
        self.tls
            .as_ref()
            .expect("a registry started with start_tls")
            .join("ca.pem")
    }

    fn start_with(user: Option<String>) -> Self {
        Self::start_inner(user, false)
    }

    fn start_inner(user: Option<String>, tls: bool) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut r = SchemaRegistry {
            child: None,
            port: 0,
            state: dir.path().join("registry.json"),
            user,
            tls: tls.then(|| dir.path().join("tls")),
            _dir: dir,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(crate::python());
        cmd.arg(script("registry.py"))
            .args(["--port", &self.port.to_string()])
            .arg("--state")
            .arg(&self.state)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(u) = &self.user {
            cmd.args(["--user", u]);
        }
        if let Some(t) = &self.tls {
            cmd.arg("--tls-dir").arg(t);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "the test schema registry needs Python ({}): {e}; run `cargo xtask py-setup`",
                crate::python().display()
            )
        });
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("the registry's first line");
        let port = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the schema registry did not start: {line:?}"));
        self.port = port;
        self.child = Some(child);
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Registers Avro `schema` under `subject` as a producer would
    /// (`POST /subjects/<subject>/versions`): its id.
    ///
    /// # Panics
    /// When the registry does not answer with one.
    pub fn register(&self, subject: &str, schema: &str) -> u32 {
        use std::io::Read;
        let body = serde_json::json!({ "schema": schema }).to_string();
        let mut stream =
            std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("the registry listens");
        write!(
            stream,
            "POST /subjects/{subject}/versions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/vnd.schemaregistry.v1+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .expect("the request is sent");
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .expect("the registry answers");
        let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(json)
            .ok()
            .and_then(|v| v.get("id")?.as_u64())
            .and_then(|id| u32::try_from(id).ok())
            .unwrap_or_else(|| panic!("the registry did not register the schema: {answer}"))
    }

    /// How many schemas it holds (each registered schema text once).
    pub fn schema_count(&self) -> usize {
        std::fs::read_to_string(&self.state)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("schemas")?.as_array().map(Vec::len))
            .unwrap_or(0)
    }

    /// Stops it (connections are refused until [`restart`](Self::restart)).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, with the same schemas and ids.
    pub fn restart(&mut self) {
        self.stop();
        // The port was just released; a moment's retry covers TIME_WAIT.
        for _ in 0..50 {
            if std::net::TcpListener::bind(("127.0.0.1", self.port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.spawn();
    }
}

impl Drop for SchemaRegistry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Produces `lines` (see `tests/python/produce.py`: `{"avro": schema}`
/// switches the schema, `{"value": v, "partition": p}` is a record,
/// `{"raw": hex}` bytes as they are) into `topic` with Confluent's
/// serializers, registering schemas in `registry`; `env` adds settings
/// (`TINYFLOW_SUBJECT_STRATEGY`, `TINYFLOW_REGISTRY_AUTH`,
/// `TINYFLOW_TRANSACTIONAL_ID`). Returns how many records were sent.
///
/// # Panics
/// When the producer fails.
pub fn produce_avro(
    bootstrap: &str,
    topic: &str,
    registry: &str,
    lines: &[serde_json::Value],
    env: &[(&str, &str)],
) -> u64 {
    spawn_produce_avro(bootstrap, topic, registry, lines, env).finish()
}

/// A producer still running (one waiting for a file, say).
#[derive(Debug)]
pub struct Producing(Child);

impl Producing {
    /// Waits for it to end: the number of records sent.
    ///
    /// # Panics
    /// When it failed.
    pub fn finish(self) -> u64 {
        let out = self.0.wait_with_output().expect("produce.py ends");
        assert!(
            out.status.success(),
            "produce.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("produce.py prints the number of records sent")
    }
}

/// [`produce_avro`] without waiting for the end.
pub fn spawn_produce_avro(
    bootstrap: &str,
    topic: &str,
    registry: &str,
    lines: &[serde_json::Value],
    env: &[(&str, &str)],
) -> Producing {
    let mut child = Command::new(crate::python())
        .arg(script("produce.py"))
        .args([bootstrap, topic, registry])
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs produce.py");
    {
        let mut stdin = child.stdin.take().expect("piped");
        for l in lines {
            writeln!(stdin, "{l}").expect("produce.py reads its input");
        }
    }
    Producing(child)
}
